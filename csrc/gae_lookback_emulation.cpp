// A host emulation of the CUDA GAE kernel's tile scan, for the tests (no GPU needed): tiles are
// taken right to left by an atomic ticket from up to 8 real threads (each holding several in
// flight, as an SM holds several blocks), with random delays between a tile's steps, and
// exchange their carries through gae_lookback.h, the code the kernel runs,
// with a Warp whose 32 lanes are a loop in one thread (each warp primitive does what the GPU's
// does, the lane tree of compose_first included). A look-back that waits past the deadline
// raises instead of hanging. tests/test_gae_lookback.py checks it against the CPU kernel.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gae.h"
#include "gae_lookback.h"

namespace agentrl_fast {
namespace {

using Clock = std::chrono::steady_clock;

struct Aborted {};  // another thread failed: stop quietly

// What one tile's look-back did, to show the emulation exercised the look-back.
struct LookBackStats {
  int64_t windows = 0;        // windows of 32 tiles composed
  int64_t lanes = 0;          // the most lanes composed in one window
  int64_t waits = 0;          // polls that found a needed tile not ready
};

// gae_lookback.h's Warp on the host: the 32 lanes are a loop in the calling thread.
struct HostWarp {
  Clock::time_point deadline;
  const std::atomic<bool>* abort;
  mutable LookBackStats stats;

  template <class T>
  using Lanes = std::array<T, kLookBackLanes>;

  template <class F>
  auto each(F f) const -> Lanes<decltype(f(0))> {
    Lanes<decltype(f(0))> out;
    for (int lane = 0; lane < kLookBackLanes; ++lane) out[lane] = f(lane);
    return out;
  }
  unsigned ballot(const Lanes<bool>& p) const {
    unsigned bits = 0;
    for (int lane = 0; lane < kLookBackLanes; ++lane) bits |= unsigned(p[lane]) << lane;
    return bits;
  }
  int first_lane(unsigned bits) const { return __builtin_ctz(bits); }
  template <typename acc_t>
  GaeMap<acc_t> compose_first(const Lanes<GaeMap<acc_t>>& maps, int count) const {
    // The GPU's shuffle tree: at each offset every lane composes with the lane `offset` right.
    Lanes<GaeMap<acc_t>> m;
    for (int lane = 0; lane < kLookBackLanes; ++lane)
      m[lane] = lane < count ? maps[lane] : gae_identity_map<acc_t>();
    for (int offset = 1; offset < kLookBackLanes; offset <<= 1) {
      const Lanes<GaeMap<acc_t>> right = m;
      for (int lane = 0; lane + offset < kLookBackLanes; ++lane)
        m[lane] = gae_compose(right[lane], right[lane + offset]);
    }
    ++stats.windows;
    stats.lanes = std::max<int64_t>(stats.lanes, count);
    return m[0];
  }
  bool leader() const { return true; }
  int load_flag(const int* p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  void store_flag(int* p, int v) const { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  template <typename acc_t>
  GaeMap<acc_t> load_state(const GaeMap<acc_t>* p) const { return *p; }
  template <typename acc_t>
  void store_state(GaeMap<acc_t>* p, const GaeMap<acc_t>& m) const { *p = m; }
  void pause() const {
    ++stats.waits;
    if (abort->load(std::memory_order_relaxed)) throw Aborted{};
    if (Clock::now() > deadline)
      throw std::runtime_error("the look-back passed its deadline waiting for a tile to publish");
    std::this_thread::yield();
  }
};

template <typename acc_t>
struct Problem {
  const acc_t *rewards, *values, *bootstrap;  // bootstrap may be null (zeros)
  const bool* mask;                           // may be null (all action)
  std::vector<int64_t> ends;                  // per token: the sequence it ends, or -1
  std::vector<char> inside;                   // per token: inside some sequence
  int64_t num_tokens, tile_size, num_tiles;
  acc_t gamma, gamma_lam;
  acc_t *advantages, *returns;

  acc_t boot(int64_t b) const { return bootstrap == nullptr ? acc_t(0) : bootstrap[b]; }
  bool action(int64_t t) const { return inside[t] && (mask == nullptr || mask[t]); }

  // The map of tile `tile`'s tokens, composed right to left (as one GPU block does).
  GaeMap<acc_t> aggregate(int64_t tile) const {
    GaeMap<acc_t> out = gae_identity_map<acc_t>();
    const int64_t base = tile * tile_size, end = std::min(base + tile_size, num_tokens);
    for (int64_t t = end - 1; t >= base; --t) {
      GaeMap<acc_t> m = gae_token_map<acc_t>(rewards[t], values[t], action(t), gamma, gamma_lam);
      if (ends[t] >= 0) m = gae_compose(m, gae_bootstrap_map<acc_t>(boot(ends[t])));
      out = gae_compose(m, out);
    }
    return out;
  }

  // The recurrence over the tile's tokens from the carry entering it from the right.
  void finish(int64_t tile, const GaeMap<acc_t>& from_right) const {
    acc_t vn = acc_t(0), an = acc_t(0);
    gae_apply(from_right, vn, an);
    const int64_t base = tile * tile_size, end = std::min(base + tile_size, num_tokens);
    for (int64_t t = end - 1; t >= base; --t) {
      if (ends[t] >= 0) {
        vn = boot(ends[t]);
        an = acc_t(0);
      }
      const bool is_action = action(t);
      const acc_t a = gae_step<acc_t>(rewards[t], values[t], is_action, gamma, gamma_lam, vn, an);
      advantages[t] = a;
      returns[t] = is_action ? a + values[t] : acc_t(0);
    }
  }
};

struct Run {
  int threads, tiles_per_thread;
  int64_t max_delay_us, drop_tile;
  uint64_t seed;
  double deadline_seconds;
};

// Sleeps 0..max_delay_us, and one time in 32 sixteen times as long (so that chains of tiles
// with only their aggregate published form and the look-back spans several windows).
void random_delay(std::mt19937_64& rng, int64_t max_delay_us) {
  if (max_delay_us <= 0) return;
  int64_t us = static_cast<int64_t>(rng() % static_cast<uint64_t>(max_delay_us + 1));
  if (rng() % 32 == 0) us *= 16;
  std::this_thread::sleep_for(std::chrono::microseconds(us));
}

template <typename acc_t>
std::array<int64_t, 4> emulate(const Problem<acc_t>& problem, const Run& run) {
  const int64_t num_tiles = problem.num_tiles;
  std::vector<GaeMap<acc_t>> aggregate(num_tiles), inclusive(num_tiles);
  std::vector<int> flag(num_tiles, kNotReady);
  const GaeTileStates<acc_t> states{aggregate.data(), inclusive.data(), flag.data()};
  std::atomic<int64_t> ticket{0};
  std::atomic<bool> abort{false};
  std::mutex lock;
  std::string error;
  std::array<int64_t, 4> totals{0, 0, 0, 0};  // multi-lane look-backs, windows, lanes, waits
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(run.deadline_seconds));

  auto worker = [&](int index) {
    std::mt19937_64 rng(run.seed * 1000003u + static_cast<uint64_t>(index));
    std::array<int64_t, 4> mine{0, 0, 0, 0};
    try {
      for (;;) {
        if (abort.load(std::memory_order_relaxed)) break;
        // Take up to tiles_per_thread tiles (as a GPU holds several blocks per SM) and publish
        // their aggregates, then finish them in a random order (a tile finished before those
        // right of it looks back over a long run of aggregates). Publishing an aggregate never
        // waits, and a look-back needs only the aggregates right of it, so every look-back ends.
        std::vector<std::pair<int64_t, GaeMap<acc_t>>> held;
        while (static_cast<int>(held.size()) < run.tiles_per_thread) {
          const int64_t k = ticket.fetch_add(1);
          if (k >= num_tiles) break;
          const int64_t tile = num_tiles - 1 - k;
          held.emplace_back(tile, problem.aggregate(tile));
          random_delay(rng, run.max_delay_us);
          if (tile != run.drop_tile)  // a tile that never publishes (the deadline test)
            gae_publish_aggregate(HostWarp{deadline, &abort, {}}, states, tile, num_tiles,
                                  held.back().second);
        }
        if (held.empty()) break;
        std::shuffle(held.begin(), held.end(), rng);
        for (const auto& [tile, own] : held) {
          if (tile == run.drop_tile) continue;
          random_delay(rng, run.max_delay_us);
          HostWarp warp{deadline, &abort, {}};
          const GaeMap<acc_t> from_right =
              gae_publish_inclusive(warp, states, tile, num_tiles, [&] { return own; });
          mine[0] += warp.stats.lanes > 1;
          mine[1] = std::max(mine[1], warp.stats.windows);
          mine[2] = std::max(mine[2], warp.stats.lanes);
          mine[3] += warp.stats.waits;
          problem.finish(tile, from_right);
        }
      }
    } catch (const Aborted&) {
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> guard(lock);
      if (error.empty()) error = e.what();
      abort.store(true);
    }
    std::lock_guard<std::mutex> guard(lock);
    totals[0] += mine[0];
    totals[1] = std::max(totals[1], mine[1]);
    totals[2] = std::max(totals[2], mine[2]);
    totals[3] += mine[3];
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < run.threads; ++i) pool.emplace_back(worker, i);
  for (auto& thread : pool) thread.join();
  TORCH_CHECK(error.empty(), "gae look-back emulation: ", error);
  return totals;
}

template <typename acc_t>
Problem<acc_t> make_problem(const at::Tensor& rewards, const at::Tensor& values,
                            const at::Tensor& cu_seqlens, const at::Tensor& mask,
                            const at::Tensor& bootstrap, double gamma, double lam,
                            int64_t tile_size, at::Tensor& advantages, at::Tensor& returns) {
  const int64_t T = rewards.size(0), B = cu_seqlens.size(0) - 1;
  Problem<acc_t> p{rewards.data_ptr<acc_t>(), values.data_ptr<acc_t>(),
                   bootstrap.defined() ? bootstrap.data_ptr<acc_t>() : nullptr,
                   mask.defined() ? mask.data_ptr<bool>() : nullptr,
                   std::vector<int64_t>(T, -1), std::vector<char>(T, 0), T, tile_size,
                   (T + tile_size - 1) / tile_size, static_cast<acc_t>(gamma),
                   static_cast<acc_t>(gamma * lam), advantages.data_ptr<acc_t>(),
                   returns.data_ptr<acc_t>()};
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) p.inside[t] = 1;
    if (cu[b + 1] > cu[b]) p.ends[cu[b + 1] - 1] = b;
  }
  return p;
}

void check_args(const at::Tensor& rewards, const at::Tensor& values,
                const at::Tensor& cu_seqlens, const at::Tensor& mask,
                const at::Tensor& bootstrap, int64_t tile_size, int64_t threads) {
  TORCH_CHECK_VALUE(rewards.dtype() == at::kFloat || rewards.dtype() == at::kDouble,
                    "rewards must be float32 or float64, got ", rewards.dtype());
  TORCH_CHECK_VALUE(values.dtype() == rewards.dtype() && values.sizes() == rewards.sizes(),
                    "values must have rewards' dtype and shape");
  TORCH_CHECK_VALUE(rewards.dim() == 1 && rewards.is_contiguous() && values.is_contiguous(),
                    "rewards and values must be contiguous 1-D [T]");
  TORCH_CHECK_VALUE(cu_seqlens.dtype() == at::kInt && cu_seqlens.dim() == 1 &&
                        cu_seqlens.size(0) >= 1 && cu_seqlens.is_contiguous(),
                    "cu_seqlens must be contiguous int32 [B + 1]");
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  for (int64_t b = 0; b + 1 < cu_seqlens.size(0); ++b)
    TORCH_CHECK_VALUE(cu[b] <= cu[b + 1], "cu_seqlens must be non-decreasing");
  TORCH_CHECK_VALUE(cu[0] >= 0 && cu[cu_seqlens.size(0) - 1] <= rewards.size(0),
                    "cu_seqlens must lie within [0, T]");
  TORCH_CHECK_VALUE(!mask.defined() || (mask.dtype() == at::kBool && mask.is_contiguous() &&
                                        mask.sizes() == rewards.sizes()),
                    "action_mask must be contiguous bool [T]");
  TORCH_CHECK_VALUE(!bootstrap.defined() ||
                        (bootstrap.dtype() == rewards.dtype() && bootstrap.is_contiguous() &&
                         bootstrap.dim() == 1 && bootstrap.size(0) == cu_seqlens.size(0) - 1),
                    "bootstrap_values must be contiguous [B] in rewards' dtype");
  TORCH_CHECK_VALUE(tile_size >= 1, "tile_size must be >= 1, got ", tile_size);
  TORCH_CHECK_VALUE(threads >= 1 && threads <= 8, "threads must be in [1, 8], got ", threads);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> gae_lookback_emulation(
    const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& cu_seqlens,
    const std::optional<at::Tensor>& action_mask,
    const std::optional<at::Tensor>& bootstrap_values, double gamma, double lam,
    int64_t tile_size, int64_t threads, int64_t tiles_per_thread, int64_t max_delay_us,
    int64_t seed, double deadline_seconds, int64_t drop_tile) {
  const at::Tensor mask = action_mask.has_value() ? *action_mask : at::Tensor();
  const at::Tensor boot = bootstrap_values.has_value() ? *bootstrap_values : at::Tensor();
  check_args(rewards, values, cu_seqlens, mask, boot, tile_size, threads);
  at::Tensor advantages = at::empty_like(rewards), returns = at::empty_like(rewards);
  TORCH_CHECK_VALUE(tiles_per_thread >= 1 && tiles_per_thread <= 64,
                    "tiles_per_thread must be in [1, 64], got ", tiles_per_thread);
  const Run run{static_cast<int>(threads), static_cast<int>(tiles_per_thread), max_delay_us,
                drop_tile, static_cast<uint64_t>(seed), deadline_seconds};
  std::array<int64_t, 4> stats{};
  AT_DISPATCH_FLOATING_TYPES(rewards.scalar_type(), "gae_lookback_emulation", [&] {
    const auto problem = make_problem<scalar_t>(rewards, values, cu_seqlens, mask, boot, gamma,
                                                lam, tile_size, advantages, returns);
    stats = emulate(problem, run);
  });
  return {advantages, returns, at::tensor(std::vector<int64_t>(stats.begin(), stats.end()))};
}

}  // namespace agentrl_fast
