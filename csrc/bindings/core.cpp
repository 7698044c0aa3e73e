#include <pybind11/pybind11.h>
namespace py = pybind11;
PYBIND11_MODULE(_core, m) {
  m.doc() = "cudist native kernels";
  m.attr("__version__") = CUDIST_VERSION;
}
