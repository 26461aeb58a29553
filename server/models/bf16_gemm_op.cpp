// The AMX bf16 linear (bf16_gemm.cpp, included below) as a torch operator, `specserve_native::tiled_linear`, so
// compiled graphs and eager layers call it without a Python frame or a ctypes conversion per call (~5 µs a call
// through those, 33 calls a decode step). Built against the installed torch's headers by bf16_gemm.py; where
// it does not build, the ctypes entry of bf16_gemm.cpp serves the same kernel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#include "bf16_gemm.cpp"

namespace {

at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
    TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
                "tiled_linear: packed must be bf16_gemm.pack()'s contiguous [N/16, K/32, 16, 16, 2] bf16");
    const int64_t n = packed.size(0) * 16, k = packed.size(1) * 32;
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k,
                "tiled_linear: input must be CPU bf16 [..., ", k, "]");
    if (bias.has_value()) {
        TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                    "tiled_linear: bias must be contiguous fp32 [", n, "]");
    }
    const at::Tensor rows = x.reshape({-1, k}).contiguous();
    at::Tensor out = at::empty({rows.size(0), n}, rows.options());
    const int rc = specserve_bf16_linear(static_cast<const uint16_t*>(rows.const_data_ptr()), rows.size(0), k,
                                         static_cast<const uint16_t*>(packed.const_data_ptr()), n,
                                         bias.has_value() ? bias->const_data_ptr<float>() : nullptr,
                                         static_cast<uint16_t*>(out.data_ptr()), at::get_num_threads());
    TORCH_CHECK(rc == 0, "tiled_linear: shapes not taken");
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n;
    return out.view(shape);
}

}  // namespace

TORCH_LIBRARY(specserve_native, m) {
    m.def("tiled_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_native, CPU, m) {
    m.impl("tiled_linear", tiled_linear);
}
