// cudist._core: the C++ kernels of <cudist/cudist.hpp> for NumPy arrays.
//
// The Python layer (cudist._kernels._native) validates arguments with the shared, descriptive
// messages of KernelBackend; the checks here are the cheap ones that keep a direct call from
// crashing the interpreter. Arrays are read through pybind11's struct proxies rather than the
// buffer protocol, since a 4 KiB all-reduce must cost microseconds in all.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cudist/cudist.hpp>

#include "crc32.hpp"
#include "fdio.hpp"

#ifdef CUDIST_CORE_WITH_CUDA
#include <cuda_runtime_api.h>

#include <cudist/cuda/launch.hpp>
#include <cudist/cuda/p2p.hpp>
#endif

namespace py = pybind11;

namespace {

enum class kind { f16, f32, f64, i32, i64, bf16 };
constexpr kind kKinds[] = {kind::f16, kind::f32, kind::f64, kind::i32, kind::i64, kind::bf16};
constexpr const char* kSupportedDtypes = "(supported: float16, float32, float64, int32, int64, bfloat16)";

// Below this many bytes moved, the GIL is kept: releasing and retaking it costs more than the work.
constexpr std::size_t kReleaseGilBytes = std::size_t{64} << 10;

// How NumPy marks the non-native byte order ('=' or '<'/'>' matching the machine are native).
#if PY_LITTLE_ENDIAN
constexpr char kSwappedByteOrder = '>';
#else
constexpr char kSwappedByteOrder = '<';
#endif

struct arr_info {
  void* data;
  std::size_t size;
  kind k;
};

const char* kind_name(kind k) {
  switch (k) {
    case kind::f16: return "float16";
    case kind::f32: return "float32";
    case kind::f64: return "float64";
    case kind::i32: return "int32";
    case kind::bf16: return "bfloat16";
    default: return "int64";
  }
}

using array_proxy_t = py::detail::PyArray_Proxy;

PyTypeObject* ndarray_type() { return reinterpret_cast<PyTypeObject*>(py::detail::npy_api::get().PyArray_Type_); }

// Elements of an array (the product of its dimensions).
std::size_t elements(const array_proxy_t* a) {
  std::size_t size = 1;
  for (int d = 0; d < a->nd; ++d) size *= static_cast<std::size_t>(a->dimensions[d]);
  return size;
}

// ml_dtypes.bfloat16, recognised by its scalar type's name (cudist never imports ml_dtypes); NumPy
// files it under kind 'V' like structured dtypes, which have no such name.
bool is_bfloat16_descr(const py::detail::PyArrayDescr_Proxy* d) {
  const char* name = d->typeobj != nullptr ? reinterpret_cast<PyTypeObject*>(d->typeobj)->tp_name : nullptr;
  if (name == nullptr) return false;
  const char* dot = std::strrchr(name, '.');
  return std::strcmp(dot != nullptr ? dot + 1 : name, "bfloat16") == 0;
}

// The kernel dtype of an array's descriptor; false for other dtypes and the swapped byte order.
bool kind_of(PyObject* descr, kind& k) {
  auto* d = py::detail::array_descriptor_proxy(descr);
  if (d->byteorder == kSwappedByteOrder) return false;
  const py::ssize_t itemsize = py::reinterpret_borrow<py::dtype>(descr).itemsize();
  if (d->kind == 'f') {
    if (itemsize == 2) k = kind::f16;
    else if (itemsize == 4) k = kind::f32;
    else if (itemsize == 8) k = kind::f64;
    else return false;
  } else if (d->kind == 'i') {
    if (itemsize == 4) k = kind::i32;
    else if (itemsize == 8) k = kind::i64;
    else return false;
  } else if (d->kind == 'V' && itemsize == 2 && is_bfloat16_descr(d)) {
    k = kind::bf16;
  } else {
    return false;
  }
  return true;
}

arr_info inspect(py::handle h, const char* where, const char* what, std::size_t index, bool writable) {
  if (!py::isinstance<py::array>(h)) {
    throw py::type_error(std::string(where) + ": " + what + " " + std::to_string(index) + " is not a numpy.ndarray");
  }
  auto* a = py::detail::array_proxy(h.ptr());
  kind k;
  if (py::detail::array_descriptor_proxy(a->descr)->byteorder == kSwappedByteOrder) {
    throw py::type_error(std::string(where) + ": " + what + " " + std::to_string(index) + " is not in native byte order");
  } else if (!kind_of(a->descr, k)) {
    throw py::type_error(std::string(where) + ": unsupported dtype for " + what + " " + std::to_string(index) + " " +
                         kSupportedDtypes);
  }
  constexpr int c_contiguous = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_;
  constexpr int writeable = py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  if (!(a->flags & c_contiguous)) {
    throw py::value_error(std::string(where) + ": " + what + " " + std::to_string(index) + " is not C-contiguous");
  }
  if (writable && !(a->flags & writeable)) {
    throw py::value_error(std::string(where) + ": " + what + " " + std::to_string(index) + " is read-only");
  }
  return {a->data, elements(a), k};
}

// The arrays of a tuple or list, all of one dtype and size; their data pointers go to ``ptrs``.
//
// Returns a tuple of the arrays, which the caller must hold until the kernel is done: a kernel
// that runs without the GIL must not depend on a list that another thread may empty meanwhile
// (freeing the arrays under the kernel). A tuple argument is returned as is.
py::tuple inspect_all(py::handle seq, const char* where, const char* what, bool writable, std::vector<void*>& ptrs,
                      std::size_t& size, kind& k, bool same_size = true) {
  py::tuple items_tuple;
  if (PyTuple_Check(seq.ptr())) {
    items_tuple = py::reinterpret_borrow<py::tuple>(seq);
  } else if (PyList_Check(seq.ptr())) {
    items_tuple = py::reinterpret_steal<py::tuple>(PyList_AsTuple(seq.ptr()));
    if (!items_tuple) throw py::error_already_set();
  } else {
    throw py::type_error(std::string(where) + ": expected a tuple or list of arrays");
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(items_tuple.ptr());
  if (n == 0) throw py::value_error(std::string(where) + ": expected at least one array, got none");
  PyObject** items = &PyTuple_GET_ITEM(items_tuple.ptr(), 0);
  ptrs.resize(static_cast<std::size_t>(n));
  kind k0 = kind::f32;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const arr_info info = inspect(items[i], where, what, static_cast<std::size_t>(i), writable);
    if (i == 0) {
      k0 = info.k;
      size = info.size;
    } else if (info.k != k0) {
      throw py::type_error(std::string(where) + ": " + what + " " + std::to_string(i) + " has dtype " +
                           kind_name(info.k) + " but " + what + " 0 has dtype " + kind_name(k0));
    } else if (same_size && info.size != size) {
      throw py::value_error(std::string(where) + ": " + what + " " + std::to_string(i) + " has " +
                            std::to_string(info.size) + " elements but " + what + " 0 has " + std::to_string(size));
    }
    ptrs[static_cast<std::size_t>(i)] = info.data;
  }
  k = k0;
  return items_tuple;
}

void* inspect_like(py::handle h, const char* where, const char* what, kind k, std::size_t size, bool writable) {
  const arr_info info = inspect(h, where, what, 0, writable);
  if (info.k != k) {
    throw py::type_error(std::string(where) + ": " + what + " has dtype " + kind_name(info.k) + " but the replicas have dtype " +
                         kind_name(k));
  }
  if (info.size != size) {
    throw py::value_error(std::string(where) + ": " + what + " has " + std::to_string(info.size) +
                          " elements but the replicas have " + std::to_string(size));
  }
  return info.data;
}

// Calls fn(T{}) with T the C++ type of kind k.
template <class F>
void dispatch(kind k, F&& fn) {
  switch (k) {
    case kind::f16: fn(cudist::half{}); break;
    case kind::f32: fn(float{}); break;
    case kind::f64: fn(double{}); break;
    case kind::i32: fn(std::int32_t{}); break;
    case kind::i64: fn(std::int64_t{}); break;
    case kind::bf16: fn(cudist::bfloat16{}); break;
  }
}

template <class F>
void dispatch_float(kind k, const char* where, F&& fn) {
  switch (k) {
    case kind::f16: fn(cudist::half{}); break;
    case kind::f32: fn(float{}); break;
    case kind::f64: fn(double{}); break;
    default: throw py::type_error(std::string(where) + ": needs a floating-point dtype, got " + kind_name(k));
  }
}

std::size_t itemsize(kind k) {
  switch (k) {
    case kind::f16: case kind::bf16: return 2;
    case kind::f32: case kind::i32: return 4;
    default: return 8;
  }
}

// Runs fn without the GIL when it moves enough bytes to be worth it.
template <class F>
void maybe_nogil(std::size_t bytes, F&& fn) {
  if (bytes >= kReleaseGilBytes) {
    py::gil_scoped_release nogil;
    fn();
  } else {
    fn();
  }
}

// cudist.ReduceOp.SUM and .MEAN, registered by cudist._kernels._native (register_reduce_ops), so
// that the Python layer can pass its enum members straight through (no mapping on the hot path).
PyObject* g_sum_op = nullptr;
PyObject* g_mean_op = nullptr;

cudist::reduce_op to_op(int op) {
  if (op != 0 && op != 1) throw py::value_error("op must be 0 (SUM) or 1 (MEAN), got " + std::to_string(op));
  return static_cast<cudist::reduce_op>(op);
}

// An op given as 0 / 1 or as a registered ReduceOp member.
cudist::reduce_op to_op(py::handle op) {
  if (op.ptr() == g_sum_op && op.ptr() != nullptr) return cudist::reduce_op::sum;
  if (op.ptr() == g_mean_op && op.ptr() != nullptr) return cudist::reduce_op::mean;
  if (PyLong_Check(op.ptr()) && !PyBool_Check(op.ptr())) {
    const long v = PyLong_AsLong(op.ptr());
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (v == 0 || v == 1) return static_cast<cudist::reduce_op>(v);
  }
  throw py::value_error("op must be ReduceOp.SUM or ReduceOp.MEAN (or 0 / 1), got " + std::string(py::repr(op)));
}

void register_reduce_ops(py::object sum, py::object mean) {
  Py_XDECREF(g_sum_op);
  Py_XDECREF(g_mean_op);
  g_sum_op = sum.release().ptr();  // kept for the life of the process
  g_mean_op = mean.release().ptr();
}

// True when the byte ranges of two buffers of `bytes` bytes overlap at all.
bool ranges_overlap(const void* a, const void* b, std::size_t bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return bytes > 0 && x < y + bytes && y < x + bytes;
}

template <class T>
T* const* typed(std::vector<void*>& p) {
  return reinterpret_cast<T* const*>(p.data());
}

void all_reduce(py::handle bufs, py::handle op_h) {
  const auto op = to_op(op_h);
  std::vector<void*> p;
  std::size_t size = 0;
  kind k;
  const py::tuple keep = inspect_all(bufs, "all_reduce", "replica", true, p, size, k);
  maybe_nogil(2 * p.size() * size * itemsize(k), [&] {
    dispatch(k, [&](auto t) {
      using T = decltype(t);
      cudist::all_reduce<T>(typed<T>(p), p.size(), size, op);
    });
  });
}

void reduce_to_one(py::handle bufs, py::handle op_h, py::handle out) {
  const auto op = to_op(op_h);
  std::vector<void*> p;
  std::size_t size = 0;
  kind k;
  const py::tuple keep = inspect_all(bufs, "reduce_to_one", "replica", false, p, size, k);
  void* o = inspect_like(out, "reduce_to_one", "out", k, size, true);
  maybe_nogil((p.size() + 1) * size * itemsize(k), [&] {
    dispatch(k, [&](auto t) {
      using T = decltype(t);
      cudist::reduce_to_one<T>(typed<T>(p), p.size(), size, op, static_cast<T*>(o));
    });
  });
}

// ---- the checks of the *_shared reductions, which decline (return None) rather than raise
// `h` as an exact, C-contiguous numpy.ndarray with `shape`'s dimensions and kernel dtype `k` (the
// descriptor `descr`, whose kind is k, or another of the same kind), else nullptr.
array_proxy_t* input_like(PyObject* h, const array_proxy_t* shape, PyObject* descr, kind k) {
  if (Py_TYPE(h) != ndarray_type()) return nullptr;
  auto* a = py::detail::array_proxy(h);
  if (!(a->flags & py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_) || a->nd != shape->nd) return nullptr;
  for (int d = 0; d < a->nd; ++d)
    if (a->dimensions[d] != shape->dimensions[d]) return nullptr;
  kind ka;
  if (a->descr != descr && (!kind_of(a->descr, ka) || ka != k)) return nullptr;
  return a;
}

// `out` as an exact, writable, C-contiguous numpy.ndarray of kernel dtype `k` and `size` elements,
// else nullptr.
array_proxy_t* output_fits(PyObject* out, kind k, std::size_t size) {
  if (Py_TYPE(out) != ndarray_type()) return nullptr;
  auto* o = py::detail::array_proxy(out);
  constexpr int needed = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  kind ko;
  if ((o->flags & needed) != needed || !kind_of(o->descr, ko) || ko != k || elements(o) != size) return nullptr;
  return o;
}

py::tuple as_leaf_tuple(py::handle seq, const char* where, const char* what);  // defined below

// `seq` as a tuple (into `out`) when it is a tuple or list; false for anything else, which the
// *_shared reductions and settle_plain decline.
bool sequence_tuple(PyObject* seq, py::tuple& out) {
  if (!PyTuple_Check(seq) && !PyList_Check(seq)) return false;
  out = as_leaf_tuple(seq, "", "");  // cannot raise: a tuple or list
  return true;
}

// The kernel dtype (into `k`) in which a *_shared reduction reduces inputs like `first`; false where
// it declines: not an exact numpy.ndarray, not a kernel dtype, or an integer MEAN (which gives
// floats, TF's rule, and is the caller's to compute).
bool shared_kind(PyObject* first, cudist::reduce_op op, kind& k) {
  if (Py_TYPE(first) != ndarray_type() || !kind_of(py::detail::array_proxy(first)->descr, k)) return false;
  return !(op == cudist::reduce_op::mean && (k == kind::i32 || k == kind::i64));
}

// The output of a *_shared reduction: `out` itself, or -- when `out` is a callable such as the
// pool's take(shape, dtype) -- what it returns for `shape` and `descr`, called only once the inputs
// have passed (a declined call takes no buffer). `made` keeps that result alive.
template <class Shape>
py::handle shared_output(py::handle out, Shape&& shape, PyObject* descr, py::object& made) {
  if (Py_TYPE(out.ptr()) == ndarray_type() || !PyCallable_Check(out.ptr())) return out;
  made = py::reinterpret_borrow<py::object>(out)(shape(), py::reinterpret_borrow<py::object>(descr));
  return made;
}

// The user's one-array all-reduce on CPU replicas (cudist._dataplane.reduce): reduce_to_one of
// the N arrays into `out` (a pooled buffer of theirs), made read-only, returned as [out] + N-1 views
// of it (one distinct read-only object per replica, as TF's tensors are). Returns None, doing
// nothing, unless bufs is a list or tuple of at least 2 numpy.ndarray (exactly) of one shape and
// one kernel dtype, all C-contiguous, and out a writable C-contiguous array of that dtype and size
// (or a callable out(shape, dtype) returning one: see shared_output): the caller's general path
// then takes the call (and reports what is wrong). Replaces ~3 us of Python checks and views per
// call with ~0.5 us.
py::object reduce_to_one_shared(py::handle bufs, py::handle op_h, py::handle out) {
  const auto op = to_op(op_h);
  py::tuple items_tuple;
  if (!sequence_tuple(bufs.ptr(), items_tuple)) return py::none();
  const Py_ssize_t n = PyTuple_GET_SIZE(items_tuple.ptr());
  if (n < 2) return py::none();
  PyObject* first = PyTuple_GET_ITEM(items_tuple.ptr(), 0);
  kind k;
  if (!shared_kind(first, op, k)) return py::none();
  auto* a0 = py::detail::array_proxy(first);
  std::vector<void*> p(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    auto* a = input_like(PyTuple_GET_ITEM(items_tuple.ptr(), i), a0, a0->descr, k);
    if (a == nullptr) return py::none();
    p[static_cast<std::size_t>(i)] = a->data;
  }
  const std::size_t size = elements(a0);
  py::object made;
  out = shared_output(out, [&] { return py::reinterpret_borrow<py::object>(first).attr("shape"); }, a0->descr, made);
  auto* o = output_fits(out.ptr(), k, size);
  if (o == nullptr) return py::none();
  void* dst = o->data;
  maybe_nogil((p.size() + 1) * size * itemsize(k), [&] {
    dispatch(k, [&](auto t) {
      using T = decltype(t);
      cudist::reduce_to_one<T>(typed<T>(p), p.size(), size, op, static_cast<T*>(dst));
    });
  });
  o->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;  // before the views: each view is then read-only too
  py::list results(n);
  results[0] = out;
  auto& api = py::detail::npy_api::get();
  for (Py_ssize_t i = 1; i < n; ++i) {
    PyObject* v = api.PyArray_View_(out.ptr(), nullptr, nullptr);  // out.view()
    if (v == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(results.ptr(), i, v);
  }
  return std::move(results);
}

void broadcast(py::handle src, py::handle dsts) {
  std::vector<void*> p;
  std::size_t size = 0;
  kind k;
  const py::tuple keep = inspect_all(dsts, "broadcast", "destination", true, p, size, k);
  const void* s = inspect_like(src, "broadcast", "src", k, size, false);
  maybe_nogil((p.size() + 1) * size * itemsize(k), [&] {
    dispatch(k, [&](auto t) {
      using T = decltype(t);
      cudist::broadcast<T>(static_cast<const T*>(s), typed<T>(p), p.size(), size);
    });
  });
}

// Out of place: outputs[i] = reduce(inputs). With `strict`, any overlap other than outputs[i]
// being exactly inputs[i] is refused (ValueError); without, the C++ kernel copes with it.
void all_reduce_into(py::handle inputs, py::handle outputs, py::handle op_h, bool strict) {
  const auto op = to_op(op_h);
  std::vector<void*> pi, po;
  std::size_t size = 0, osize = 0;
  kind k, ko;
  const py::tuple keep_i = inspect_all(inputs, "all_reduce", "input", false, pi, size, k);
  const py::tuple keep_o = inspect_all(outputs, "all_reduce", "output", true, po, osize, ko);
  if (po.size() != pi.size())
    throw py::value_error("all_reduce: got " + std::to_string(pi.size()) + " inputs but " + std::to_string(po.size()) +
                          " outputs");
  if (ko != k)
    throw py::type_error(std::string("all_reduce: the outputs have dtype ") + kind_name(ko) + " but the inputs have dtype " +
                         kind_name(k));
  if (osize != size)
    throw py::value_error("all_reduce: the outputs have " + std::to_string(osize) + " elements but the inputs have " +
                          std::to_string(size));
  const std::size_t n = pi.size(), bytes = size * itemsize(k);
  if (strict) {
    for (std::size_t o = 0; o < n; ++o) {
      for (std::size_t i = 0; i < n; ++i)
        if (ranges_overlap(po[o], pi[i], bytes) && !(i == o && po[o] == pi[i]))
          throw py::value_error("all_reduce: output " + std::to_string(o) + " overlaps input " + std::to_string(i));
      for (std::size_t j = 0; j < o; ++j)
        if (ranges_overlap(po[o], po[j], bytes))
          throw py::value_error("all_reduce: output " + std::to_string(o) + " overlaps output " + std::to_string(j));
    }
  }
  maybe_nogil(2 * n * bytes, [&] {
    dispatch(k, [&](auto t) {
      using T = decltype(t);
      cudist::all_reduce<T>(reinterpret_cast<const T* const*>(pi.data()), typed<T>(po), n, size, op);
    });
  });
}

// A tuple or list as a tuple (a list is copied, so a kernel running without the GIL cannot have it
// emptied underneath).
py::tuple as_leaf_tuple(py::handle seq, const char* where, const char* what) {
  if (PyTuple_Check(seq.ptr())) return py::reinterpret_borrow<py::tuple>(seq);
  if (PyList_Check(seq.ptr())) {
    auto t = py::reinterpret_steal<py::tuple>(PyList_AsTuple(seq.ptr()));
    if (!t) throw py::error_already_set();
    return t;
  }
  throw py::type_error(std::string(where) + ": " + what + " must be a tuple or list");
}

// The leaves of a batched kernel: rows[r][j] is leaf j of row r (rows 0..n-1 the input replicas,
// then, for batch_all_reduce, n output replicas). Every leaf has one dtype and leaf j one size in
// every row; leaf j of row r goes to ptrs[j * n + r % n]. `keep` holds every row's tuple while the
// kernel runs without the GIL.
struct batch_leaves {
  std::vector<py::tuple> keep;
  std::vector<void*> in, out;
  std::vector<std::size_t> counts;
  std::size_t n = 0, m = 0, total = 0;
  kind k = kind::f32;
};

batch_leaves inspect_batch(const char* where, const py::tuple& ins, const py::tuple* outs) {
  batch_leaves b;
  b.n = static_cast<std::size_t>(PyTuple_GET_SIZE(ins.ptr()));
  const std::size_t n = b.n;
  if (n == 0) throw py::value_error(std::string(where) + ": expected at least one replica, got none");
  if (outs != nullptr && static_cast<std::size_t>(PyTuple_GET_SIZE(outs->ptr())) != n)
    throw py::value_error(std::string(where) + ": got " + std::to_string(n) + " input replicas but " +
                          std::to_string(PyTuple_GET_SIZE(outs->ptr())) + " output replicas");
  const std::size_t rows = outs != nullptr ? 2 * n : n;
  b.keep.reserve(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    py::handle h = r < n ? PyTuple_GET_ITEM(ins.ptr(), r) : PyTuple_GET_ITEM(outs->ptr(), r - n);
    b.keep.push_back(as_leaf_tuple(h, where, r < n ? "inputs[r]" : "outputs[r]"));
    const std::size_t mr = static_cast<std::size_t>(PyTuple_GET_SIZE(b.keep.back().ptr()));
    if (r == 0) b.m = mr;
    else if (mr != b.m)
      throw py::value_error(std::string(where) + ": " + (r < n ? "input" : "output") + " replica " +
                            std::to_string(r < n ? r : r - n) + " has " + std::to_string(mr) + " leaves but input replica 0 has " +
                            std::to_string(b.m));
  }
  const std::size_t m = b.m;
  b.in.resize(m * n);
  if (outs != nullptr) b.out.resize(m * n);
  b.counts.resize(m);
  for (std::size_t r = 0; r < rows; ++r) {
    const bool is_out = r >= n;
    const std::size_t rep = is_out ? r - n : r;
    PyObject** items = m ? &PyTuple_GET_ITEM(b.keep[r].ptr(), 0) : nullptr;
    for (std::size_t j = 0; j < m; ++j) {
      const arr_info info = inspect(items[j], where, is_out ? "output leaf" : "input leaf", j, is_out);
      if (r == 0 && j == 0) b.k = info.k;
      if (info.k != b.k)
        throw py::type_error(std::string(where) + ": leaf " + std::to_string(j) + " of replica " + std::to_string(rep) +
                             " has dtype " + kind_name(info.k) + " but leaf 0 of replica 0 has dtype " + kind_name(b.k));
      if (r == 0) {
        b.counts[j] = info.size;
        b.total += info.size;
      } else if (info.size != b.counts[j]) {
        throw py::value_error(std::string(where) + ": " + (is_out ? "output" : "input") + " leaf " + std::to_string(j) +
                              " of replica " + std::to_string(rep) + " has " + std::to_string(info.size) +
                              " elements but input leaf " + std::to_string(j) + " of replica 0 has " +
                              std::to_string(b.counts[j]));
      }
      (is_out ? b.out : b.in)[j * n + rep] = info.data;
    }
  }
  return b;
}

// inputs[r][j] / outputs[r][j]: leaf j of replica r; every leaf of one dtype, leaf j of one size
// across replicas and outputs. One GIL release and one pool dispatch for all leaves.
void batch_all_reduce(py::handle inputs, py::handle outputs, py::handle op_h) {
  const char* where = "batch_all_reduce";
  const auto op = to_op(op_h);
  const py::tuple ins = as_leaf_tuple(inputs, where, "inputs"), outs = as_leaf_tuple(outputs, where, "outputs");
  batch_leaves b = inspect_batch(where, ins, &outs);
  if (b.m == 0) return;
  maybe_nogil(2 * b.n * b.total * itemsize(b.k), [&] {
    dispatch(b.k, [&](auto t) {
      using T = decltype(t);
      cudist::batch_all_reduce<T>(reinterpret_cast<const T* const*>(b.in.data()), typed<T>(b.out), b.n, b.counts.data(),
                                  b.m, op);
    });
  });
}

// inputs[r][j]: leaf j of replica r (one dtype, leaf j of one size across replicas); out: one
// C-contiguous array of that dtype with as many elements as the leaves of one replica together,
// which receives the reduced leaves back to back. One GIL release and one pool dispatch.
void batch_reduce_to_one(py::handle inputs, py::handle op_h, py::handle out) {
  const char* where = "batch_reduce_to_one";
  const auto op = to_op(op_h);
  const py::tuple ins = as_leaf_tuple(inputs, where, "inputs");
  batch_leaves b = inspect_batch(where, ins, nullptr);
  if (b.m == 0) throw py::value_error(std::string(where) + ": expected at least one leaf per replica, got none");
  const arr_info o = inspect(out, where, "out", 0, true);
  if (o.k != b.k)
    throw py::type_error(std::string(where) + ": out has dtype " + kind_name(o.k) + " but the leaves have dtype " +
                         kind_name(b.k));
  if (o.size != b.total)
    throw py::value_error(std::string(where) + ": out has " + std::to_string(o.size) + " elements but the " +
                          std::to_string(b.m) + " leaves of a replica have " + std::to_string(b.total));
  maybe_nogil((b.n + 1) * b.total * itemsize(b.k), [&] {
    dispatch(b.k, [&](auto t) {
      using T = decltype(t);
      cudist::batch_reduce_to_one<T>(reinterpret_cast<const T* const*>(b.in.data()), b.n, b.counts.data(), b.m, op,
                                     static_cast<T*>(o.data));
    });
  });
}

// A step's gradients all-reduced by a replica (cudist._dataplane.reduce): batch_reduce_to_one of
// inputs[r][j] (leaf j of replica r) into `out` (a 1-d pooled buffer, the leaves back to back), made
// read-only; returns per replica the list of its leaves' results: replica 0's are views of `out` in
// its leaves' shapes, the others' views of those (distinct read-only objects sharing the memory).
// Returns None, doing nothing, unless inputs holds at least 2 replicas of the same number (>= 1) of
// numpy.ndarray (exactly), all C-contiguous and of one kernel dtype, leaf j of one shape in every
// replica, and out a writable C-contiguous array of that dtype with as many elements as a replica's
// leaves (or a callable out(shape, dtype) returning one: see shared_output): the caller's general
// path then takes the call. Replaces per leaf ~1 us of Python
// (contiguity checks, slices, reshapes, views) with ~0.1 us.
py::object batch_reduce_to_one_shared(py::handle inputs, py::handle op_h, py::handle out) {
  const auto op = to_op(op_h);
  py::tuple rows_t;
  if (!sequence_tuple(inputs.ptr(), rows_t)) return py::none();
  const Py_ssize_t n = PyTuple_GET_SIZE(rows_t.ptr());
  if (n < 2) return py::none();
  std::vector<py::tuple> rows(static_cast<std::size_t>(n));
  for (Py_ssize_t r = 0; r < n; ++r)
    if (!sequence_tuple(PyTuple_GET_ITEM(rows_t.ptr(), r), rows[static_cast<std::size_t>(r)])) return py::none();
  const Py_ssize_t m = PyTuple_GET_SIZE(rows[0].ptr());
  if (m == 0) return py::none();
  for (Py_ssize_t r = 1; r < n; ++r)
    if (PyTuple_GET_SIZE(rows[static_cast<std::size_t>(r)].ptr()) != m) return py::none();
  PyObject* first = PyTuple_GET_ITEM(rows[0].ptr(), 0);
  kind k;
  if (!shared_kind(first, op, k)) return py::none();
  PyObject* descr = py::detail::array_proxy(first)->descr;
  const std::size_t un = static_cast<std::size_t>(n), um = static_cast<std::size_t>(m);
  std::vector<void*> in(um * un);
  std::vector<std::size_t> counts(um);
  std::size_t total = 0;
  for (Py_ssize_t j = 0; j < m; ++j) {
    auto* ref = py::detail::array_proxy(PyTuple_GET_ITEM(rows[0].ptr(), j));
    for (Py_ssize_t r = 0; r < n; ++r) {
      auto* a = input_like(PyTuple_GET_ITEM(rows[static_cast<std::size_t>(r)].ptr(), j), ref, descr, k);
      if (a == nullptr) return py::none();
      in[static_cast<std::size_t>(j) * un + static_cast<std::size_t>(r)] = a->data;
    }
    counts[static_cast<std::size_t>(j)] = elements(ref);
    total += counts[static_cast<std::size_t>(j)];
  }
  py::object made;
  out = shared_output(out, [&] { return py::make_tuple(total); }, descr, made);
  auto* o = output_fits(out.ptr(), k, total);
  if (o == nullptr) return py::none();
  char* dst = static_cast<char*>(o->data);
  maybe_nogil((un + 1) * total * itemsize(k), [&] {
    dispatch(k, [&](auto t) {
      using T = decltype(t);
      cudist::batch_reduce_to_one<T>(reinterpret_cast<const T* const*>(in.data()), un, counts.data(), um, op,
                                     reinterpret_cast<T*>(dst));
    });
  });
  o->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;  // before the views: each view is then read-only too
  auto& api = py::detail::npy_api::get();
  py::list results(n);
  py::list row0(m);
  std::size_t off = 0;
  const std::size_t isz = itemsize(k);
  for (Py_ssize_t j = 0; j < m; ++j) {
    auto* ref = py::detail::array_proxy(PyTuple_GET_ITEM(rows[0].ptr(), j));
    Py_INCREF(o->descr);  // stolen by NewFromDescr
    PyObject* v = api.PyArray_NewFromDescr_(ndarray_type(), o->descr, ref->nd, ref->dimensions, nullptr, dst + off * isz,
                                            0 /* read-only */, nullptr);
    if (v == nullptr) throw py::error_already_set();
    Py_INCREF(out.ptr());  // stolen by SetBaseObject
    if (api.PyArray_SetBaseObject_(v, out.ptr()) < 0) {
      Py_DECREF(v);
      throw py::error_already_set();
    }
    PyList_SET_ITEM(row0.ptr(), j, v);
    off += counts[static_cast<std::size_t>(j)];
  }
  results[0] = row0;
  for (Py_ssize_t r = 1; r < n; ++r) {
    py::list row(m);
    for (Py_ssize_t j = 0; j < m; ++j) {
      PyObject* v = api.PyArray_View_(PyList_GET_ITEM(row0.ptr(), j), nullptr, nullptr);
      if (v == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(row.ptr(), j, v);
    }
    results[static_cast<std::size_t>(r)] = row;
  }
  return std::move(results);
}

// cudist.optimizers' _settle_inputs, its common case in one call: `passes` is a sequence of
// (gradients, written arrays) pairs. Returns per pass the list of its gradients when every gradient
// is an exact numpy.ndarray, C-contiguous, owning its memory (no base) and -- with `aliasing` --
// neither one of the written arrays nor the base of one (so it shares no memory with what the step
// writes); else None, and the caller settles them one by one.
py::object settle_plain(py::handle passes, bool aliasing) {
  const py::tuple ps = as_leaf_tuple(passes, "settle_plain", "passes");
  const Py_ssize_t np_ = PyTuple_GET_SIZE(ps.ptr());
  PyTypeObject* array_type = ndarray_type();
  constexpr int c_contiguous = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_;
  constexpr int owndata = py::detail::npy_api::NPY_ARRAY_OWNDATA_;
  std::vector<PyObject*> written;
  std::vector<py::tuple> grads;
  grads.reserve(static_cast<std::size_t>(np_));
  for (Py_ssize_t i = 0; i < np_; ++i) {
    PyObject* p = PyTuple_GET_ITEM(ps.ptr(), i);
    if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2) return py::none();
    PyObject* g = PyTuple_GET_ITEM(p, 0);
    PyObject* w = PyTuple_GET_ITEM(p, 1);
    grads.emplace_back();
    if (!sequence_tuple(g, grads.back())) return py::none();
    if (!aliasing) continue;
    py::tuple wt;
    if (!sequence_tuple(w, wt)) return py::none();
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(wt.ptr()); ++j) {
      PyObject* a = PyTuple_GET_ITEM(wt.ptr(), j);
      written.push_back(a);
      if (PyObject_TypeCheck(a, array_type)) {
        PyObject* base = py::detail::array_proxy(a)->base;
        if (base != nullptr) written.push_back(base);
      }
    }
  }
  std::sort(written.begin(), written.end());
  py::list out(np_);
  for (Py_ssize_t i = 0; i < np_; ++i) {
    const py::tuple& gt = grads[static_cast<std::size_t>(i)];
    const Py_ssize_t m = PyTuple_GET_SIZE(gt.ptr());
    py::list row(m);
    for (Py_ssize_t j = 0; j < m; ++j) {
      PyObject* a = PyTuple_GET_ITEM(gt.ptr(), j);
      if (Py_TYPE(a) != array_type) return py::none();
      auto* arr = py::detail::array_proxy(a);
      if (!(arr->flags & c_contiguous) || !(arr->flags & owndata) || arr->base != nullptr) return py::none();
      if (std::binary_search(written.begin(), written.end(), a)) return py::none();
      PyList_SET_ITEM(row.ptr(), j, Py_NewRef(a));
    }
    PyList_SET_ITEM(out.ptr(), i, row.release().ptr());
  }
  return std::move(out);
}

py::array all_gather(py::handle bufs, int axis) {
  std::vector<void*> p;
  std::size_t size = 0;
  kind k;
  const py::tuple keep = inspect_all(bufs, "all_gather", "replica", false, p, size, k, false);
  PyObject** items = &PyTuple_GET_ITEM(keep.ptr(), 0);
  auto* a0 = py::detail::array_proxy(items[0]);
  const int nd = a0->nd;
  if (axis < 0 || axis >= nd) throw py::value_error("all_gather: axis " + std::to_string(axis) + " is out of range");
  std::vector<py::ssize_t> shape(a0->dimensions, a0->dimensions + nd);
  std::size_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= static_cast<std::size_t>(shape[d]);
  for (int d = axis + 1; d < nd; ++d) inner *= static_cast<std::size_t>(shape[d]);
  std::vector<std::size_t> row_bytes(p.size());
  std::size_t total_extent = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    auto* a = py::detail::array_proxy(items[i]);
    if (a->nd != nd) throw py::value_error("all_gather: replica " + std::to_string(i) + " has a different rank");
    for (int d = 0; d < nd; ++d)
      if (d != axis && a->dimensions[d] != shape[d])
        throw py::value_error("all_gather: replica " + std::to_string(i) + " differs in shape outside the gather axis");
    const auto extent = static_cast<std::size_t>(a->dimensions[axis]);
    total_extent += extent;
    row_bytes[i] = extent * inner * itemsize(k);
  }
  shape[axis] = static_cast<py::ssize_t>(total_extent);
  py::array out(py::reinterpret_borrow<py::dtype>(a0->descr), shape);
  void* o = out.mutable_data();
  const std::size_t bytes = outer * total_extent * inner * itemsize(k);
  maybe_nogil(2 * bytes, [&] {
    std::vector<const void*> cp(p.begin(), p.end());
    // The output was just allocated: ordinary stores (see all_gather_bytes' fresh_output).
    cudist::all_gather_bytes(cp.data(), cp.size(), row_bytes.data(), outer, o, &cudist::thread_pool::global(), true);
  });
  return out;
}

void assign_add(py::handle copies, py::handle value, bool negate) {
  std::vector<void*> p;
  std::size_t size = 0;
  kind k;
  const py::tuple keep = inspect_all(copies, "assign_add", "copy", true, p, size, k);
  const void* v = inspect_like(value, "assign_add", "value", k, size, false);
  maybe_nogil((p.size() + 2) * size * itemsize(k), [&] {
    dispatch(k, [&](auto t) {
      using T = decltype(t);
      cudist::assign_add<T>(typed<T>(p), p.size(), size, static_cast<const T*>(v), negate);
    });
  });
}

void assign(py::handle copies, py::handle value) {
  std::vector<void*> p;
  std::size_t size = 0;
  kind k;
  const py::tuple keep = inspect_all(copies, "assign", "copy", true, p, size, k);
  const void* v = inspect_like(value, "assign", "value", k, size, false);
  maybe_nogil((p.size() + 1) * size * itemsize(k), [&] {
    dispatch(k, [&](auto t) {
      using T = decltype(t);
      cudist::assign<T>(typed<T>(p), p.size(), size, static_cast<const T*>(v));
    });
  });
}

// The gradients of a fused all-reduce + update: one or more arrays of the copies' size, of their
// dtype or -- mixed precision, float32 copies only -- of bfloat16 or float16, widened exactly inside
// the pass (``kg``: the gradients' kind).
py::tuple inspect_grads(py::handle grads, const char* where, kind k, std::size_t size, std::vector<void*>& pg,
                        kind& kg) {
  std::size_t gsize = 0;
  py::tuple keep = inspect_all(grads, where, "gradient", false, pg, gsize, kg);
  if (kg != k && !(k == kind::f32 && (kg == kind::bf16 || kg == kind::f16)))
    throw py::type_error(std::string(where) + ": the gradients have dtype " + kind_name(kg) + " but the copies have dtype " +
                         kind_name(k) + " (float32 copies also take bfloat16 or float16 gradients)");
  if (gsize != size)
    throw py::value_error(std::string(where) + ": the gradients have " + std::to_string(gsize) +
                          " elements but the copies have " + std::to_string(size));
  return keep;
}

// Calls fn(T{}, G{}): T the copies' float type, G the gradients' (T, or narrower for float32 copies).
template <class F>
void dispatch_mixed(kind k, kind kg, const char* where, F&& fn) {
  if (kg == k) {
    dispatch_float(k, where, [&](auto t) { fn(t, t); });
  } else if (kg == kind::bf16) {
    fn(float{}, cudist::bfloat16{});
  } else {
    fn(float{}, cudist::half{});
  }
}

// The bfloat16 reduction's SIMD kernel: "auto" (by the CPU), "sse2" or "avx2" (where the CPU has
// it), for tests and A/B benchmarks; returns the one in use after the call ("sse2", "avx2", or
// "generic" on builds without the x86 kernels). ``choice`` None only asks.
std::string bf16_simd(py::object choice) {
#ifdef CUDIST_BF16_AVX2
  if (!choice.is_none()) {
    const auto c = choice.cast<std::string>();
    if (c != "auto" && c != "sse2" && c != "avx2")
      throw py::value_error("bf16_simd: choice must be 'auto', 'sse2' or 'avx2', got '" + c + "'");
    cudist::detail::bf16_simd_choice().store(c == "auto" ? -1 : c == "avx2" ? 1 : 0);
  }
  return cudist::detail::bf16_use_avx2() ? "avx2" : "sse2";
#elif defined(CUDIST_BF16_SSE2)
  if (!choice.is_none() && choice.cast<std::string>() == "avx2")
    throw py::value_error("bf16_simd: this build has no AVX2 kernel");
  return "sse2";
#else
  (void)choice;
  return "generic";
#endif
}

// LossScaleOptimizer's step: the per-replica gradients summed, unscaled and checked in one pass
// (cudist::reduce_unscale_finite); ``out`` of the variable's dtype, the gradients of it or, for
// float32, of bfloat16 / float16. Returns whether every element of ``out`` is finite.
bool reduce_unscale_finite(py::handle grads, double scale, py::handle out) {
  const char* where = "reduce_unscale_finite";
  std::vector<void*> po, pg;
  std::size_t size = 0;
  kind k, kg;
  const py::tuple keep = inspect_all(py::make_tuple(out), where, "out", true, po, size, k);
  const py::tuple keep_g = inspect_grads(grads, where, k, size, pg, kg);
  const std::size_t out_bytes = size * itemsize(k), g_bytes = size * itemsize(kg);
  const auto o = reinterpret_cast<std::uintptr_t>(po[0]);
  for (void* g : pg) {
    const auto a = reinterpret_cast<std::uintptr_t>(g);
    if (size > 0 && a < o + out_bytes && o < a + g_bytes)
      throw py::value_error(std::string(where) + ": out shares memory with a gradient");
  }
  bool finite = true;
  dispatch_mixed(k, kg, where, [&](auto t, auto tg) {
    using T = decltype(t);
    using G = decltype(tg);
    maybe_nogil(out_bytes + pg.size() * g_bytes, [&] {
      finite = cudist::reduce_unscale_finite<T, G>(reinterpret_cast<const G* const*>(pg.data()), pg.size(), size, scale,
                                                   static_cast<T*>(po[0]));
    });
  });
  return finite;
}

// ---------------------------------------------------------------------------------------------
// The optimizers of CUDIST_UPDATE_RULES: one inspection for the plain form (``grad``, one
// array) and the fused all-reduce form (``grads``, one or more).
struct update_args {
  std::vector<void*> p;                 // the variable's copies
  std::vector<void*> slot[8];           // slot copies (CUDIST_PP_MAP's bound on a row's slots)
  std::vector<void*> pg;                // the gradients (one for the plain form)
  std::vector<py::tuple> keep;          // the arrays, held while the kernel runs
  std::size_t size = 0;
  kind k = kind::f32;
  kind kg = kind::f32;  // the gradients' (k, or narrower: see inspect_grads)

  template <class T>
  T* const* slot_ptrs(int s) {
    return typed<T>(slot[s]);
  }
  template <class G>
  const G* const* grads() const {
    return reinterpret_cast<const G* const*>(pg.data());
  }
  std::size_t bytes_moved() const {
    std::size_t buffers = p.size() + 1;
    for (const auto& s : slot)
      if (!s.empty()) buffers += s.size() + 1;
    return buffers * size * itemsize(k) + pg.size() * size * itemsize(kg);
  }
};

// ``slots``: (array list, name).
update_args inspect_update(const char* where, py::handle copies,
                           std::initializer_list<std::pair<py::handle, const char*>> slots, py::handle g, bool fused) {
  update_args u;
  u.keep.push_back(inspect_all(copies, where, "copy", true, u.p, u.size, u.k));
  int s = 0;
  for (const auto& [h, name] : slots) {
    if (h.is_none()) throw py::type_error(std::string(where) + ": the " + name + " slot copies are required");
    std::size_t ssize = 0;
    kind ks;
    u.keep.push_back(inspect_all(h, where, (std::string(name) + " copy").c_str(), true, u.slot[s], ssize, ks));
    if (ks != u.k || ssize != u.size || u.slot[s].size() != u.p.size())
      throw py::value_error(std::string(where) + ": the " + name +
                            " slot copies must match the variable copies in number, dtype and size");
    ++s;
  }
  if (fused) {
    u.keep.push_back(inspect_grads(g, where, u.k, u.size, u.pg, u.kg));
  } else {
    u.pg.push_back(const_cast<void*>(inspect_like(g, where, "grad", u.k, u.size, false)));
    u.kg = u.k;
  }
  if (u.k != kind::f16 && u.k != kind::f32 && u.k != kind::f64)
    throw py::type_error(std::string(where) + ": needs a floating-point dtype, got " + kind_name(u.k));
  return u;
}

// Runs ``fn(T{}, G{})`` for the update's float type T and its gradients' type G (a fused form's may be
// narrower, see inspect_grads), without the GIL when it moves enough bytes.
template <class F>
void run_mixed_update_call(update_args& u, const char* where, F&& fn) {
  dispatch_mixed(u.k, u.kg, where, [&](auto t, auto tg) { maybe_nogil(u.bytes_moved(), [&] { fn(t, tg); }); });
}

// The optimizers of CUDIST_UPDATE_RULES (<cudist/detail/update_rules.hpp>): their plain and fused
// bindings, generated from the table. ``name(copies, <slot>s..., grad, hyper..., decay)`` and
// ``all_reduce_name(copies, <slot>s..., grads, hyper..., decay)``.
template <std::size_t>
using handle_at = py::handle;
template <std::size_t>
using double_at = double;

template <template <class, class> class Rule, std::size_t... S, std::size_t... H>
void def_rule(py::module_& m, const char* name, const std::array<const char*, sizeof...(S)>& slots,
              const std::array<const char*, sizeof...(H)>& hyper, std::index_sequence<S...>,
              std::index_sequence<H...>) {
  static_assert(Rule<float, cudist::detail::host_math>::kSlots == sizeof...(S) &&
                    Rule<float, cudist::detail::host_math>::kHyper == sizeof...(H),
                "CUDIST_UPDATE_RULES lists a rule's slots or hyper-parameters wrongly");
  static std::array<std::string, sizeof...(S)> slot_args;  // "<slot>s": the argument names, kept alive
  for (std::size_t i = 0; i < slot_args.size(); ++i) slot_args[i] = std::string(slots[i]) + "s";
  for (const bool fused : {false, true}) {
    const std::string where = fused ? std::string("all_reduce_") + name : std::string(name);
    const std::string doc = where + ": the update cudist::rules of <cudist/detail/update_rules.hpp> named in " +
                            "CUDIST_UPDATE_RULES, after ``w -= w * decay`` (0: none)" +
                            (fused ? "; the sum of ``grads`` in the same pass." : ".");
    m.def(
        where.c_str(),
        [fused, where, slots](py::handle copies, handle_at<S>... slot_copies, py::handle g, double_at<H>... h,
                              double decay, py::handle sources) {
          update_args u = inspect_update(where.c_str(), copies, {std::make_pair(slot_copies, slots[S])...}, g,
                                         fused);
          // Out of place: the current values of the variable, then of each slot, read from these
          // arrays (a reader's snapshot); the copies are written, not read.
          std::array<const void*, sizeof...(S) + 1> src{};
          py::tuple keep_src;
          if (!sources.is_none()) {
            keep_src = py::tuple(py::reinterpret_borrow<py::object>(sources));
            if (keep_src.size() != src.size())
              throw py::value_error(where + ": sources must hold " + std::to_string(src.size()) +
                                    " arrays (the variable's, then each slot's), got " +
                                    std::to_string(keep_src.size()));
            for (std::size_t i = 0; i < src.size(); ++i)
              src[i] = inspect_like(keep_src[i], where.c_str(), "source", u.k, u.size, false);
          }
          run_mixed_update_call(u, where.c_str(), [&](auto t, auto tg) {
            using T = decltype(t);
            using G = decltype(tg);
            T* const* const state[sizeof...(S) + 1] = {u.slot_ptrs<T>(S)..., typed<T>(u.p)};
            const T* const read[sizeof...(S) + 1] = {static_cast<const T*>(src[S + 1])...,
                                                     static_cast<const T*>(src[0])};
            cudist::detail::run_rule_reading<Rule>(state, keep_src.empty() ? nullptr : read, u.p.size(), u.size,
                                                   u.grads<G>(), u.pg.size(), decay, &cudist::thread_pool::global(),
                                                   h...);
          });
        },
        py::arg("copies"), py::arg(slot_args[S].c_str())..., py::arg(fused ? "grads" : "grad"), py::arg(hyper[H])...,
        py::arg("decay"), py::arg("sources") = py::none(), doc.c_str());
    m.attr("out_of_place_rules").attr("append")(where);
  }
}

#define CUDIST_UNPAREN_(...) __VA_ARGS__
#define CUDIST_DEF_RULE_(name, rule, slots, hyper)                                                          \
  {                                                                                                         \
    constexpr std::array<const char*, std::initializer_list<const char*>{CUDIST_UNPAREN_ slots}.size()> s{  \
        CUDIST_UNPAREN_ slots};                                                                             \
    constexpr std::array<const char*, std::initializer_list<const char*>{CUDIST_UNPAREN_ hyper}.size()> h{  \
        CUDIST_UNPAREN_ hyper};                                                                             \
    def_rule<cudist::rules::rule>(m, #name, s, h, std::make_index_sequence<s.size()>{},                     \
                                  std::make_index_sequence<h.size()>{});                                    \
  }


#ifdef CUDIST_CORE_WITH_CUDA
// ------------------------------------------------------------------------------------------ CUDA
// The launchers of <cudist/cuda/launch.hpp> and <cudist/cuda/p2p.hpp> over raw device pointers
// (Python ints, e.g. a CuPy array's ``data.ptr``). They enqueue work and return; the buffers must
// stay alive until the streams have run it.

kind parse_dtype(py::handle dt, const char* where) {
  // Anything numpy.dtype() takes ("float32", "f4", np.float32, a dtype); judged by its name. A
  // dtype's own name first: "bfloat16" means something to numpy.dtype() only once ml_dtypes is imported.
  if (py::isinstance<py::str>(dt)) {
    const std::string given = dt.cast<std::string>();
    for (kind k : kKinds)
      if (given == kind_name(k)) return k;
  }
  std::string name;
  try {
    name = py::str(py::dtype::from_args(py::reinterpret_borrow<py::object>(dt)).attr("name"));
  } catch (py::error_already_set&) {
    if (py::isinstance<py::str>(dt))
      throw py::value_error(std::string(where) + ": unsupported dtype '" + dt.cast<std::string>() + "' " +
                            kSupportedDtypes);
    throw py::value_error(std::string(where) + ": dtype " + std::string(py::repr(dt)) + " is not a dtype");
  }
  for (kind k : kKinds)
    if (name == kind_name(k)) return k;
  throw py::value_error(std::string(where) + ": unsupported dtype '" + name + "' " + kSupportedDtypes);
}

// Calls fn(T{}) with T the CUDA-side type of k.
template <class F>
cudaError_t cuda_dispatch(kind k, F&& fn) {
  switch (k) {
    case kind::f16: return fn(__half{});
    case kind::f32: return fn(float{});
    case kind::f64: return fn(double{});
    case kind::i32: return fn(int{});
    case kind::i64: return fn(static_cast<long long>(0));
    case kind::bf16: return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;  // unreachable: parse_dtype gives one of the kinds above
}

[[noreturn]] void raise_cuda(const char* where, cudaError_t e) {
  cudaGetLastError();  // clear a sticky launch error so later calls start clean
  throw std::runtime_error(std::string(where) + ": CUDA error " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                           ")");
}

// An address (or device, stream handle) given as a non-negative Python int; `what` names it in errors.
std::uintptr_t to_address(py::handle h, const char* where, const std::string& what) {
  const std::string at = std::string(where) + ": " + what;
  if (!PyIndex_Check(h.ptr())) throw py::value_error(at + " is not an integer");
  long long v = 0;
  try {
    v = py::cast<long long>(py::int_(py::reinterpret_borrow<py::object>(h)));
  } catch (py::error_already_set&) {
    throw py::value_error(at + " is not an integer");
  } catch (py::cast_error&) {
    throw py::value_error(at + " is out of range");
  }
  if (v < 0) throw py::value_error(at + " is negative");
  return static_cast<std::uintptr_t>(v);
}

// Element i of a sequence named by `what`, e.g. "pointer 3".
std::string nth(const char* what, std::size_t i) { return std::string(what) + " " + std::to_string(i); }

std::vector<py::object> items_of(py::handle seq, const char* where, const char* what) {
  if (!PySequence_Check(seq.ptr()) || py::isinstance<py::str>(seq))
    throw py::value_error(std::string(where) + ": " + what + " must be a sequence");
  std::vector<py::object> out;
  for (py::handle h : py::reinterpret_borrow<py::sequence>(seq)) out.push_back(py::reinterpret_borrow<py::object>(h));
  return out;
}

// The device pointers of `seq` (Python ints): `what` names the sequence, `item` one element in errors.
std::vector<void*> device_pointers(py::handle seq, const char* where, const char* what = "ptrs",
                                   const char* item = "pointer") {
  std::vector<void*> ptrs;
  for (const py::object& o : items_of(seq, where, what)) {
    const std::uintptr_t a = to_address(o, where, nth(item, ptrs.size()));
    if (a == 0) throw py::value_error(std::string(where) + ": " + item + " " + std::to_string(ptrs.size()) + " is null");
    ptrs.push_back(reinterpret_cast<void*>(a));
  }
  if (ptrs.empty())
    throw py::value_error(std::string(where) + ": expected at least one device " + item + ", got none");
  if (ptrs.size() > static_cast<std::size_t>(INT32_MAX))
    throw py::value_error(std::string(where) + ": too many " + what);
  return ptrs;
}

void* device_pointer(py::handle h, const char* where, const char* what) {
  const std::uintptr_t a = to_address(h, where, what);
  if (a == 0) throw py::value_error(std::string(where) + ": " + what + " is null");
  return reinterpret_cast<void*>(a);
}

void check_count(long long count, const char* where) {
  if (count < 0) throw py::value_error(std::string(where) + ": count must be >= 0, got " + std::to_string(count));
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: report none, leave no error behind
    return 0;
  }
  return n;
}

// Runs `launch` (which enqueues work and returns a cudaError_t) without the GIL, with `device` the
// current device (-1: the current one stays), which is restored afterwards. Even a launch with
// nothing to do must find a usable device: an error here is the honest answer on a machine without one.
template <class F>
void launch_on(int device, const char* where, F&& launch) {
  if (device < -1) throw py::value_error(std::string(where) + ": device must be >= 0 (or -1 for the current one)");
  cudaError_t e = cudaSuccess;
  {
    py::gil_scoped_release nogil;
    int saved = 0;
    e = cudaGetDevice(&saved);
    if (e == cudaSuccess && device >= 0) e = cudaSetDevice(device);
    if (e == cudaSuccess) {
      e = launch();
      if (device >= 0) cudaSetDevice(saved);
    }
  }
  if (e != cudaSuccess) raise_cuda(where, e);
}

void cuda_all_reduce(py::handle ptrs_seq, long long count, py::handle dtype, int op_i, std::uintptr_t stream_i,
                     int device, bool two_shot) {
  const char* where = "cuda_all_reduce";
  const auto op = to_op(op_i);
  check_count(count, where);
  const kind k = parse_dtype(dtype, where);
  std::vector<void*> p = device_pointers(ptrs_seq, where);
  const auto stream = reinterpret_cast<cudaStream_t>(stream_i);
  launch_on(device, where, [&] {
    return cuda_dispatch(k, [&](auto t) {
      using T = decltype(t);
      const int n = static_cast<int>(p.size());
      return two_shot ? cudist::cuda::all_reduce_two_shot<T>(typed<T>(p), n, count, op, stream)
                      : cudist::cuda::all_reduce<T>(typed<T>(p), n, count, op, stream);
    });
  });
}

void cuda_all_reduce_into(py::handle inputs_seq, py::handle outputs_seq, long long count, py::handle dtype, int op_i,
                          std::uintptr_t stream_i, int device) {
  const char* where = "cuda_all_reduce_into";
  const auto op = to_op(op_i);
  check_count(count, where);
  const kind k = parse_dtype(dtype, where);
  std::vector<void*> in = device_pointers(inputs_seq, where, "inputs", "input");
  std::vector<void*> out = device_pointers(outputs_seq, where, "outputs", "output");
  if (in.size() != out.size())
    throw py::value_error(std::string(where) + ": got " + std::to_string(in.size()) + " inputs but " +
                          std::to_string(out.size()) + " outputs");
  const auto stream = reinterpret_cast<cudaStream_t>(stream_i);
  launch_on(device, where, [&] {
    return cuda_dispatch(k, [&](auto t) {
      using T = decltype(t);
      return cudist::cuda::all_reduce<T>(reinterpret_cast<const T* const*>(in.data()), typed<T>(out),
                                         static_cast<int>(in.size()), count, op, stream);
    });
  });
}

void cuda_reduce_to_one(py::handle ptrs_seq, py::handle out_h, long long count, py::handle dtype, int op_i,
                        std::uintptr_t stream_i, int device) {
  const char* where = "cuda_reduce_to_one";
  const auto op = to_op(op_i);
  check_count(count, where);
  const kind k = parse_dtype(dtype, where);
  std::vector<void*> p = device_pointers(ptrs_seq, where);
  void* out = device_pointer(out_h, where, "out");
  const auto stream = reinterpret_cast<cudaStream_t>(stream_i);
  launch_on(device, where, [&] {
    return cuda_dispatch(k, [&](auto t) {
      using T = decltype(t);
      return cudist::cuda::reduce_to_one<T>(typed<T>(p), static_cast<int>(p.size()), static_cast<T*>(out), count, op,
                                            stream);
    });
  });
}

void cuda_broadcast(py::handle src_h, py::handle dsts_seq, long long count, py::handle dtype, std::uintptr_t stream_i,
                    int device) {
  const char* where = "cuda_broadcast";
  check_count(count, where);
  const kind k = parse_dtype(dtype, where);
  const void* src = device_pointer(src_h, where, "src");
  std::vector<void*> p = device_pointers(dsts_seq, where, "dsts", "destination");
  const auto stream = reinterpret_cast<cudaStream_t>(stream_i);
  launch_on(device, where, [&] {
    return cuda_dispatch(k, [&](auto t) {
      using T = decltype(t);
      return cudist::cuda::broadcast<T>(static_cast<const T*>(src), typed<T>(p), static_cast<int>(p.size()), count,
                                        stream);
    });
  });
}

void cuda_p2p_all_reduce(py::handle bufs_seq, long long count, py::handle dtype, int op_i, py::handle streams_seq) {
  const char* where = "cuda_p2p_all_reduce";
  const auto op = to_op(op_i);
  check_count(count, where);
  const kind k = parse_dtype(dtype, where);
  std::vector<void*> p;
  std::vector<int> devices;
  for (const py::object& pair : items_of(bufs_seq, where, "bufs")) {
    const std::string i = std::to_string(p.size());
    if (!PySequence_Check(pair.ptr()) || PySequence_Size(pair.ptr()) != 2)
      throw py::value_error(std::string(where) + ": bufs " + i + " must be a (pointer, device) pair");
    const std::uintptr_t a = to_address(pair[py::int_(0)], where, nth("pointer", p.size()));
    if (a == 0) throw py::value_error(std::string(where) + ": pointer " + i + " is null");
    const std::uintptr_t d = to_address(pair[py::int_(1)], where, nth("device of buffer", p.size()));
    if (d > static_cast<std::uintptr_t>(INT32_MAX))
      throw py::value_error(std::string(where) + ": device of buffer " + i + " is out of range");
    p.push_back(reinterpret_cast<void*>(a));
    devices.push_back(static_cast<int>(d));
  }
  if (p.empty()) throw py::value_error(std::string(where) + ": expected at least one (pointer, device) pair, got none");
  std::vector<cudaStream_t> streams;
  if (!streams_seq.is_none()) {
    for (const py::object& o : items_of(streams_seq, where, "streams"))
      streams.push_back(reinterpret_cast<cudaStream_t>(to_address(o, where, nth("stream", streams.size()))));
    if (streams.size() != p.size())
      throw py::value_error(std::string(where) + ": got " + std::to_string(streams.size()) + " streams for " +
                            std::to_string(p.size()) + " buffers");
  }
  cudaError_t e = cudaSuccess;
  {
    py::gil_scoped_release nogil;  // enabling peer access the first time takes milliseconds
    e = cuda_dispatch(k, [&](auto t) {
      using T = decltype(t);
      return cudist::cuda::p2p_all_reduce<T>(typed<T>(p), devices.data(), streams.empty() ? nullptr : streams.data(),
                                             static_cast<int>(p.size()), count, op);
    });
  }
  if (e != cudaSuccess) raise_cuda(where, e);
}
#endif  // CUDIST_CORE_WITH_CUDA

// ---- the one-round all-reduce of the shared-memory transport (cudist._dataplane.transports.shm)
//
// One call per small all-reduce: copy in, raise the arrival flag, spin for the others, compare
// the calls' hashes, sum in worker order. The layout is shm.py's: the control area `ctrl` (int64)
// holds one cache line per flag, one row of `node_size` lines per kind (arrived = row 0, the
// hashes rows 4 and 5 by the call's parity); `slots` holds two sets (by parity) of `node_size`
// slots. A worker reuses a set only after every worker has arrived in the next call, so after
// every worker has read it. The flags are C++ atomics: a release store of the arrival publishes
// the slot and hash written before it; an acquire load of the others' orders the reads after.
constexpr std::size_t kShmLine = 8;  // int64 per cache line
constexpr std::size_t kShmArrived = 0, kShmHash = 4, kShmKinds = 6;
constexpr std::size_t kShmAlign = 64;
constexpr long long kShmBusyNs = 20000;  // the first part of a wait spins without yielding the CPU
constexpr std::uint64_t kShmHashMask = (std::uint64_t{1} << 62) - 1;
constexpr std::uint64_t kShmHashMul = 0x100000001B3ULL;  // the MPI check's (mpi.py's call_hash)
static_assert(sizeof(std::atomic<std::int64_t>) == sizeof(std::int64_t) && std::atomic<std::int64_t>::is_always_lock_free,
              "the flags are lock-free int64 atomics in shared memory");

struct shm_node {
  std::int64_t* ctrl;
  unsigned char* slots;
  std::size_t cap;  // bytes per slot
  std::size_t n, rank;

  std::atomic<std::int64_t>& flag(std::size_t kind, std::size_t w) const {
    return *reinterpret_cast<std::atomic<std::int64_t>*>(ctrl + (kind * n + w) * kShmLine);
  }
  unsigned char* slot(std::int64_t count, std::size_t w) const {
    return slots + ((static_cast<std::size_t>(count & 1) * n) + w) * cap;
  }
};

// A writable, C-contiguous 1-d numpy array of `itemsize`-byte items (the window's areas).
void* shm_area(py::handle h, const char* what, py::ssize_t itemsize, std::size_t& size) {
  if (!py::isinstance<py::array>(h)) throw py::type_error(std::string("shm: ") + what + " is not a numpy.ndarray");
  auto* a = py::detail::array_proxy(h.ptr());
  constexpr int need = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  if ((a->flags & need) != need || py::reinterpret_borrow<py::dtype>(a->descr).itemsize() != itemsize) {
    throw py::value_error(std::string("shm: ") + what + " must be a writable C-contiguous array of " +
                          std::to_string(itemsize) + "-byte items");
  }
  size = elements(a);
  return a->data;
}

shm_node shm_open(py::handle ctrl, py::handle slots, long long node_size, long long node_rank) {
  if (node_size < 1 || node_rank < 0 || node_rank >= node_size) {
    throw py::value_error("shm: node_rank " + std::to_string(node_rank) + " is not in [0, " + std::to_string(node_size) + ")");
  }
  const auto n = static_cast<std::size_t>(node_size);
  std::size_t ctrl_len = 0, slots_len = 0;
  shm_node v{static_cast<std::int64_t*>(shm_area(ctrl, "ctrl", 8, ctrl_len)),
             static_cast<unsigned char*>(shm_area(slots, "slots", 1, slots_len)), slots_len / (2 * n), n,
             static_cast<std::size_t>(node_rank)};
  if (ctrl_len < kShmKinds * n * kShmLine || reinterpret_cast<std::uintptr_t>(v.ctrl) % kShmAlign != 0) {
    throw py::value_error("shm: ctrl must be a cache-line aligned int64 array of at least " +
                          std::to_string(kShmKinds * n * kShmLine) + " items");
  }
  if (v.cap % kShmAlign != 0 || reinterpret_cast<std::uintptr_t>(v.slots) % kShmAlign != 0) {
    throw py::value_error("shm: slots must be 2 * node_size cache-line aligned slots");
  }
  return v;
}

struct shm_pair {
  const void* send;
  void* recv;
  std::size_t size, bytes;
  int type_num;
  bool summable;  // a kernel dtype
  kind k;
};

// The (send, recv) pairs of one call: send C-contiguous, recv writable C-contiguous of send's
// dtype and size; they must fit a slot at cache-line offsets. `keep` holds them during the call.
std::vector<shm_pair> shm_pairs(py::handle pairs, const shm_node& v, py::tuple& keep) {
  if (!sequence_tuple(pairs.ptr(), keep)) throw py::type_error("shm: pairs must be a tuple or list of (send, recv)");
  const Py_ssize_t m = PyTuple_GET_SIZE(keep.ptr());
  std::vector<shm_pair> out(static_cast<std::size_t>(m));
  std::size_t off = 0;
  for (Py_ssize_t i = 0; i < m; ++i) {
    PyObject* p = PyTuple_GET_ITEM(keep.ptr(), i);
    if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2) throw py::type_error("shm: pair " + std::to_string(i) + " is not a (send, recv) tuple");
    auto where = [i] { return "shm: pair " + std::to_string(i); };  // built only for an error
    PyObject* s = PyTuple_GET_ITEM(p, 0);
    PyObject* r = PyTuple_GET_ITEM(p, 1);
    if (Py_TYPE(s) != ndarray_type() && !PyObject_TypeCheck(s, ndarray_type())) throw py::type_error(where() + ": send is not a numpy.ndarray");
    if (Py_TYPE(r) != ndarray_type() && !PyObject_TypeCheck(r, ndarray_type())) throw py::type_error(where() + ": recv is not a numpy.ndarray");
    auto* sa = py::detail::array_proxy(s);
    auto* ra = py::detail::array_proxy(r);
    constexpr int contiguous = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_;
    constexpr int writeable = py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    if (!(sa->flags & contiguous) || (ra->flags & (contiguous | writeable)) != (contiguous | writeable)) {
      throw py::value_error(where() + ": send must be C-contiguous and recv writable and C-contiguous");
    }
    auto& api = py::detail::npy_api::get();
    if (sa->descr != ra->descr && !api.PyArray_EquivTypes_(sa->descr, ra->descr)) throw py::type_error(where() + ": send and recv differ in dtype");
    shm_pair& q = out[static_cast<std::size_t>(i)];
    q.size = elements(ra);
    if (elements(sa) != q.size) throw py::value_error(where() + ": send and recv differ in size");
    q.bytes = q.size * static_cast<std::size_t>(py::reinterpret_borrow<py::dtype>(ra->descr).itemsize());
    q.send = sa->data;
    q.recv = ra->data;
    q.type_num = py::detail::array_descriptor_proxy(ra->descr)->type_num;
    q.summable = kind_of(ra->descr, q.k);
    off = (off + q.bytes + kShmAlign - 1) / kShmAlign * kShmAlign;
  }
  if (off > v.cap) throw py::value_error("shm: " + std::to_string(off) + " bytes do not fit a slot of " + std::to_string(v.cap));
  return out;
}

// Copies this worker's buffers into its slot, posts the call's hash (mpi.py's call_hash of the
// kind's CRC-32, the sequence number and each pair's (size, dtype number)) and raises its flag.
void shm_arrive_(const shm_node& v, std::int64_t count, const std::vector<shm_pair>& pairs, std::uint32_t kind_crc,
                 std::uint64_t seq) {
  unsigned char* mine = v.slot(count, v.rank);
  std::uint64_t h = (static_cast<std::uint64_t>(kind_crc) ^ (seq << 32)) & kShmHashMask;
  std::size_t off = 0;
  for (const shm_pair& q : pairs) {
    if (q.bytes) std::memcpy(mine + off, q.send, q.bytes);
    h = (h * kShmHashMul + q.size) & kShmHashMask;
    h = (h * kShmHashMul + static_cast<std::uint64_t>(q.type_num)) & kShmHashMask;
    off = (off + q.bytes + kShmAlign - 1) / kShmAlign * kShmAlign;
  }
  v.flag(kShmHash + static_cast<std::size_t>(count & 1), v.rank).store(static_cast<std::int64_t>(h), std::memory_order_relaxed);
  v.flag(kShmArrived, v.rank).store(count, std::memory_order_release);
}

// 0: every worker of the node has arrived in call `count` with this worker's hash; 1: not all
// within `spin_ns` (the caller polls again, with its deadline); 2: a worker's hash differs.
int shm_wait_(const shm_node& v, std::int64_t count, long long spin_ns) {
  std::size_t next = 0;  // the first worker not yet seen to arrive
  auto all_here = [&] {
    while (next < v.n && v.flag(kShmArrived, next).load(std::memory_order_acquire) >= count) ++next;
    return next == v.n;
  };
  if (!all_here()) {
    // Without yielding at first, and with the GIL: a peer a few microseconds behind (the usual case)
    // is seen at once, not after this core was given away for a time slice, and the GIL is not
    // retaken on the way out (on the critical path of every call; other threads wait ~20 us at most).
    // Then, the GIL released for this process's other threads, spinning that yields the CPU.
    const long long busy = std::min(spin_ns, kShmBusyNs);
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(busy);
    for (unsigned i = 1; !all_here(); ++i) {
      cudist::thread_pool::cpu_relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) {
        py::gil_scoped_release nogil;  // a longer wait for a slower worker: let this process's other threads run
        if (!cudist::thread_pool::spin_until(all_here, spin_ns - busy)) return 1;
        break;
      }
    }
  }
  const std::size_t row = kShmHash + static_cast<std::size_t>(count & 1);
  const std::int64_t mine = v.flag(row, v.rank).load(std::memory_order_relaxed);
  for (std::size_t w = 0; w < v.n; ++w)
    if (v.flag(row, w).load(std::memory_order_relaxed) != mine) return 2;
  return 0;
}

// recv = the sum of every worker's slot, in worker order (MirroredStrategy's order and kernels).
void shm_check_summable(const std::vector<shm_pair>& pairs) {
  for (const shm_pair& q : pairs)
    if (!q.summable) throw py::type_error(std::string("shm: a pair's dtype is not a kernel dtype ") + kSupportedDtypes);
}

void shm_sum_(const shm_node& v, std::int64_t count, const std::vector<shm_pair>& pairs) {
  shm_check_summable(pairs);
  std::vector<void*> ptrs(v.n);
  std::size_t off = 0;
  for (const shm_pair& q : pairs) {
    for (std::size_t w = 0; w < v.n; ++w) ptrs[w] = v.slot(count, w) + off;
    dispatch(q.k, [&](auto t) {
      using T = decltype(t);
      cudist::reduce_to_one<T>(typed<T>(ptrs), v.n, q.size, cudist::reduce_op::sum, static_cast<T*>(q.recv));
    });
    off = (off + q.bytes + kShmAlign - 1) / kShmAlign * kShmAlign;
  }
}

int shm_all_reduce(py::handle ctrl, py::handle slots, long long node_size, long long node_rank, long long count,
                   py::handle pairs, std::uint32_t kind_crc, std::uint64_t seq, long long spin_ns, bool sum) {
  const shm_node v = shm_open(ctrl, slots, node_size, node_rank);
  py::tuple keep;
  const auto ps = shm_pairs(pairs, v, keep);
  if (sum) shm_check_summable(ps);  // refused before arriving: the others are not left to sum a call it cannot
  shm_arrive_(v, count, ps, kind_crc, seq);
  const int status = shm_wait_(v, count, spin_ns);
  if (status == 0 && sum) shm_sum_(v, count, ps);
  return status;
}

// The per-step common case, one array: shm_all_reduce of (send, recv) with recv made here (a new C-order
// array of send's shape and dtype; a send that is not C-contiguous is read through a C-order copy),
// summed by the kernels. Returns recv once summed (status 0), else (status, recv).
PyObject* shm_one_(const shm_node& v, std::int64_t count, PyObject* send, std::uint32_t kind_crc, std::uint64_t seq,
                   long long spin_ns, std::size_t& nbytes) {
  if (!PyObject_TypeCheck(send, ndarray_type())) throw py::type_error("shm: send is not a numpy.ndarray");
  auto& api = py::detail::npy_api::get();
  auto* a = py::detail::array_proxy(send);
  shm_pair q{};
  if (!kind_of(a->descr, q.k)) throw py::type_error(std::string("shm: send's dtype is not a kernel dtype ") + kSupportedDtypes);
  py::object src = py::reinterpret_borrow<py::object>(send);
  if (!(a->flags & py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_)) {
    src = py::reinterpret_steal<py::object>(api.PyArray_NewCopy_(send, 0 /* C order */));
    if (!src) throw py::error_already_set();
  }
  Py_INCREF(a->descr);  // PyArray_NewFromDescr steals it
  auto recv = py::reinterpret_steal<py::object>(
      api.PyArray_NewFromDescr_(ndarray_type(), a->descr, a->nd, a->dimensions, nullptr, nullptr, 0, nullptr));
  if (!recv) throw py::error_already_set();
  auto* ra = py::detail::array_proxy(recv.ptr());
  q.size = elements(ra);
  q.bytes = q.size * static_cast<std::size_t>(py::reinterpret_borrow<py::dtype>(ra->descr).itemsize());
  if ((q.bytes + kShmAlign - 1) / kShmAlign * kShmAlign > v.cap) {
    throw py::value_error("shm: " + std::to_string(q.bytes) + " bytes do not fit a slot of " + std::to_string(v.cap));
  }
  q.send = py::detail::array_proxy(src.ptr())->data;
  q.recv = ra->data;
  q.type_num = py::detail::array_descriptor_proxy(ra->descr)->type_num;
  q.summable = true;
  const std::vector<shm_pair> ps{q};
  shm_arrive_(v, count, ps, kind_crc, seq);
  const int status = shm_wait_(v, count, spin_ns);
  nbytes = q.bytes;
  if (status == 0) {
    shm_sum_(v, count, ps);
    return recv.release().ptr();
  }
  return py::make_tuple(status, recv).release().ptr();
}

// A node's one-array caller (shm_one_caller): the window's areas, checked once, and this worker's counts.
struct shm_one_state {
  shm_node v;
  PyObject* ctrl;
  PyObject* slots;  // both held: the caller keeps the mapping alive
  long long spin_ns;
  unsigned long long calls, bytes;
};
constexpr const char* kShmOneName = "cudist._core.shm_one";

shm_one_state* shm_one_state_of(PyObject* capsule) {
  return static_cast<shm_one_state*>(PyCapsule_GetPointer(capsule, kShmOneName));
}

void shm_one_free(PyObject* capsule) {
  shm_one_state* s = shm_one_state_of(capsule);
  if (s == nullptr) return;
  Py_XDECREF(s->ctrl);
  Py_XDECREF(s->slots);
  delete s;
}

// one(count, send, kind, seq): a METH_FASTCALL builtin bound to the state (no argument parsing beyond
// four positional values: this is the per-step call, where pybind11's dispatch measured a third of it).
PyObject* shm_one_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs != 4) throw py::type_error("shm one(count, send, kind, seq) takes 4 positional arguments");
    shm_one_state* s = shm_one_state_of(self);
    if (s == nullptr) return nullptr;
    const long long count = PyLong_AsLongLong(args[0]);
    if (count == -1 && PyErr_Occurred()) return nullptr;
    Py_ssize_t len = 0;
    const char* kind = PyUnicode_AsUTF8AndSize(args[2], &len);  // cached in the str after the first call
    if (kind == nullptr) return nullptr;
    const unsigned long long seq = PyLong_AsUnsignedLongLong(args[3]);
    if (seq == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
    const std::uint32_t crc =
        cudist_bindings::crc32(reinterpret_cast<const unsigned char*>(kind), static_cast<std::size_t>(len), 0);
    std::size_t nbytes = 0;
    PyObject* out = shm_one_(s->v, count, args[1], crc, seq, s->spin_ns, nbytes);
    ++s->calls;
    s->bytes += nbytes;
    return out;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef kShmOneDef = {"shm_one", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&shm_one_call)),
                          METH_FASTCALL,
                          "one(count, send, kind, seq): the one-round all-reduce of one array on this window "
                          "(kind's CRC-32 hashed here): the sum, a new array; or (status, recv) while waiting."};

py::object shm_one_caller(py::handle ctrl, py::handle slots, long long node_size, long long node_rank, long long spin_ns) {
  const shm_node v = shm_open(ctrl, slots, node_size, node_rank);
  auto* s = new shm_one_state{v, ctrl.inc_ref().ptr(), slots.inc_ref().ptr(), spin_ns, 0, 0};
  PyObject* capsule = PyCapsule_New(s, kShmOneName, &shm_one_free);
  if (capsule == nullptr) {
    Py_DECREF(s->ctrl);
    Py_DECREF(s->slots);
    delete s;
    throw py::error_already_set();
  }
  auto cap = py::reinterpret_steal<py::object>(capsule);
  PyObject* fn = PyCFunction_NewEx(&kShmOneDef, cap.ptr(), nullptr);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

py::tuple shm_one_counts(py::handle one) {
  if (!PyCFunction_Check(one.ptr()) || PyCFunction_GET_FUNCTION(one.ptr()) != kShmOneDef.ml_meth) {
    throw py::type_error("shm_one_counts: not a caller made by shm_one_caller");
  }
  const shm_one_state* s = shm_one_state_of(PyCFunction_GET_SELF(one.ptr()));
  if (s == nullptr) throw py::error_already_set();
  return py::make_tuple(s->calls, s->bytes);
}

int shm_wait(py::handle ctrl, py::handle slots, long long node_size, long long node_rank, long long count,
             long long spin_ns) {
  return shm_wait_(shm_open(ctrl, slots, node_size, node_rank), count, spin_ns);
}

void shm_sum(py::handle ctrl, py::handle slots, long long node_size, long long node_rank, long long count,
             py::handle pairs) {
  const shm_node v = shm_open(ctrl, slots, node_size, node_rank);
  py::tuple keep;
  shm_sum_(v, count, shm_pairs(pairs, v, keep));
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "cudist's native CPU kernels (the C++ headers of <cudist/cudist.hpp> over NumPy arrays).";
  m.attr("__version__") = CUDIST_VERSION;
  m.attr("SUM") = 0;
  m.attr("MEAN") = 1;
  // Checkpoint checksums (cudist.train): zlib.crc32's values, by PCLMULQDQ folding where the CPU has it.
  m.attr("crc32_accelerated") = cudist_bindings::crc32_accelerated();
  m.def(
      "crc32",
      [](py::object data, uint32_t value) {
        Py_buffer view;  // bytes, bytearray, memoryview, a contiguous array; a strided one raises
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
        uint32_t out;
        {
          py::gil_scoped_release nogil;
          out = cudist_bindings::crc32(static_cast<const unsigned char*>(view.buf), static_cast<size_t>(view.len), value);
        }
        PyBuffer_Release(&view);
        return out;
      },
      py::arg("data"), py::arg("value") = 0,
      "zlib.crc32(data, value) of a C-contiguous buffer, by PCLMULQDQ folding where crc32_accelerated; "
      "the GIL is released while it runs.");
  // Checkpoint tensor writes: write(2) + CRC-32 per chunk, without the GIL (fdio.cpp).
  cudist_bindings::bind_fdio(m);

  m.def("all_reduce", &all_reduce, py::arg("bufs"), py::arg("op"),
        "In place: every array of ``bufs`` (tuple/list) becomes their elementwise reduction; op 0=SUM, 1=MEAN.");
  m.def("all_reduce_into", &all_reduce_into, py::arg("inputs"), py::arg("outputs"), py::arg("op"),
        py::arg("strict") = false,
        "Out of place: every array of ``outputs`` becomes the elementwise reduction of ``inputs`` (one pass; "
        "outputs[i] may be inputs[i]). ``strict``: refuse any other overlap (ValueError).");
  m.def("batch_all_reduce", &batch_all_reduce, py::arg("inputs"), py::arg("outputs"), py::arg("op"),
        "outputs[r][j] = reduction over r of inputs[r][j], for every leaf j, in one dispatch (leaves of one dtype).");
  m.def("batch_reduce_to_one", &batch_reduce_to_one, py::arg("inputs"), py::arg("op"), py::arg("out"),
        "The reduction over r of inputs[r][j], for every leaf j, written back to back into the 1-d out, in one "
        "dispatch (leaves of one dtype).");
  m.def("reduce_to_one_shared", &reduce_to_one_shared, py::arg("bufs"), py::arg("op"), py::arg("out"),
        "reduce_to_one into ``out``, made read-only; returns [out] + len(bufs)-1 read-only views of it, or None "
        "(doing nothing) unless bufs are >= 2 C-contiguous numpy.ndarray of one shape and kernel dtype and out a "
        "writable C-contiguous array of that dtype and size (or a callable out(shape, dtype) returning one, called "
        "only once the inputs pass).");
  m.def("batch_reduce_to_one_shared", &batch_reduce_to_one_shared, py::arg("inputs"), py::arg("op"), py::arg("out"),
        "batch_reduce_to_one into ``out``, made read-only; returns per replica the list of its leaves' read-only "
        "results (views of out in the leaves' shapes), or None (doing nothing) unless inputs are >= 2 replicas of "
        "the same >= 1 C-contiguous numpy.ndarray leaves of one kernel dtype (leaf j of one shape) and out a "
        "writable C-contiguous array of that dtype and their total size (or a callable out(shape, dtype) returning "
        "one, called only once the inputs pass).");
  m.def("settle_plain", &settle_plain, py::arg("passes"), py::arg("aliasing"),
        "Per pass (gradients, written arrays) the list of its gradients when every gradient is a C-contiguous "
        "numpy.ndarray owning its memory and (aliasing) neither a written array nor a written array's base; else None.");
  m.def("register_reduce_ops", &register_reduce_ops, py::arg("sum"), py::arg("mean"),
        "Registers the objects (cudist.ReduceOp.SUM, .MEAN) accepted as ``op`` besides 0 and 1.");
  m.def("shm_all_reduce", &shm_all_reduce, py::arg("ctrl"), py::arg("slots"), py::arg("node_size"),
        py::arg("node_rank"), py::arg("count"), py::arg("pairs"), py::arg("kind_crc"), py::arg("seq"),
        py::arg("spin_ns"), py::arg("sum"),
        "The shared-memory transport's one-round all-reduce (call ``count`` of the window ``ctrl`` / ``slots``): "
        "copies each send of ``pairs`` ((send, recv) tuples) into this worker's slot, posts the call's hash, raises "
        "its arrival flag, spins up to ``spin_ns`` for the others; 0: all arrived with the same hash (and, with "
        "``sum``, each recv is the sum of the slots in worker order), 1: not yet (poll shm_wait), 2: hashes differ.");
  m.def("shm_one_caller", &shm_one_caller, py::arg("ctrl"), py::arg("slots"), py::arg("node_size"),
        py::arg("node_rank"), py::arg("spin_ns"),
        "The window's per-step caller one(count, send, kind, seq): shm_all_reduce of one array, summed into a "
        "new array like it (returned), or (status, recv) when not every worker arrived within ``spin_ns`` (1) "
        "or the hashes differ (2). The window's areas are checked here, once.");
  m.def("shm_one_counts", &shm_one_counts, py::arg("one"),
        "(calls, bytes) a caller of shm_one_caller has made and all-reduced.");
  m.def("shm_wait", &shm_wait, py::arg("ctrl"), py::arg("slots"), py::arg("node_size"), py::arg("node_rank"),
        py::arg("count"), py::arg("spin_ns"),
        "Spins up to ``spin_ns`` for every worker's arrival in call ``count``: shm_all_reduce's 0, 1 or 2.");
  m.def("shm_sum", &shm_sum, py::arg("ctrl"), py::arg("slots"), py::arg("node_size"), py::arg("node_rank"),
        py::arg("count"), py::arg("pairs"),
        "Each recv of ``pairs`` becomes the sum of the node's slots of call ``count``, in worker order.");
  m.def("reduce_to_one", &reduce_to_one, py::arg("bufs"), py::arg("op"), py::arg("out"),
        "Reduces ``bufs`` elementwise into ``out`` (which may be one of them).");
  m.def("broadcast", &broadcast, py::arg("src"), py::arg("dsts"), "Copies ``src`` into every array of ``dsts``.");
  m.def("all_gather", &all_gather, py::arg("bufs"), py::arg("axis"),
        "Concatenates ``bufs`` along non-negative ``axis`` into a new array.");
  m.def("assign_add", &assign_add, py::arg("copies"), py::arg("value"), py::arg("negate"),
        "Every copy becomes copies[0] + value (or - value when ``negate``).");
  m.def("assign", &assign, py::arg("copies"), py::arg("value"), "Writes ``value`` into every copy.");
  m.def("bf16_simd", &bf16_simd, py::arg("choice") = py::none(),
        "the bfloat16 reduction's SIMD kernel: set 'auto' / 'sse2' / 'avx2' (None: only ask); returns the one in use");
  m.def("reduce_unscale_finite", &reduce_unscale_finite, py::arg("grads"), py::arg("scale"), py::arg("out"),
        "out = (sum of grads in replica order) / scale in one pass; returns whether every element of out is finite");

  // The optimizers of CUDIST_UPDATE_RULES (<cudist/detail/update_rules.hpp>), generated from the table;
  // each takes ``sources=`` (out of place), and its names are listed in ``out_of_place_rules``.
  m.attr("out_of_place_rules") = py::list();
  CUDIST_UPDATE_RULES(CUDIST_DEF_RULE_)
  m.def(
      "num_threads", [] { return cudist::thread_pool::global().size(); },
      "Threads the kernels use (the calling thread included).");
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 0) throw py::value_error("set_num_threads: n must be >= 0 (0 = all hardware threads), got " + std::to_string(n));
        py::gil_scoped_release nogil;
        cudist::thread_pool::global().resize(static_cast<unsigned>(n));
      },
      py::arg("n"), "Sets the number of threads (0 = all hardware threads).");
  m.def("set_streaming_threshold", &cudist::set_streaming_threshold, py::arg("nbytes"),
        "Bytes written from which kernels use streaming stores (returns the previous value; for benchmarks).");
  m.def("hardware_threads", &cudist::thread_pool::hardware_threads, "Hardware threads of this machine.");
  m.def(
      "set_parallel_thresholds",
      [](std::size_t warm, std::size_t cold) { return cudist::set_parallel_thresholds(warm, cold); },
      py::arg("warm_bytes"), py::arg("cold_bytes"),
      "Bytes moved from which kernels use their pool, with a worker spinning and without (returns the "
      "previous pair; for benchmarks and tests).");
  m.def(
      "pool_spin_time", [] { return cudist::thread_pool::global().spin_time(); },
      "Nanoseconds the kernels' pool workers spin for the next loop before blocking.");
  m.def(
      "set_pool_spin_time", [](long long ns) { return cudist::thread_pool::global().set_spin_time(ns); },
      py::arg("ns"), "Sets pool_spin_time() (negative: 0); returns the previous value.");
  m.def(
      "pool_warm", [] { return cudist::thread_pool::global().warm(); },
      "Whether a worker of the kernels' pool is spinning now.");
  m.def(
      "pool_parallel_loops", [] { return cudist::thread_pool::global().parallel_loops(); },
      "Loops the kernels' pool has run on more than one thread.");

  // The CUDA launchers, when the extension was built with a CUDA compiler (see cuda_built).
#ifdef CUDIST_CORE_WITH_CUDA
  m.attr("cuda_built") = true;
  m.attr("cuda_architectures") = CUDIST_CUDA_ARCHITECTURES;
  m.attr("cuda_runtime_version") = CUDART_VERSION;
  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices visible to the extension's (static) CUDA runtime; 0 without a driver or device.");
  m.def("cuda_all_reduce", &cuda_all_reduce, py::arg("ptrs"), py::arg("count"), py::arg("dtype"), py::arg("op"),
        py::arg("stream") = 0, py::arg("device") = -1, py::arg("two_shot") = false,
        "Enqueues cudist::cuda::all_reduce (or all_reduce_two_shot) on ``stream`` of ``device`` (-1: the current "
        "one) over the device buffers at the integer addresses ``ptrs``, ``count`` elements of ``dtype`` each; "
        "op 0=SUM, 1=MEAN. Raises RuntimeError naming the CUDA error.");
  m.def("cuda_all_reduce_into", &cuda_all_reduce_into, py::arg("inputs"), py::arg("outputs"), py::arg("count"),
        py::arg("dtype"), py::arg("op"), py::arg("stream") = 0, py::arg("device") = -1,
        "Enqueues the out-of-place cudist::cuda::all_reduce: every buffer of ``outputs`` (integer addresses) gets "
        "the reduction of the buffers ``inputs``, ``count`` elements of ``dtype`` each; outputs[i] may be inputs[i].");
  m.def("cuda_reduce_to_one", &cuda_reduce_to_one, py::arg("ptrs"), py::arg("out"), py::arg("count"),
        py::arg("dtype"), py::arg("op"), py::arg("stream") = 0, py::arg("device") = -1,
        "Enqueues cudist::cuda::reduce_to_one: the reduction of the buffers ``ptrs`` into ``out`` (which may be one "
        "of ptrs[0..7], or any of them when there are at most 8).");
  m.def("cuda_broadcast", &cuda_broadcast, py::arg("src"), py::arg("dsts"), py::arg("count"), py::arg("dtype"),
        py::arg("stream") = 0, py::arg("device") = -1,
        "Enqueues cudist::cuda::broadcast: copies the buffer ``src`` into every buffer of ``dsts``.");
  m.def("cuda_p2p_all_reduce", &cuda_p2p_all_reduce, py::arg("bufs"), py::arg("count"), py::arg("dtype"),
        py::arg("op"), py::arg("streams") = py::none(),
        "Enqueues cudist::cuda::p2p_all_reduce over ``bufs``, a sequence of (pointer, device) pairs, with one "
        "stream per buffer (None: the devices' default streams). Raises RuntimeError naming the CUDA error.");
#else
  m.attr("cuda_built") = false;
  m.attr("cuda_architectures") = "";
  m.attr("cuda_runtime_version") = 0;
  m.def(
      "cuda_device_count", [] { return 0; }, "Always 0: this extension was built without CUDA.");
#endif
}
