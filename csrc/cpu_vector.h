// Portable 8-float vectors (GCC/Clang vector extensions) shared by the CPU kernels: loads,
// stores, broadcasts and a vectorised exp. Code using them compiles to AVX2 inside functions
// marked AGENTRL_FAST_AVX2 and to the baseline instruction set elsewhere.
#pragma once

#include <cstdint>
#include <cstring>

namespace agentrl_fast {
namespace cpu_vector {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define AGENTRL_FAST_X86 1
#define AGENTRL_FAST_AVX2 __attribute__((target("avx2,fma")))
#else
#define AGENTRL_FAST_X86 0
#define AGENTRL_FAST_AVX2
#endif
#define AGENTRL_FAST_INLINE inline __attribute__((always_inline))

constexpr int64_t kWidth = 8;  // floats per vector
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));

AGENTRL_FAST_INLINE vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
AGENTRL_FAST_INLINE void store(float* p, vf x) { std::memcpy(p, &x, sizeof x); }
AGENTRL_FAST_INLINE vf splat(float a) { return vf{} + a; }  // compiles to a broadcast

// exp(x) for float32 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n from the
// exponent bits; within 2 ulp of expf on [-87.3, 88.3], clamped outside it).
AGENTRL_FAST_INLINE vf vector_exp(vf x) {
  const vf lo = splat(-87.33f), hi = splat(88.37f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: adding and removing it rounds to integers
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf y = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * (vf)bits;  // a same-size vector cast reinterprets the bits
}

}  // namespace cpu_vector
}  // namespace agentrl_fast
