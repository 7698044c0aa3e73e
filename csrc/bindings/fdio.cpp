// Checkpoint writes without the GIL (cudist.train): a buffer to a file descriptor in chunks, each
// chunk's CRC-32 folded right after its write(2), while the chunk is still in the cache.
//
// The Python loop this replaces (os.write of a 1 MiB slice, then _core.crc32 of it) took the GIL back
// twice per MiB, ~500 times per 256 MiB checkpoint; a background write then waited behind the
// training loop's thread for it, and held that thread up each time it had it. Here the GIL is
// released once per tensor. Interrupted writes (EINTR) run Python's signal handlers, as os.write
// does (PEP 475): a handler that raises ends the write with its exception.
#include "fdio.hpp"

#include <pybind11/pybind11.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>

#ifndef _WIN32
#include <unistd.h>
#endif

#include "crc32.hpp"

namespace py = pybind11;

namespace cudist_bindings {
#ifndef _WIN32
namespace {

// Writes buf[0:len] at the descriptor's offset, continuing short writes; returns 0 or an errno value.
// Called without the GIL. A signal ends a blocked write early (EINTR, or a short count once some
// bytes went): then the GIL is taken to run Python's handlers, as the Python loop would between two
// os.write calls; a handler's exception is left set and reported as -1. Regular files rarely do either.
int write_all(int fd, const unsigned char* buf, size_t len) {
  while (len > 0) {
    const ssize_t n = ::write(fd, buf, len);
    if (n < 0 && errno != EINTR) return errno;
    if (n == 0) return EIO;  // no progress and no error: never retried into a hang
    if (n > 0) {
      buf += n;
      len -= static_cast<size_t>(n);
    }
    if (len > 0) {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) return -1;
    }
  }
  return 0;
}

uint32_t write_crc32(int fd, py::object data, size_t chunk, uint32_t value) {
  if (chunk == 0) throw py::value_error("write_crc32: chunk must be positive");
  Py_buffer view;  // bytes, bytearray, memoryview, a contiguous array; a strided one raises
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
  const auto* p = static_cast<const unsigned char*>(view.buf);
  const auto size = static_cast<size_t>(view.len);
  int err = 0;
  {
    py::gil_scoped_release nogil;
    for (size_t start = 0; start < size && err == 0; start += chunk) {
      const size_t n = size - start < chunk ? size - start : chunk;
      err = write_all(fd, p + start, n);
      if (err == 0) value = crc32(p + start, n, value);
    }
  }
  PyBuffer_Release(&view);
  if (err == -1) throw py::error_already_set();  // a signal handler's exception
  if (err != 0) {
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);  // the OSError subclass of the errno, as os.write raises
    throw py::error_already_set();
  }
  return value;
}

}  // namespace
#endif

void bind_fdio([[maybe_unused]] py::module_& m) {
#ifndef _WIN32  // Windows: no write(2); _format writes through os.write there
  m.def("write_crc32", &write_crc32, py::arg("fd"), py::arg("data"), py::arg("chunk") = size_t{1} << 20,
        py::arg("value") = 0,
        "Writes the C-contiguous buffer ``data`` to ``fd`` (at its offset, every byte: short writes are "
        "continued) in ``chunk``-byte write(2) calls and returns zlib.crc32(data, value), each chunk summed "
        "right after its write. The GIL is released throughout, except to run signal handlers after EINTR "
        "(one that raises ends the write). Raises OSError (the errno's subclass) when a write fails.");
#endif
}

}  // namespace cudist_bindings
