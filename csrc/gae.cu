// GAE over packed trajectories on CUDA: one single-pass scan over all T tokens.
//
// The recurrence is a scan of 5-number affine maps (gae_common.h). A sequence's bootstrap is a
// constant map right of its last token, so the scan over the whole packed batch needs no
// segment logic: it runs over fixed tiles of kTile tokens whatever the length mix (4096 short
// sequences, a long tail, one sequence of 10^6 tokens all run at the same speed). Tiles are
// handed out right to left by an atomic ticket; each tile publishes its aggregate, then its
// first warp looks back over the tiles to its right, 32 at a time (decoupled look-back, as in
// CUB's single-pass scan; the code is gae_lookback.h, shared with a host emulation the tests
// run) for the carry entering it. A tile whose aggregate is constant (it contains a sequence
// end) publishes its inclusive value at once, so look-back from the left stops there: with
// many short sequences it is one hop. Inputs are read once and outputs written once: the kernel moves the
// minimum number of bytes.
//
// With validate=false, non-finite inputs may spread NaN into earlier sequences of the same or
// the previous tile (0 * NaN in the map algebra); validated inputs are finite.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "gae.h"
#include "gae_common.h"
#include "gae_lookback.h"

namespace agentrl_fast {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr int kTile = kThreads * kItems;
constexpr int kWarps = kThreads / 32;
// Shared-memory slots are skewed by one every 32 so that a thread reading its kItems
// consecutive tokens (stride kItems between threads) hits distinct banks.
constexpr int kTileSlots = kTile + kTile / 32;
__device__ __forceinline__ int slot(int i) { return i + (i >> 5); }

template <typename acc_t>
__device__ __forceinline__ GaeMap<acc_t> shuffle_down(const GaeMap<acc_t>& m, int offset) {
  GaeMap<acc_t> out;
  out.s = __shfl_down_sync(0xffffffffu, m.s, offset);
  out.V = __shfl_down_sync(0xffffffffu, m.V, offset);
  out.C = __shfl_down_sync(0xffffffffu, m.C, offset);
  out.P = __shfl_down_sync(0xffffffffu, m.P, offset);
  out.Q = __shfl_down_sync(0xffffffffu, m.Q, offset);
  return out;
}

template <typename acc_t>
__device__ __forceinline__ GaeMap<acc_t> shuffle_from(const GaeMap<acc_t>& m, int lane) {
  return {__shfl_sync(0xffffffffu, m.s, lane), __shfl_sync(0xffffffffu, m.V, lane),
          __shfl_sync(0xffffffffu, m.C, lane), __shfl_sync(0xffffffffu, m.P, lane),
          __shfl_sync(0xffffffffu, m.Q, lane)};
}

// gae_lookback.h's Warp on the GPU: this thread is lane `lane` of a full warp.
struct DeviceWarp {
  int lane;

  template <class T>
  struct Lanes {
    T value;
    __device__ __forceinline__ const T& operator[](int) const { return value; }
  };

  template <class F>
  __device__ __forceinline__ auto each(F f) const -> Lanes<decltype(f(0))> {
    return {f(lane)};
  }
  __device__ __forceinline__ unsigned ballot(const Lanes<bool>& p) const {
    return __ballot_sync(0xffffffffu, p.value);
  }
  __device__ __forceinline__ int first_lane(unsigned bits) const { return __ffs(bits) - 1; }
  template <typename acc_t>
  __device__ __forceinline__ GaeMap<acc_t> compose_first(const Lanes<GaeMap<acc_t>>& maps,
                                                         int count) const {
    // Suffix scan over the lanes: lane 0 ends with lane 0 ∘ ... ∘ lane 31 (identities past
    // count), then broadcast.
    GaeMap<acc_t> m = lane < count ? maps.value : gae_identity_map<acc_t>();
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const GaeMap<acc_t> right = shuffle_down(m, offset);
      if (lane + offset < 32) m = gae_compose(m, right);
    }
    return shuffle_from(m, 0);
  }
  __device__ __forceinline__ bool leader() const { return lane == 0; }
  __device__ __forceinline__ int load_flag(const int* p) const {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
  __device__ __forceinline__ void store_flag(int* p, int v) const {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
  template <typename acc_t>
  __device__ __forceinline__ GaeMap<acc_t> load_state(const GaeMap<acc_t>* src) const {
    // volatile: read the global state the acquire ordered, never a stale cached copy.
    const volatile acc_t* p = reinterpret_cast<const volatile acc_t*>(src);
    return {p[0], p[1], p[2], p[3], p[4]};
  }
  template <typename acc_t>
  __device__ __forceinline__ void store_state(GaeMap<acc_t>* dst, const GaeMap<acc_t>& m) const {
    volatile acc_t* p = reinterpret_cast<volatile acc_t*>(dst);
    p[0] = m.s;
    p[1] = m.V;
    p[2] = m.C;
    p[3] = m.P;
    p[4] = m.Q;
  }
  __device__ __forceinline__ void pause() const { __nanosleep(20); }
};

// Index b of the sequence holding token t (cu[b] <= t < cu[b+1]) or, for a token outside every
// sequence (only with unvalidated cu_seqlens), -1 or num_sequences.
__device__ __forceinline__ int64_t find_sequence(const int32_t* __restrict__ cu,
                                                 int64_t num_sequences, int64_t t) {
  // upper_bound over cu[0..num_sequences], then step back one.
  int64_t lo = 0, hi = num_sequences + 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(__ldg(cu + mid)) <= t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo - 1;
}

template <typename scalar_t, typename acc_t, typename out_t>
__global__ void __launch_bounds__(kThreads)
    gae_scan_kernel(const scalar_t* __restrict__ rewards, const scalar_t* __restrict__ values,
                    const bool* __restrict__ action_mask, const acc_t* __restrict__ bootstrap,
                    const acc_t* __restrict__ sequence_lam, const int32_t* __restrict__ cu,
                    int64_t num_sequences, int64_t num_tokens, acc_t gamma, acc_t gamma_lam,
                    out_t* __restrict__ advantages,
                    out_t* __restrict__ returns, GaeMap<acc_t>* tile_aggregate,
                    GaeMap<acc_t>* tile_inclusive, int* tile_flag, unsigned int* tile_ticket,
                    int64_t num_tiles) {
  __shared__ acc_t s_reward[kTileSlots];
  __shared__ acc_t s_value[kTileSlots];
  __shared__ unsigned char s_action[kTileSlots];
  __shared__ GaeMap<acc_t> s_warp[kWarps];
  __shared__ GaeMap<acc_t> s_right_of_warp[kWarps];
  __shared__ int64_t s_tile;
  __shared__ acc_t s_carry_v, s_carry_a;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;

  if (tid == 0) s_tile = num_tiles - 1 - static_cast<int64_t>(atomicAdd(tile_ticket, 1u));
  __syncthreads();
  const int64_t tile = s_tile;
  const int64_t base = tile * kTile;

  // Coalesced loads into shared memory.
  for (int j = tid; j < kTile; j += kThreads) {
    const int64_t t = base + j;
    const int i = slot(j);
    if (t < num_tokens) {
      s_reward[i] = static_cast<acc_t>(rewards[t]);
      s_value[i] = static_cast<acc_t>(values[t]);
      s_action[i] = action_mask == nullptr ? 1 : static_cast<unsigned char>(action_mask[t]);
    } else {  // past the end: identity maps
      s_reward[i] = acc_t(0);
      s_value[i] = acc_t(0);
      s_action[i] = 0;
    }
  }
  __syncthreads();

  // This thread's kItems consecutive tokens: their maps composed right to left. A token that
  // ends its sequence gets the bootstrap map composed right of it. Going right to left, a
  // sequence end switches to that sequence's bootstrap and lambda (item_sequence[k] is the
  // sequence token k ends); the tokens right of the last end belong to the sequence whose
  // gamma * lambda is tail_gamma_lam. Indices, not values, are kept per token: registers.
  const int first = tid * kItems;
  const int64_t t0 = base + first;
  unsigned int end_bits = 0;
  int64_t item_sequence[kItems];
  acc_t tail_gamma_lam = gamma_lam;
  const auto bootstrap_of = [&](int64_t b) { return bootstrap == nullptr ? acc_t(0) : bootstrap[b]; };
  const auto gamma_lam_of = [&](int64_t b) {
    return sequence_lam == nullptr ? gamma_lam : gamma * sequence_lam[b];
  };
  GaeMap<acc_t> thread_map = gae_identity_map<acc_t>();
  {
    int64_t b = t0 < num_tokens ? find_sequence(cu, num_sequences, t0) : num_sequences;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t t = t0 + k;
      item_sequence[k] = 0;
      if (t >= num_tokens) continue;
      // Crossing boundaries: step, and search again after a few steps (a run of empty
      // sequences costs log B, not its length).
      for (int steps = 0; b < num_sequences && t >= static_cast<int64_t>(__ldg(cu + b + 1));) {
        ++b;
        if (++steps == 4) {
          b = find_sequence(cu, num_sequences, t);
          break;
        }
      }
      const bool inside = b >= 0 && b < num_sequences;
      if (inside && t + 1 == static_cast<int64_t>(__ldg(cu + b + 1))) {
        end_bits |= 1u << k;
        item_sequence[k] = b;
      }
      if (!inside) s_action[slot(first + k)] = 0;  // outside every sequence
      // The last token of the thread's in-range ones sets the tail (outside: no step at all).
      tail_gamma_lam = inside ? gamma_lam_of(b) : gamma_lam;
    }
    acc_t gl = tail_gamma_lam;
#pragma unroll
    for (int k = kItems - 1; k >= 0; --k) {
      const int i = slot(first + k);
      const bool ends = end_bits & (1u << k);
      if (ends) gl = gamma_lam_of(item_sequence[k]);
      GaeMap<acc_t> m = gae_token_map<acc_t>(s_reward[i], s_value[i], s_action[i] != 0, gamma, gl);
      if (ends) m = gae_compose(m, gae_bootstrap_map<acc_t>(bootstrap_of(item_sequence[k])));
      thread_map = gae_compose(m, thread_map);
    }
  }

  // Block-wide suffix scan of the thread maps.
  GaeMap<acc_t> inclusive = thread_map;  // thread_map(lane) ∘ ... ∘ thread_map(31)
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const GaeMap<acc_t> right = shuffle_down(inclusive, offset);
    if (lane + offset < 32) inclusive = gae_compose(inclusive, right);
  }
  GaeMap<acc_t> exclusive = shuffle_down(inclusive, 1);
  if (lane == 31) exclusive = gae_identity_map<acc_t>();
  if (lane == 0) s_warp[warp] = inclusive;
  __syncthreads();
  if (tid == 0) {
    GaeMap<acc_t> right = gae_identity_map<acc_t>();
    for (int w = kWarps - 1; w >= 0; --w) {
      s_right_of_warp[w] = right;
      right = gae_compose(s_warp[w], right);
    }
  }
  __syncthreads();
  if (warp == 0) {
    // The first warp exchanges the carry with the tiles to the right (gae_lookback.h); the
    // tile's aggregate is read from shared memory when needed.
    const GaeTileStates<acc_t> states{tile_aggregate, tile_inclusive, tile_flag};
    const auto aggregate = [&] { return gae_compose(s_warp[0], s_right_of_warp[0]); };
    const GaeMap<acc_t> from_right =
        gae_tile_carry(DeviceWarp{lane}, states, tile, num_tiles, aggregate);
    if (lane == 0) {
      acc_t vn = acc_t(0), an = acc_t(0);
      gae_apply(from_right, vn, an);
      s_carry_v = vn;
      s_carry_a = an;
    }
  }
  __syncthreads();

  // The carry entering this thread's tokens, then the recurrence over them. Results go back to
  // shared memory (each thread touches only its own tokens) for coalesced stores.
  acc_t vn = s_carry_v, an = s_carry_a;
  gae_apply(gae_compose(exclusive, s_right_of_warp[warp]), vn, an);
  acc_t gl = tail_gamma_lam;
#pragma unroll
  for (int k = kItems - 1; k >= 0; --k) {
    const int i = slot(first + k);
    if (end_bits & (1u << k)) {
      vn = bootstrap_of(item_sequence[k]);
      an = acc_t(0);
      gl = gamma_lam_of(item_sequence[k]);
    }
    const bool action = s_action[i] != 0;
    const acc_t value = s_value[i];
    const acc_t a = gae_step<acc_t>(s_reward[i], value, action, gamma, gl, vn, an);
    s_reward[i] = a;
    s_value[i] = action ? a + value : acc_t(0);
  }
  __syncthreads();
  for (int j = tid; j < kTile; j += kThreads) {
    const int64_t t = base + j;
    const int i = slot(j);
    if (t < num_tokens) {
      advantages[t] = static_cast<out_t>(s_reward[i]);
      returns[t] = static_cast<out_t>(s_value[i]);
    }
  }
}

}  // namespace

void gae_cuda_kernel(const at::Tensor& rewards, const at::Tensor& values,
                     const at::Tensor& cu_seqlens, const at::Tensor& action_mask,
                     const at::Tensor& bootstrap_values, double gamma, double lam,
                     const at::Tensor& sequence_lam, at::Tensor& advantages,
                     at::Tensor& returns) {
  const c10::cuda::CUDAGuard guard(rewards.device());
  const int64_t num_tokens = rewards.size(0);
  const int64_t num_sequences = cu_seqlens.size(0) - 1;
  const int64_t num_tiles = (num_tokens + kTile - 1) / kTile;
  if (num_tiles == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // Flags and the ticket counter must start at zero; the tile states need no initialization.
  at::Tensor flags = at::zeros({num_tiles + 1}, rewards.options().dtype(at::kInt));
  const bool* mask = action_mask.defined() ? action_mask.data_ptr<bool>() : nullptr;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rewards.scalar_type(), "gae_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    using out_t = acc_t;
    at::Tensor states = at::empty({2 * num_tiles * static_cast<int64_t>(sizeof(GaeMap<acc_t>))},
                                  rewards.options().dtype(at::kByte));
    auto* aggregate = reinterpret_cast<GaeMap<acc_t>*>(states.data_ptr());
    const acc_t* boot =
        bootstrap_values.defined() ? bootstrap_values.data_ptr<acc_t>() : nullptr;
    const acc_t* seq_lam = sequence_lam.defined() ? sequence_lam.data_ptr<acc_t>() : nullptr;
    gae_scan_kernel<scalar_t, acc_t, out_t><<<num_tiles, kThreads, 0, stream>>>(
        rewards.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(), mask, boot, seq_lam,
        cu_seqlens.data_ptr<int32_t>(), num_sequences, num_tokens, static_cast<acc_t>(gamma),
        static_cast<acc_t>(gamma * lam), advantages.data_ptr<out_t>(),
        returns.data_ptr<out_t>(), aggregate, aggregate + num_tiles, flags.data_ptr<int>(),
        reinterpret_cast<unsigned int*>(flags.data_ptr<int>() + num_tiles), num_tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace agentrl_fast
