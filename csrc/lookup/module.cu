// The Python bindings of the CUDA lookup extension (lookup.h).
#include <torch/extension.h>

#include "lookup.h"

// What the build was made from and for, as bare tokens (setup.py, recom_rec/native_build.py): the
// loader compiles afresh when the sources changed since, or when the GPU is not among the targets.
#define RECOM_REC_STR(x) #x
#define RECOM_REC_XSTR(x) RECOM_REC_STR(x)
#ifndef RECOM_REC_SOURCES_SHA256
#define RECOM_REC_SOURCES_SHA256 unknown
#endif
#ifndef RECOM_REC_CUDA_TARGETS
#define RECOM_REC_CUDA_TARGETS sm
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("sources_sha256") = RECOM_REC_XSTR(RECOM_REC_SOURCES_SHA256);
  m.attr("cuda_targets") = RECOM_REC_XSTR(RECOM_REC_CUDA_TARGETS);
  m.def("pooled_forward", &pooled_forward, "fused pooled embedding forward (CUDA)");
  m.def("piece_update", &piece_update, "backward piece and split-row kernels with the fused optimizer (CUDA)");
  m.def("plan_backward", &plan_backward, "backward plan: expand, sort, pieces (CUDA)");
  m.def("zero_untouched_rows", &zero_untouched_rows, "dense backward: zeros outside the touched rows (CUDA)");
  m.def("expand_rows_forward", &expand_rows_forward, "variable batch: pooled bags to output rows (CUDA)");
  m.def("expand_rows_forward_in_place", &expand_rows_forward_in_place,
        "variable batch: pooled bags to output rows in place, where they are as many (CUDA)");
  m.def("expand_rows_backward", &expand_rows_backward, "variable batch: output rows' gradients to bags (CUDA)",
        py::arg("grad"), py::arg("inverse"), py::arg("col_feature"), py::arg("num_bags"), py::arg("whole_chunks"),
        py::arg("moved") = py::none());
  m.def("pad_offsets", &pad_offsets, "variable batch: a KJT's offsets padded to a bag count a key (CUDA)");
  m.def("singleton_update", &singleton_update, "backward of the rows of one lookup, in bag order (CUDA)");
  m.def("pad_gradient_columns", &pad_gradient_columns, "backward: the gradient's columns to their padded columns (CUDA)");
  m.def("count_step", &count_step, "the fused optimizer's step counter plus one (CUDA)");
  m.def("unpooled_forward", &unpooled_forward, "unpooled lookup: one fp32 row per id (CUDA)");
  m.def("unpooled_row_keys", &unpooled_row_keys, "unpooled lookup: row keys, and gradient rows (CUDA)");
  m.def("unpooled_backward", &unpooled_backward, "unpooled lookup: the eager backward in one call (CUDA)");
}
