// pybind11 surface of the native core: the narrow interface Python sees.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "fgm_file.h"

namespace py = pybind11;

void bind_kernels(py::module_& m);  // kernels/bind_kernels.cpp
void bind_engine(py::module_& m);   // engine/bind_engine.cpp

namespace {

py::dict tensor_dict(const sg::TensorInfo& t) {
  py::dict d;
  d["dtype"] = sg::dtype_name(t.dtype);
  d["shape"] = py::tuple(py::cast(t.shape));
  d["offset"] = t.offset;
  d["nbytes"] = t.nbytes;
  d["hadamard"] = t.hadamard;
  d["group"] = t.group;
  return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "splitgemma native core: .fgm reader, kernels and the Gemma 4 forward pass";

  static py::exception<sg::FgmError> fgm_error(m, "FgmError", PyExc_ValueError);
  // The status a process exits with when a model file it has mapped is truncated under it (fgm_file.cpp).
  m.attr("EXIT_MODEL_FILE_CHANGED") = sg::kExitModelFileChanged;

  py::class_<sg::FgmFile, std::shared_ptr<sg::FgmFile>>(m, "FgmFile",
                                                        "A validated, memory-mapped FASTGEM1 .fgm file (zero copy).")
      .def(py::init([](const std::string& path) {
             py::gil_scoped_release nogil;
             return std::make_shared<sg::FgmFile>(path);
           }),
           py::arg("path"))
      .def_property_readonly("path", &sg::FgmFile::path)
      .def_property_readonly("header_json", &sg::FgmFile::header_json,
                             "The header JSON text exactly as stored (arch, config, meta, tensors).")
      .def_property_readonly("file_size", &sg::FgmFile::file_size)
      .def_property_readonly("layout_signature", &sg::FgmFile::layout_signature,
                             "64-bit fingerprint of config + tensor table (not of conversion stats).")
      .def_property_readonly("tensor_names",
                             [](const sg::FgmFile& f) {
                               std::vector<std::string> names;
                               for (const auto& t : f.tensors()) names.push_back(t.name);
                               return names;
                             })
      .def("tensor_info", [](const sg::FgmFile& f, const std::string& name) { return tensor_dict(f.require(name)); },
           py::arg("name"))
      .def("__contains__", [](const sg::FgmFile& f, const std::string& name) { return f.find(name) != nullptr; })
      .def(
          "raw",
          [](std::shared_ptr<sg::FgmFile> f, const std::string& name) {
            // A read-only uint8 view of the blob; it keeps the mapping alive.
            const sg::TensorInfo& t = f->require(name);
            py::array_t<uint8_t> a({static_cast<py::ssize_t>(t.nbytes)}, {1}, t.data, py::cast(f));
            py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
            return a;
          },
          py::arg("name"), "Zero-copy read-only bytes of one tensor blob.");

  bind_kernels(m);
  bind_engine(m);

  // Make FgmError carry the precise message.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const sg::FgmError& e) {
      fgm_error(e.what());
    }
  });
}
