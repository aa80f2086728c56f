// Python access to the engine (model, KV arena, prefill, decode step, sampling).
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_engine(py::module_& m) { (void)m; }
