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
#include <cstring>

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
// ``offset`` >= 0: pwrite(2) there (the descriptor's offset unchanged).
int write_all(int fd, const unsigned char* buf, size_t len, int64_t offset = -1) {
  while (len > 0) {
    const ssize_t n = offset < 0 ? ::write(fd, buf, len) : ::pwrite(fd, buf, len, static_cast<off_t>(offset));
    if (n > 0 && offset >= 0) offset += n;
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

[[noreturn]] void raise_errno(int err) {
  if (err == -1) throw py::error_already_set();  // a signal handler's exception
  errno = err;
  PyErr_SetFromErrno(PyExc_OSError);  // the OSError subclass of the errno, as os.write raises
  throw py::error_already_set();
}

constexpr size_t kDirectAlign = 4096;

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
  if (err != 0) raise_errno(err);
  return value;
}

// A 4096-aligned, writable buffer whose length is a multiple of 4096 (O_DIRECT's constraints).
struct Bounce {
  Py_buffer view{};
  explicit Bounce(py::object obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
    if (reinterpret_cast<uintptr_t>(view.buf) % kDirectAlign != 0 || view.len == 0 || view.len % kDirectAlign != 0) {
      PyBuffer_Release(&view);
      throw py::value_error("direct writes need a bounce buffer 4096-aligned, of a positive multiple of 4096 bytes");
    }
  }
  ~Bounce() { PyBuffer_Release(&view); }
  Bounce(const Bounce&) = delete;
  Bounce& operator=(const Bounce&) = delete;
  unsigned char* data() const { return static_cast<unsigned char*>(view.buf); }
  size_t size() const { return static_cast<size_t>(view.len); }
};

// Appends ``data`` to a file written with O_DIRECT through ``bounce``: bounce[0:fill] holds the bytes
// not yet written, which go at file ``offset``. Each piece is copied into the bounce buffer and summed
// there while it is in cache; a full buffer is written at once (aligned offset and length). Returns
// (zlib.crc32(data, value), fill, offset) for the next call.
py::tuple direct_append_crc32(int fd, py::object data, py::object bounce, size_t fill, int64_t offset, uint32_t value) {
  Bounce b(bounce);
  if (fill >= b.size() || offset < 0 || offset % static_cast<int64_t>(kDirectAlign) != 0)
    throw py::value_error("direct_append_crc32: fill must be below the bounce buffer's size, offset aligned");
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
  const auto* p = static_cast<const unsigned char*>(view.buf);
  size_t left = static_cast<size_t>(view.len);
  int err = 0;
  {
    py::gil_scoped_release nogil;
    constexpr size_t kPiece = size_t{256} << 10;  // copied, then summed from L2
    while (left > 0 && err == 0) {
      size_t n = b.size() - fill;
      n = n < left ? n : left;
      n = n < kPiece ? n : kPiece;
      std::memcpy(b.data() + fill, p, n);
      value = crc32(b.data() + fill, n, value);
      p += n;
      left -= n;
      fill += n;
      if (fill == b.size()) {
        err = write_all(fd, b.data(), fill, offset);
        offset += static_cast<int64_t>(fill);
        fill = 0;
      }
    }
  }
  PyBuffer_Release(&view);
  if (err != 0) raise_errno(err);
  return py::make_tuple(value, fill, offset);
}

// Writes what the bounce buffer holds (its length rounded up to 4096, as O_DIRECT needs) and cuts the
// file to ``offset + fill`` bytes.
void direct_finish(int fd, py::object bounce, size_t fill, int64_t offset) {
  Bounce b(bounce);
  if (fill >= b.size() || offset < 0 || offset % static_cast<int64_t>(kDirectAlign) != 0)
    throw py::value_error("direct_finish: fill must be below the bounce buffer's size, offset aligned");
  int err = 0;
  {
    py::gil_scoped_release nogil;
    const size_t padded = (fill + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    std::memset(b.data() + fill, 0, padded - fill);
    if (padded > 0) err = write_all(fd, b.data(), padded, offset);
    if (err == 0 && ::ftruncate(fd, static_cast<off_t>(offset + static_cast<int64_t>(fill))) != 0) err = errno;
  }
  if (err != 0) raise_errno(err);
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
  m.def("direct_append_crc32", &direct_append_crc32, py::arg("fd"), py::arg("data"), py::arg("bounce"),
        py::arg("fill"), py::arg("offset"), py::arg("value") = 0,
        "Appends ``data`` (C-contiguous) to a file opened with O_DIRECT, through ``bounce`` (4096-aligned, a "
        "multiple of 4096 bytes): bounce[0:fill] holds the bytes still to be written at file ``offset`` "
        "(aligned). Each piece is copied into the bounce buffer and its CRC-32 folded there; a full buffer is "
        "written with pwrite(2). Returns (zlib.crc32(data, value), fill, offset) for the next call. No GIL "
        "(except for signal handlers, as write_crc32). OSError when a write fails.");
  m.def("direct_finish", &direct_finish, py::arg("fd"), py::arg("bounce"), py::arg("fill"), py::arg("offset"),
        "Writes bounce[0:fill] at ``offset`` (zero-padded to 4096 bytes, as O_DIRECT needs) and truncates the "
        "file to offset + fill bytes. OSError when either fails.");
#endif
}

}  // namespace cudist_bindings
