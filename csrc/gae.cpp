// GAE over packed trajectories: argument checks (the one place they live), value validation and
// the CPU kernel. Semantics: docs/design.md, "GAE over packed trajectories".
#include "gae.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "gae_common.h"

namespace agentrl_fast {
namespace {

// The name a Python user knows a dtype by, for error messages.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kByte: return "torch.uint8";
    default: return std::string("torch.") + c10::toString(t);
  }
}

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The dtype rewards and values are read in: theirs when they agree, else the promoted type
// (at least float32, so that bf16 + fp16 does not lose range).
at::ScalarType compute_dtype(at::ScalarType rewards, at::ScalarType values) {
  if (rewards == values) return rewards;
  at::ScalarType promoted = at::promoteTypes(rewards, values);
  if (promoted == at::kHalf || promoted == at::kBFloat16) promoted = at::kFloat;
  return promoted;
}

void check_per_token(const at::Tensor& t, const char* name, int64_t num_tokens,
                     const at::Device& device) {
  TORCH_CHECK_VALUE(t.dim() == 1, name, " must be 1-D [T] (packed tokens), got shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.size(0) == num_tokens, name, " must have T = rewards.shape[0] = ",
                    num_tokens, " elements, got ", t.size(0));
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " like rewards, got ",
                    t.device());
}

struct CheckedArgs {
  at::Tensor rewards, values, cu_seqlens, action_mask, bootstrap_values, sequence_lam;
  at::ScalarType output_dtype;
};

// A per-sequence float tensor ([B]) in the dtype the kernels read it in: float64 on the CPU
// (which accumulates in float64), the output dtype on CUDA.
at::Tensor per_sequence(const at::Tensor& t, const char* name, int64_t num_sequences,
                        const at::Device& device, at::ScalarType output_dtype) {
  TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()), name,
                   " must be float32, float64, float16 or bfloat16, got ",
                   dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == num_sequences, name,
                    " must be 1-D [B] with B = len(cu_seqlens) - 1 = ", num_sequences,
                    ", got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " like rewards, got ",
                    t.device());
  return t.to(device.is_cpu() ? at::kDouble : output_dtype).contiguous();
}

CheckedArgs check_gae_args(const at::Tensor& rewards, const at::Tensor& values,
                           const at::Tensor& cu_seqlens,
                           const std::optional<at::Tensor>& action_mask,
                           const std::optional<at::Tensor>& bootstrap_values, double gamma,
                           double lam, const std::optional<at::Tensor>& sequence_lam) {
  TORCH_CHECK_TYPE(is_supported_float(rewards.scalar_type()),
                   "rewards must be float32, float64, float16 or bfloat16, got ",
                   dtype_name(rewards.scalar_type()));
  TORCH_CHECK_TYPE(is_supported_float(values.scalar_type()),
                   "values must be float32, float64, float16 or bfloat16, got ",
                   dtype_name(values.scalar_type()));
  TORCH_CHECK_VALUE(rewards.dim() == 1, "rewards must be 1-D [T] (packed tokens), got shape ",
                    rewards.sizes());
  const int64_t num_tokens = rewards.size(0);
  const at::Device device = rewards.device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "rewards must be on the CPU or a CUDA ",
                    "device, got ", device);
  check_per_token(values, "values", num_tokens, device);

  TORCH_CHECK_TYPE(cu_seqlens.scalar_type() == at::kInt, "cu_seqlens must be int32, got ",
                   dtype_name(cu_seqlens.scalar_type()), "; pass cu_seqlens.to(torch.int32)");
  TORCH_CHECK_VALUE(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1,
                    "cu_seqlens must be 1-D [B+1] with at least one element (cu_seqlens[0] = 0), ",
                    "got shape ", cu_seqlens.sizes());
  TORCH_CHECK_VALUE(cu_seqlens.device() == device, "cu_seqlens must be on ", device,
                    " like rewards, got ", cu_seqlens.device());
  TORCH_CHECK_VALUE(num_tokens < (int64_t(1) << 31),
                    "rewards has ", num_tokens, " tokens; int32 cu_seqlens allow at most 2^31 - 1");
  const int64_t num_sequences = cu_seqlens.size(0) - 1;

  // NaN fails both comparisons, so it is rejected too.
  TORCH_CHECK_VALUE(gamma >= 0.0 && gamma <= 1.0, "gamma must be in [0, 1], got ", gamma);
  TORCH_CHECK_VALUE(lam >= 0.0 && lam <= 1.0, "lam must be in [0, 1], got ", lam);

  CheckedArgs out;
  const at::ScalarType dtype = compute_dtype(rewards.scalar_type(), values.scalar_type());
  out.rewards = rewards.to(dtype).contiguous();
  out.values = values.to(dtype).contiguous();
  out.cu_seqlens = cu_seqlens.contiguous();
  out.output_dtype = gae_output_dtype(dtype);

  if (action_mask.has_value() && action_mask->defined()) {
    TORCH_CHECK_TYPE(action_mask->scalar_type() == at::kBool, "action_mask must be bool, got ",
                     dtype_name(action_mask->scalar_type()), "; pass action_mask.bool()");
    check_per_token(*action_mask, "action_mask", num_tokens, device);
    out.action_mask = action_mask->contiguous();
  }
  if (bootstrap_values.has_value() && bootstrap_values->defined()) {
    out.bootstrap_values = per_sequence(*bootstrap_values, "bootstrap_values", num_sequences,
                                        device, out.output_dtype);
  }
  if (sequence_lam.has_value() && sequence_lam->defined()) {
    out.sequence_lam =
        per_sequence(*sequence_lam, "lam", num_sequences, device, out.output_dtype);
  }
  return out;
}

// Index of the first true element of a bool tensor, or -1; stays on the device.
at::Tensor first_true(const at::Tensor& flags) {
  if (flags.numel() == 0) return at::full({}, -1, flags.options().dtype(at::kLong));
  return at::where(flags.any(), flags.to(at::kByte).argmax(), at::full({}, -1, flags.options().dtype(at::kLong)));
}

// Probes read by the value checks, each an index (-1: fine) or a value:
// [cu_seqlens[0], cu_seqlens[-1], first i with cu[i] > cu[i+1], first non-finite reward,
//  first non-finite value, first non-finite bootstrap, first reward on a non-action token,
//  first sequence whose lambda is outside [0, 1] (NaN included)].
constexpr int kNumProbes = 8;

// On the device: ATen ops, gathered into one small tensor copied to the host once.
at::Tensor value_probes_device(const CheckedArgs& args, const at::Tensor& raw_bootstrap) {
  const at::Tensor cu64 = args.cu_seqlens.to(at::kLong);
  const at::Tensor none = at::full({}, -1, cu64.options());
  std::vector<at::Tensor> probes;
  probes.push_back(cu64[0]);
  probes.push_back(cu64[-1]);
  probes.push_back(first_true(cu64.slice(0, 1).lt(cu64.slice(0, 0, -1))));
  probes.push_back(first_true(args.rewards.isfinite().logical_not()));
  probes.push_back(first_true(args.values.isfinite().logical_not()));
  probes.push_back(raw_bootstrap.defined() ? first_true(raw_bootstrap.isfinite().logical_not())
                                           : none);
  probes.push_back(args.action_mask.defined()
                       ? first_true(args.rewards.ne(0).logical_and(args.action_mask.logical_not()))
                       : none);
  const at::Tensor& lam = args.sequence_lam;
  probes.push_back(lam.defined() ? first_true(lam.ge(0).logical_and(lam.le(1)).logical_not())
                                 : none);
  return at::stack(probes).cpu();
}

// On the CPU: one fused parallel pass over the tokens (no temporaries).
at::Tensor value_probes_cpu(const CheckedArgs& args) {
  at::Tensor host = at::full({kNumProbes}, -1, at::TensorOptions().dtype(at::kLong));
  int64_t* p = host.data_ptr<int64_t>();
  const int32_t* cu = args.cu_seqlens.data_ptr<int32_t>();
  const int64_t num_entries = args.cu_seqlens.size(0);
  p[0] = cu[0];
  p[1] = cu[num_entries - 1];
  for (int64_t i = 0; i + 1 < num_entries; ++i) {
    if (cu[i] > cu[i + 1]) {
      p[2] = i;
      break;
    }
  }
  if (args.bootstrap_values.defined()) {
    const double* boot = args.bootstrap_values.data_ptr<double>();
    for (int64_t b = 0; b < args.bootstrap_values.size(0); ++b) {
      if (!std::isfinite(boot[b])) {
        p[5] = b;
        break;
      }
    }
  }
  if (args.sequence_lam.defined()) {
    const double* lam = args.sequence_lam.data_ptr<double>();
    for (int64_t b = 0; b < args.sequence_lam.size(0); ++b) {
      if (!(lam[b] >= 0.0 && lam[b] <= 1.0)) {  // NaN fails both
        p[7] = b;
        break;
      }
    }
  }
  const int64_t num_tokens = args.rewards.size(0);
  const bool* mask = args.action_mask.defined() ? args.action_mask.data_ptr<bool>() : nullptr;
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  std::atomic<int64_t> first_reward{kNever}, first_value{kNever}, first_off_action{kNever};
  auto lower = [](std::atomic<int64_t>& target, int64_t index) {
    int64_t current = target.load();
    while (index < current && !target.compare_exchange_weak(current, index)) {
    }
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.rewards.scalar_type(),
                                  "gae_validate_cpu", [&] {
    const scalar_t* rewards = args.rewards.data_ptr<scalar_t>();
    const scalar_t* values = args.values.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens, 1 << 16, [&](int64_t begin, int64_t end) {
      int64_t bad_reward = kNever, bad_value = kNever, off_action = kNever;
      for (int64_t t = end - 1; t >= begin; --t) {  // backwards: the last hit is the first index
        const double r = static_cast<double>(rewards[t]);
        bad_reward = std::isfinite(r) ? bad_reward : t;
        bad_value = std::isfinite(static_cast<double>(values[t])) ? bad_value : t;
        off_action = (mask != nullptr && !mask[t] && r != 0.0) ? t : off_action;
      }
      lower(first_reward, bad_reward);
      lower(first_value, bad_value);
      lower(first_off_action, off_action);
    });
  });
  auto as_probe = [&](int64_t index) { return index == kNever ? int64_t(-1) : index; };
  p[3] = as_probe(first_reward.load());
  p[4] = as_probe(first_value.load());
  p[6] = as_probe(first_off_action.load());
  return host;
}

// Value checks. On CUDA they cost one host sync (a single copy of a few integers).
void validate_gae_values(const CheckedArgs& args, const at::Tensor& raw_bootstrap) {
  const int64_t num_tokens = args.rewards.size(0);
  const at::Tensor host =
      args.rewards.is_cpu() ? value_probes_cpu(args) : value_probes_device(args, raw_bootstrap);
  const int64_t* p = host.data_ptr<int64_t>();

  TORCH_CHECK_VALUE(p[0] == 0, "cu_seqlens[0] must be 0, got ", p[0]);
  if (p[2] >= 0) {
    const at::Tensor pair = args.cu_seqlens.slice(0, p[2], p[2] + 2).to(at::kLong).cpu();
    TORCH_CHECK_VALUE(false, "cu_seqlens must be non-decreasing, but cu_seqlens[", p[2],
                      "] = ", pair[0].item<int64_t>(), " > cu_seqlens[", p[2] + 1, "] = ",
                      pair[1].item<int64_t>());
  }
  TORCH_CHECK_VALUE(p[1] == num_tokens, "cu_seqlens[-1] must equal the number of tokens T = ",
                    "rewards.shape[0] = ", num_tokens, ", got ", p[1]);
  TORCH_CHECK_VALUE(p[3] < 0, "rewards must be finite, found ",
                    args.rewards[p[3] < 0 ? 0 : p[3]].item<double>(), " at token ", p[3]);
  TORCH_CHECK_VALUE(p[4] < 0, "values must be finite, found ",
                    args.values[p[4] < 0 ? 0 : p[4]].item<double>(), " at token ", p[4]);
  TORCH_CHECK_VALUE(p[5] < 0, "bootstrap_values must be finite, found ",
                    raw_bootstrap.defined() ? raw_bootstrap[p[5] < 0 ? 0 : p[5]].item<double>() : 0.0,
                    " at sequence ", p[5]);
  TORCH_CHECK_VALUE(p[6] < 0, "rewards on non-action tokens: rewards[", p[6], "] = ",
                    args.rewards[p[6] < 0 ? 0 : p[6]].item<double>(),
                    " but action_mask[", p[6], "] is False; put each reward on an action token ",
                    "(e.g. the last token the policy sampled in that turn)");
  TORCH_CHECK_VALUE(p[7] < 0, "lam must be in [0, 1] for every sequence, got ",
                    args.sequence_lam.defined()
                        ? args.sequence_lam[p[7] < 0 ? 0 : p[7]].item<double>() : 0.0,
                    " at sequence ", p[7]);
}

void check_output(const at::Tensor& out, const char* name, int64_t num_tokens,
                  at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK_TYPE(out.scalar_type() == dtype, name, " must be ", dtype_name(dtype),
                   " (float64 only for float64 inputs), got ", dtype_name(out.scalar_type()));
  TORCH_CHECK_VALUE(out.dim() == 1 && out.size(0) == num_tokens, name, " must be 1-D [T] with T = ",
                    num_tokens, ", got shape ", out.sizes());
  TORCH_CHECK_VALUE(out.device() == device, name, " must be on ", device, ", got ", out.device());
  TORCH_CHECK_VALUE(out.is_contiguous(), name, " must be contiguous");
}

void run_kernel(const CheckedArgs& args, double gamma, double lam, at::Tensor& advantages,
                at::Tensor& returns) {
  if (args.rewards.size(0) == 0) return;
  if (args.rewards.is_cuda()) {
#ifdef AGENTRL_FAST_WITH_CUDA
    gae_cuda_kernel(args.rewards, args.values, args.cu_seqlens, args.action_mask,
                    args.bootstrap_values, gamma, lam, args.sequence_lam, advantages, returns);
    return;
#else
    TORCH_CHECK(false, "agentrl_fast was built without CUDA; rebuild with AGENTRL_FAST_CUDA=1");
#endif
  }
  gae_cpu_kernel(args.rewards, args.values, args.cu_seqlens, args.action_mask,
                 args.bootstrap_values, gamma, lam, args.sequence_lam, advantages, returns);
}

}  // namespace

at::ScalarType gae_output_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

void gae_out(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& cu_seqlens,
             const std::optional<at::Tensor>& action_mask,
             const std::optional<at::Tensor>& bootstrap_values, double gamma, double lam,
             bool validate, at::Tensor& advantages, at::Tensor& returns,
             const std::optional<at::Tensor>& sequence_lam) {
  CheckedArgs args = check_gae_args(rewards, values, cu_seqlens, action_mask, bootstrap_values,
                                    gamma, lam, sequence_lam);
  check_output(advantages, "advantages", rewards.size(0), args.output_dtype, rewards.device());
  check_output(returns, "returns", rewards.size(0), args.output_dtype, rewards.device());
  TORCH_CHECK_VALUE(rewards.size(0) == 0 || !advantages.is_same(returns),
                    "advantages and returns must be different tensors");
  if (validate) {
    validate_gae_values(args, bootstrap_values.has_value() ? *bootstrap_values : at::Tensor());
  }
  run_kernel(args, gamma, lam, advantages, returns);
}

std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values,
                                       const at::Tensor& cu_seqlens,
                                       const std::optional<at::Tensor>& action_mask,
                                       const std::optional<at::Tensor>& bootstrap_values,
                                       double gamma, double lam, bool validate,
                                       const std::optional<at::Tensor>& sequence_lam) {
  CheckedArgs args = check_gae_args(rewards, values, cu_seqlens, action_mask, bootstrap_values,
                                    gamma, lam, sequence_lam);
  if (validate) {
    validate_gae_values(args, bootstrap_values.has_value() ? *bootstrap_values : at::Tensor());
  }
  at::Tensor advantages = at::empty({rewards.size(0)}, rewards.options().dtype(args.output_dtype));
  at::Tensor returns = at::empty_like(advantages);
  run_kernel(args, gamma, lam, advantages, returns);
  return {advantages, returns};
}

// ---------------------------------------------------------------------------------------------
// CPU kernel. Sequences are cut into chunks of at most kCpuChunk tokens; chunks are the unit of
// parallel work (dynamic scheduling on torch's intra-op pool). A sequence longer than one chunk
// is a parallel scan: (A) each chunk but the first composes its tokens' affine maps, (B) a short
// sequential pass turns those into the carry entering each chunk, (C) every chunk runs the
// recurrence from its carry. Short sequences go straight to (C).
namespace {

constexpr int64_t kCpuChunk = 1 << 15;

struct Chunk {
  int64_t begin, end;  // token range
  int64_t sequence;
  bool first_of_sequence, last_of_sequence;
};

template <typename scalar_t, typename out_t>
void gae_cpu_typed(const scalar_t* rewards, const scalar_t* values, const bool* mask,
                   const double* boot, const double* sequence_lam, const int32_t* cu,
                   int64_t num_sequences, int64_t num_tokens, double gamma, double lam,
                   out_t* adv, out_t* ret) {
  // gamma * lambda of a chunk's sequence.
  auto gamma_lam_of = [&](const Chunk& c) {
    return gamma * (sequence_lam == nullptr ? lam : sequence_lam[c.sequence]);
  };
  std::vector<Chunk> chunks;
  chunks.reserve(num_sequences);
  int64_t previous_end = 0;
  for (int64_t b = 0; b < num_sequences; ++b) {
    // Clamped so that unvalidated cu_seqlens can give wrong numbers but never a bad access.
    const int64_t begin = clamp_index<int64_t>(cu[b], previous_end, num_tokens);
    const int64_t end = clamp_index<int64_t>(cu[b + 1], begin, num_tokens);
    previous_end = end;
    for (int64_t c = begin; c < end; c += kCpuChunk) {
      const int64_t c_end = std::min(end, c + kCpuChunk);
      chunks.push_back({c, c_end, b, c == begin, c_end == end});
    }
  }
  // Tokens outside every sequence exist only with unvalidated cu_seqlens; they get zeros so
  // that every output element is written whatever the input.
  {
    int64_t covered = 0;
    auto zero = [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) adv[t] = ret[t] = out_t(0);
    };
    for (const Chunk& c : chunks) {
      zero(covered, c.begin);
      covered = c.end;
    }
    zero(covered, num_tokens);
  }
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  std::vector<GaeMap<double>> aggregate(num_chunks);
  std::vector<double> carry_v(num_chunks), carry_a(num_chunks);

  auto is_action = [&](int64_t t) { return mask == nullptr || mask[t]; };
  // Dynamic scheduling on torch's intra-op pool: work items of very different sizes.
  auto parallel_dynamic = [&](int64_t count, auto&& work) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t grain = std::max<int64_t>(1, count / (threads * 8));
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (;;) {
        const int64_t first = next.fetch_add(grain);
        if (first >= count) break;
        const int64_t last = std::min(count, first + grain);
        for (int64_t i = first; i < last; ++i) work(i);
      }
    });
  };


  // (A) aggregates of chunks that have a chunk to their left in the same sequence.
  bool any_split = false;
  for (const Chunk& c : chunks) any_split |= !c.first_of_sequence;
  if (any_split) {
    parallel_dynamic(num_chunks, [&](int64_t i) {
      const Chunk& c = chunks[i];
      if (c.first_of_sequence) return;
      const double gamma_lam = gamma_lam_of(c);
      GaeMap<double> m = gae_identity_map<double>();
      for (int64_t t = c.end - 1; t >= c.begin; --t) {
        m = gae_compose(gae_token_map<double>(rewards[t], values[t], is_action(t), gamma,
                                              gamma_lam),
                        m);
      }
      aggregate[i] = m;
    });
  }
  // (B) carries, right to left within each sequence.
  for (int64_t i = num_chunks - 1; i >= 0; --i) {
    if (chunks[i].last_of_sequence) {
      carry_v[i] = boot == nullptr ? 0.0 : boot[chunks[i].sequence];
      carry_a[i] = 0.0;
    } else {
      double vn = carry_v[i + 1], an = carry_a[i + 1];
      gae_apply(aggregate[i + 1], vn, an);
      carry_v[i] = vn;
      carry_a[i] = an;
    }
  }
  // (C) the recurrence (branch-free; about 4 ns a token on one core of the 2-core dev box,
  // bound by instruction throughput, not memory).
  parallel_dynamic(num_chunks, [&](int64_t i) {
    const Chunk& c = chunks[i];
    const double gamma_lam = gamma_lam_of(c);
    double vn = carry_v[i], an = carry_a[i];
    for (int64_t t = c.end - 1; t >= c.begin; --t) {
      const bool action = is_action(t);
      const double value = static_cast<double>(values[t]);
      const double a = gae_step<double>(static_cast<double>(rewards[t]), value, action, gamma,
                                        gamma_lam, vn, an);
      adv[t] = static_cast<out_t>(a);
      ret[t] = static_cast<out_t>(action ? a + value : 0.0);
    }
  });
}

}  // namespace

void gae_cpu_kernel(const at::Tensor& rewards, const at::Tensor& values,
                    const at::Tensor& cu_seqlens, const at::Tensor& action_mask,
                    const at::Tensor& bootstrap_values, double gamma, double lam,
                    const at::Tensor& sequence_lam, at::Tensor& advantages, at::Tensor& returns) {
  const bool* mask = action_mask.defined() ? action_mask.data_ptr<bool>() : nullptr;
  const double* boot = bootstrap_values.defined() ? bootstrap_values.data_ptr<double>() : nullptr;
  const double* seq_lam = sequence_lam.defined() ? sequence_lam.data_ptr<double>() : nullptr;
  const int64_t num_sequences = cu_seqlens.size(0) - 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rewards.scalar_type(), "gae_cpu", [&] {
    if (advantages.scalar_type() == at::kDouble) {
      gae_cpu_typed<scalar_t, double>(rewards.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                                      mask, boot, seq_lam, cu_seqlens.data_ptr<int32_t>(),
                                      num_sequences,
                                      rewards.size(0), gamma, lam,
                                      advantages.data_ptr<double>(), returns.data_ptr<double>());
    } else {
      gae_cpu_typed<scalar_t, float>(rewards.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                                     mask, boot, seq_lam, cu_seqlens.data_ptr<int32_t>(),
                                     num_sequences,
                                     rewards.size(0), gamma, lam, advantages.data_ptr<float>(),
                                     returns.data_ptr<float>());
    }
  });
}

}  // namespace agentrl_fast
