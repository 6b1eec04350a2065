// The Python module of the cpu kernels (devices.cpu_kernels builds and loads it).
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged cache", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("value_dim") = 0);
  m.def("paged_chunk", &paged_chunk, "a chunk's attention over the paged cache", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_table"), py::arg("num_cached"), py::arg("scale"), py::arg("value_dim") = 0);
  m.def("int8_linear", &int8_linear, "an int8 linear layer's forward: quantize rows, oneDNN's kernel, rescale",
        py::arg("x"), py::arg("input_scale"), py::arg("packed"), py::arg("output_scale"), py::arg("zero_points"),
        py::arg("bias") = py::none());
}
