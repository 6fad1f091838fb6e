// C++ helpers for building dataset indices (pybind11). Filled in by the data pipeline.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>

namespace py = pybind11;

// Sum of an int32 array, as int64: a smoke test that the extension builds and takes numpy arrays.
static int64_t sum_int32(py::array_t<int32_t, py::array::c_style | py::array::forcecast> values) {
  auto v = values.unchecked<1>();
  int64_t total = 0;
  for (py::ssize_t i = 0; i < v.shape(0); ++i) total += v(i);
  return total;
}

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "C++ helpers for Megatron dataset indices";
  m.def("sum_int32", &sum_int32, "Sum of an int32 array as int64");
}
