// Fused elementwise layers of Llama-family decoders on the CPU: RMSNorm and SwiGLU, forward
// and backward, one pass over memory each (HF runs 6-10 separate kernels per call). Our
// kernels behind agentrl_fast.ops.fused_layers; semantics there and in docs/design.md.
#pragma once

#include <ATen/ATen.h>

namespace agentrl_fast {

// y[N, D] = weight * to_dtype(x * rstd), rstd[N] = 1 / sqrt(mean(x^2) + eps), the mean and the
// product in float32 (rstd float32), float64 for float64 inputs (rstd float64), as HF's
// Llama/Qwen3 RMSNorm.
// x, weight, y: one dtype of float32, float64, float16, bfloat16; x and y contiguous.
void rms_norm_cpu_out(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y,
                      at::Tensor& rstd);

// dx[N, D] (x's dtype) and dweight[D] (float32 for reduced-precision weights, else the
// weight's dtype) from dy and the forward's rstd; dweight is summed in a fixed order (the same
// result for the same thread count).
void rms_norm_cpu_backward_out(const at::Tensor& dy, const at::Tensor& x,
                               const at::Tensor& weight, const at::Tensor& rstd, at::Tensor& dx,
                               at::Tensor& dweight);

// out = silu(gate) * up, elementwise over contiguous tensors of one dtype.
void swiglu_cpu_out(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out);

// dgate, dup from dout (silu's derivative sigmoid(g) * (1 + g * (1 - sigmoid(g)))).
void swiglu_cpu_backward_out(const at::Tensor& dout, const at::Tensor& gate, const at::Tensor& up,
                             at::Tensor& dgate, at::Tensor& dup);

}  // namespace agentrl_fast
