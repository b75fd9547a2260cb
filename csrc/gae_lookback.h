// The carry exchange between GAE tiles (decoupled look-back, as in CUB's single-pass scan), one
// warp wide: the code the CUDA kernel runs (gae.cu, with a Warp of 32 GPU lanes) and the code
// the host emulation runs (gae_lookback_emulation.cpp, with a Warp whose 32 lanes are a loop in
// one thread, and tiles run by real threads in random order with random delays), so the test of
// the emulation tests this very code.
//
// A Warp provides:
//   template <class T> Lanes       one T per lane (the GPU: this lane's; the host: 32 of them)
//   each(f) -> Lanes<T>            f(lane) for every lane
//   ballot(Lanes<bool>) -> bits    bit l set where lane l's value is true
//   first_lane(bits) -> int        the lowest set bit (bits != 0)
//   compose_first(Lanes<GaeMap>, n) -> GaeMap   lane 0's map ∘ ... ∘ lane n-1's, on every lane
//   leader() -> bool               the lane that publishes (lane 0)
//   load_flag(p) / store_flag(p, v)   acquire load / release store of a tile's flag
//   load_state(p) / store_state(p, m) a tile's published map (ordered by the flag)
//   pause()                        between two polls of flags not yet set (may throw: deadline)
#pragma once

#include <cstdint>

#include "gae_common.h"

namespace agentrl_fast {

enum GaeTileFlag : int { kNotReady = 0, kAggregateReady = 1, kInclusiveReady = 2 };

constexpr int kLookBackLanes = 32;

// Per tile: the map of its own tokens (aggregate) and the map of its tokens and everything right
// of it (inclusive), each valid once the tile's flag says so.
template <typename acc_t>
struct GaeTileStates {
  GaeMap<acc_t>* aggregate;
  GaeMap<acc_t>* inclusive;
  int* flag;
};

// The map of every token right of `tile` (up to the first tile whose inclusive map is known, or
// the first point where the composition becomes constant). The warp watches 32 tiles at a time:
// lane l polls tile window + l until every lane up to the first inclusive one is ready, then the
// window's maps are composed in order (a tree over the lanes, not a walk).
template <class Warp, typename acc_t>
AGENTRL_HD GaeMap<acc_t> gae_look_back(const Warp& warp, const GaeTileStates<acc_t>& states,
                                       int64_t tile, int64_t num_tiles) {
  GaeMap<acc_t> from_right = gae_identity_map<acc_t>();
  for (int64_t window = tile + 1; window < num_tiles; window += kLookBackLanes) {
    // Tiles past the end count as inclusive identities: nothing is right of them.
    auto flag = warp.each([&](int lane) {
      return window + lane < num_tiles ? int(kNotReady) : int(kInclusiveReady);
    });
    unsigned inclusive;
    for (;;) {
      flag = warp.each([&](int lane) {
        const int64_t j = window + lane;
        return flag[lane] == kNotReady ? warp.load_flag(states.flag + j) : flag[lane];
      });
      inclusive = warp.ballot(warp.each([&](int lane) { return flag[lane] == kInclusiveReady; }));
      const unsigned missing =
          warp.ballot(warp.each([&](int lane) { return flag[lane] == kNotReady; }));
      // Lanes 0 .. first inclusive must be ready (all 32 when none is inclusive yet). When the
      // first inclusive lane is 31, 2 * bit wraps to 0 and the mask is all lanes, as wanted.
      const unsigned needed = inclusive ? (inclusive & (0u - inclusive)) * 2u - 1u : ~0u;
      if (!(missing & needed)) break;
      warp.pause();
    }
    const int count = inclusive ? warp.first_lane(inclusive) + 1 : kLookBackLanes;
    const auto maps = warp.each([&](int lane) {
      const int64_t j = window + lane;
      if (lane >= count || j >= num_tiles) return gae_identity_map<acc_t>();
      return warp.load_state(flag[lane] == kInclusiveReady ? states.inclusive + j
                                                           : states.aggregate + j);
    });
    from_right = gae_compose(from_right, warp.compose_first(maps, count));
    if (inclusive || gae_map_is_constant(from_right)) break;
  }
  return from_right;
}

// A tile's part of the scan once its `aggregate` (the map of its own tokens) is known, in two
// steps (the host emulation runs them apart, to hold many tiles in flight per thread):
// publish the aggregate; then find the map of everything right of the tile, publish the
// inclusive map and return the map from the right (the tile's carry is that map applied to
// (0, 0)). A tile whose aggregate is constant (it holds a sequence end), and the last tile,
// publish their inclusive map at once, so tiles to their left stop there; their own tokens
// right of the constant point still need the carry, so every tile but the last looks back.
template <typename acc_t>
AGENTRL_HD bool gae_self_contained(int64_t tile, int64_t num_tiles,
                                   const GaeMap<acc_t>& aggregate) {
  return tile == num_tiles - 1 || gae_map_is_constant(aggregate);
}

template <class Warp, typename acc_t>
AGENTRL_HD void gae_publish_aggregate(const Warp& warp, const GaeTileStates<acc_t>& states,
                                      int64_t tile, int64_t num_tiles,
                                      const GaeMap<acc_t>& aggregate) {
  if (!warp.leader()) return;
  const bool self_contained = gae_self_contained(tile, num_tiles, aggregate);
  warp.store_state((self_contained ? states.inclusive : states.aggregate) + tile, aggregate);
  warp.store_flag(states.flag + tile, self_contained ? kInclusiveReady : kAggregateReady);
}

// `aggregate()` gives the tile's aggregate again after the look-back (on the GPU it is read
// from shared memory: keeping it live across the look-back loop costs registers and spills).
template <class Warp, typename acc_t, class Aggregate>
AGENTRL_HD GaeMap<acc_t> gae_publish_inclusive(const Warp& warp,
                                               const GaeTileStates<acc_t>& states, int64_t tile,
                                               int64_t num_tiles, const Aggregate& aggregate) {
  if (tile == num_tiles - 1) return gae_identity_map<acc_t>();
  const GaeMap<acc_t> from_right = gae_look_back(warp, states, tile, num_tiles);
  if (warp.leader()) {
    const GaeMap<acc_t> own = aggregate();
    if (!gae_self_contained(tile, num_tiles, own)) {
      warp.store_state(states.inclusive + tile, gae_compose(own, from_right));
      warp.store_flag(states.flag + tile, kInclusiveReady);
    }
  }
  return from_right;
}

// Both steps, as one GPU block runs them.
template <class Warp, typename acc_t, class Aggregate>
AGENTRL_HD GaeMap<acc_t> gae_tile_carry(const Warp& warp, const GaeTileStates<acc_t>& states,
                                        int64_t tile, int64_t num_tiles,
                                        const Aggregate& aggregate) {
  gae_publish_aggregate(warp, states, tile, num_tiles, aggregate());
  return gae_publish_inclusive(warp, states, tile, num_tiles, aggregate);
}

}  // namespace agentrl_fast
