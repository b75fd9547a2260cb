// Arithmetic shared by the CPU (gae.cpp) and CUDA (gae.cu) GAE kernels.
//
// GAE over one sequence is a backward recurrence over its action tokens. We write the state
// carried from the right as (vn, an): the value and the advantage of the next action token.
// Processing token t maps the carry to a new carry:
//   action token:     vn' = v_t,  an' = (r_t - v_t) + gamma * vn + gamma * lam * an
//   non-action token: vn' = vn,   an' = an                  (observation spans are bridged)
// and the advantage of an action token is the `an'` it produces. Every such map, and every
// composition of them, has the form
//   vn' = s * vn + V
//   an' = C + P * vn + Q * an
// (s is 0 or 1), so the recurrence is a scan over 5-number affine maps. A sequence's bootstrap
// enters as a constant map (s = P = Q = 0) composed right of its last token; that makes the scan
// over a whole packed batch unsegmented: nothing crosses a constant map.
#pragma once

#if defined(__CUDACC__)
#define AGENTRL_HD __host__ __device__ __forceinline__
#else
#define AGENTRL_HD inline
#endif

namespace agentrl_fast {

template <typename acc_t>
struct GaeMap {
  acc_t s, V, C, P, Q;
};

template <typename acc_t>
AGENTRL_HD GaeMap<acc_t> gae_identity_map() {
  return {acc_t(1), acc_t(0), acc_t(0), acc_t(0), acc_t(1)};
}

// The map of one token. gamma_lam = gamma * lam.
template <typename acc_t>
AGENTRL_HD GaeMap<acc_t> gae_token_map(acc_t reward, acc_t value, bool is_action, acc_t gamma,
                                       acc_t gamma_lam) {
  if (!is_action) return gae_identity_map<acc_t>();
  return {acc_t(0), value, reward - value, gamma, gamma_lam};
}

// The map that feeds a sequence's bootstrap value: (vn, an) := (bootstrap, 0).
template <typename acc_t>
AGENTRL_HD GaeMap<acc_t> gae_bootstrap_map(acc_t bootstrap) {
  return {acc_t(0), bootstrap, acc_t(0), acc_t(0), acc_t(0)};
}

// left ∘ right: apply `right` (later tokens) first, then `left` (earlier tokens).
template <typename acc_t>
AGENTRL_HD GaeMap<acc_t> gae_compose(const GaeMap<acc_t>& left, const GaeMap<acc_t>& right) {
  GaeMap<acc_t> out;
  out.s = left.s * right.s;
  out.V = left.s * right.V + left.V;
  out.C = left.C + left.P * right.V + left.Q * right.C;
  out.P = left.P * right.s + left.Q * right.P;
  out.Q = left.Q * right.Q;
  return out;
}

// True when the map ignores its input (it contains a sequence end): a scan can stop there.
template <typename acc_t>
AGENTRL_HD bool gae_map_is_constant(const GaeMap<acc_t>& m) {
  return m.s == acc_t(0) && m.P == acc_t(0) && m.Q == acc_t(0);
}

// One backward step of the recurrence on the carry (vn, an). Returns the token's advantage
// (meaningful on action tokens only) and updates the carry in place.
// Branch-free (selects, not jumps): action masks mix short runs that defeat branch prediction.
template <typename acc_t>
AGENTRL_HD acc_t gae_step(acc_t reward, acc_t value, bool is_action, acc_t gamma, acc_t gamma_lam,
                          acc_t& vn, acc_t& an) {
  const acc_t candidate = (reward - value) + gamma * vn + gamma_lam * an;
  vn = is_action ? value : vn;
  an = is_action ? candidate : an;
  return is_action ? candidate : acc_t(0);
}

// Apply a map to a carry.
template <typename acc_t>
AGENTRL_HD void gae_apply(const GaeMap<acc_t>& m, acc_t& vn, acc_t& an) {
  const acc_t new_vn = m.s * vn + m.V;
  const acc_t new_an = m.C + m.P * vn + m.Q * an;
  vn = new_vn;
  an = new_an;
}

// Clamp a cu_seqlens entry into [lo, hi] so that unvalidated input never indexes out of bounds.
template <typename index_t>
AGENTRL_HD index_t clamp_index(index_t x, index_t lo, index_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

}  // namespace agentrl_fast
