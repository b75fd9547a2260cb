// Attention over packed variable-length trajectories on the CPU: our kernel behind the
// "native" backend of agentrl_fast.ops.varlen_attention. Semantics: docs/design.md, "Attention over
// packed trajectories".
#pragma once

#include <ATen/ATen.h>

namespace agentrl_fast {

// Fills out[T, Hq, D] (q's dtype) and lse[Hq, T] (float32) from q[T, Hq, D], k, v[T, Hk, D]
// (float32, float16 or bfloat16, contiguous, Hq % Hk == 0, D <= 256) and cu_seqlens[B + 1]
// (int32/int64; clamped into range, so unvalidated values never read out of bounds). Tokens in
// no sequence get out = 0 and lse = -inf.
void varlen_attention_cpu_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_seqlens, bool causal, double scale,
                              at::Tensor& out, at::Tensor& lse);

// Fills dq, dk, dv (the dtypes of q, k, v) from the forward's out and lse.
void varlen_attention_cpu_backward_out(const at::Tensor& dout, const at::Tensor& q,
                                       const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& out, const at::Tensor& lse,
                                       const at::Tensor& cu_seqlens, bool causal, double scale,
                                       at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

// Prefix-shared (tree) mode, causal: prefix_of[B] (int32/int64) gives each segment's prefix
// segment (-1: none). A suffix b's tokens attend to all tokens of segment prefix_of[b] and
// causally to their own; prefixes and plain segments are the plain causal op. Unvalidated
// entries that are no earlier non-suffix segment count as -1 (never read out of bounds).
void varlen_attention_cpu_prefix_out(const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& cu_seqlens,
                                     const at::Tensor& prefix_of, double scale, at::Tensor& out,
                                     at::Tensor& lse);

// The prefix mode's gradients: a prefix's dk and dv sum over its own queries and all its
// suffixes' queries, in a fixed order (deterministic).
void varlen_attention_cpu_prefix_backward_out(const at::Tensor& dout, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& out, const at::Tensor& lse,
                                              const at::Tensor& cu_seqlens,
                                              const at::Tensor& prefix_of, double scale,
                                              at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

// Whether the kernels run their AVX2 + FMA build (else the baseline one: x86-64 CPUs without
// AVX2 + FMA, other architectures, or AGENTRL_FAST_CPU_BASELINE=1).
bool varlen_attention_cpu_uses_avx2();

}  // namespace agentrl_fast
