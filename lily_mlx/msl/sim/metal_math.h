// Metal-compatibility prelude, part 2: metal:: math (also metal::fast:: and metal::precise::),
// numeric limits, MLX utils.h helpers. Scalars of 16-bit types compute in float and round back.
#pragma once
#include <cfloat>
#include <limits>
#include "metal_types.h"

#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define HUGE_VALF (__builtin_huge_valf())
#define MAXFLOAT FLT_MAX
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_E_F 2.71828182845904523536f
#define M_LN2_F 0.693147180559945309417f
#define M_LOG2E_F 1.44269504088896340736f
#define M_SQRT2_F 1.41421356237309504880f
#define METAL_FUNC inline
#define METAL_CONST constexpr

namespace metal {
namespace msl_math_detail {
template <class T> using math_t = std::conditional_t<msl_rt::is_floating_v<T>, std::remove_cv_t<T>, float>;
}

#define LILY_UNARY(NAME, EXPR)                                                                       \
  template <class T, std::enable_if_t<msl_rt::is_scalar_v<T>, int> = 0>                              \
  inline msl_math_detail::math_t<T> NAME(T x_) {                                                     \
    float x = (float)x_;                                                                             \
    return msl_math_detail::math_t<T>(EXPR);                                                          \
  }                                                                                                  \
  template <class T, int N, bool P>                                                                  \
  inline vec<msl_math_detail::math_t<T>, N> NAME(const vec<T, N, P>& v) {                           \
    vec<msl_math_detail::math_t<T>, N> r;                                                            \
    for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);                                                   \
    return r;                                                                                        \
  }

LILY_UNARY(exp, __builtin_expf(x))
LILY_UNARY(exp2, __builtin_exp2f(x))
LILY_UNARY(exp10, __builtin_powf(10.0f, x))
LILY_UNARY(log, __builtin_logf(x))
LILY_UNARY(log2, __builtin_log2f(x))
LILY_UNARY(log10, __builtin_log10f(x))
LILY_UNARY(sqrt, __builtin_sqrtf(x))
LILY_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
LILY_UNARY(sin, __builtin_sinf(x))
LILY_UNARY(cos, __builtin_cosf(x))
LILY_UNARY(tan, __builtin_tanf(x))
LILY_UNARY(asin, __builtin_asinf(x))
LILY_UNARY(acos, __builtin_acosf(x))
LILY_UNARY(atan, __builtin_atanf(x))
LILY_UNARY(sinh, __builtin_sinhf(x))
LILY_UNARY(cosh, __builtin_coshf(x))
LILY_UNARY(tanh, __builtin_tanhf(x))
LILY_UNARY(asinh, __builtin_asinhf(x))
LILY_UNARY(acosh, __builtin_acoshf(x))
LILY_UNARY(atanh, __builtin_atanhf(x))
LILY_UNARY(fabs, __builtin_fabsf(x))
LILY_UNARY(floor, __builtin_floorf(x))
LILY_UNARY(ceil, __builtin_ceilf(x))
LILY_UNARY(round, __builtin_roundf(x))
LILY_UNARY(rint, __builtin_rintf(x))
LILY_UNARY(trunc, __builtin_truncf(x))
LILY_UNARY(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
LILY_UNARY(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x != x ? 0.0f : x))))
LILY_UNARY(log1p, __builtin_log1pf(x))
LILY_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))

template <class T, std::enable_if_t<msl_rt::is_scalar_v<T>, int> = 0> inline bool isnan(T x) { return __builtin_isnan((float)x); }
template <class T, std::enable_if_t<msl_rt::is_scalar_v<T>, int> = 0> inline bool isinf(T x) { return __builtin_isinf((float)x); }
template <class T, std::enable_if_t<msl_rt::is_scalar_v<T>, int> = 0> inline bool isfinite(T x) { return __builtin_isfinite((float)x); }
template <class T, std::enable_if_t<msl_rt::is_scalar_v<T>, int> = 0> inline bool signbit(T x) { return __builtin_signbit((float)x); }

// abs: integers stay integers.
template <class T, std::enable_if_t<msl_rt::is_scalar_v<T>, int> = 0> inline T abs(T x) {
  if constexpr (std::is_integral_v<T>) return x < 0 ? T(-x) : x;
  else return T(__builtin_fabsf((float)x));
}
template <class T, int N, bool P> inline vec<T, N> abs(const vec<T, N, P>& v) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = abs(v[i]); return r;
}

#define LILY_BINARY(NAME, EXPR_F, EXPR_I)                                                              \
  template <class A, class B, std::enable_if_t<msl_rt::is_scalar_v<A> && msl_rt::is_scalar_v<B>, int> = 0> \
  inline msl_rt::promote_t<A, B> NAME(A a_, B b_) {                                                    \
    using R = msl_rt::promote_t<A, B>;                                                                 \
    if constexpr (msl_rt::is_floating_v<R>) { float a = (float)a_, b = (float)b_; return R(EXPR_F); }  \
    else { R a = R(a_), b = R(b_); return R(EXPR_I); }                                                 \
  }                                                                                                    \
  template <class A, class B, std::enable_if_t<msl_rt::is_vec_v<A> || msl_rt::is_vec_v<B>, int> = 0>  \
  inline auto NAME(const A& a, const B& b) {                                                           \
    using E = msl_rt::vop_elem_t<A, B>;                                                                \
    constexpr int N = msl_rt::vec_n<A, B>();                                                           \
    vec<E, N> r;                                                                                       \
    for (int i = 0; i < N; ++i) r[i] = NAME(E(msl_rt::vget(a, i)), E(msl_rt::vget(b, i)));             \
    return r;                                                                                          \
  }

LILY_BINARY(max, __builtin_fmaxf(a, b), (a > b ? a : b))
LILY_BINARY(min, __builtin_fminf(a, b), (a < b ? a : b))
LILY_BINARY(fmax, __builtin_fmaxf(a, b), (a > b ? a : b))
LILY_BINARY(fmin, __builtin_fminf(a, b), (a < b ? a : b))
LILY_BINARY(pow, __builtin_powf(a, b), a)
LILY_BINARY(powr, __builtin_powf(a, b), a)
LILY_BINARY(fmod, __builtin_fmodf(a, b), a % b)
LILY_BINARY(atan2, __builtin_atan2f(a, b), a)
LILY_BINARY(copysign, __builtin_copysignf(a, b), a)
LILY_BINARY(step, (b < a ? 0.0f : 1.0f), (b < a ? 0 : 1))
LILY_BINARY(fdim, __builtin_fdimf(a, b), (a > b ? a - b : 0))

template <class A, class B, class C, std::enable_if_t<msl_rt::is_scalar_v<A>, int> = 0>
inline msl_rt::promote_t<A, msl_rt::promote_t<B, C>> fma(A a, B b, C c) {
  using R = msl_rt::promote_t<A, msl_rt::promote_t<B, C>>;
  return R(__builtin_fmaf((float)a, (float)b, (float)c));
}
template <class T, int N, bool P, class B, class C> inline vec<T, N> fma(const vec<T, N, P>& a, const B& b, const C& c) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = fma(a[i], T(msl_rt::vget(b, i)), T(msl_rt::vget(c, i))); return r;
}
template <class T, class L, class H, std::enable_if_t<msl_rt::is_scalar_v<T>, int> = 0>
inline T clamp(T x, L lo, H hi) { return T(min(max(x, T(lo)), T(hi))); }
template <class T, int N, bool P, class L, class H> inline vec<T, N> clamp(const vec<T, N, P>& x, const L& lo, const H& hi) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = clamp(x[i], T(msl_rt::vget(lo, i)), T(msl_rt::vget(hi, i))); return r;
}
template <class T, class U, class W> inline auto mix(const T& x, const U& y, const W& a) { return x + (y - x) * a; }
// select(a, b, c) = c ? b : a (component-wise for vectors).
template <class T, std::enable_if_t<!msl_rt::is_vec_v<T>, int> = 0> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N, bool P, class C> inline vec<T, N> select(const vec<T, N, P>& a, const vec<T, N, P>& b, const C& c) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = msl_rt::vget(c, i) ? b[i] : a[i]; return r;
}
template <class T, int N, bool P, class U, int M, bool Q> inline auto dot(const vec<T, N, P>& a, const vec<U, M, Q>& b) {
  static_assert(N == M, "dot: vector lengths differ");
  using R = msl_math_detail::math_t<T>;
  float s = 0.0f; for (int i = 0; i < N; ++i) s += (float)a[i] * (float)b[i]; return R(s);
}
template <class T, int N, bool P> inline auto length(const vec<T, N, P>& a) { return msl_math_detail::math_t<T>(__builtin_sqrtf((float)dot(a, a))); }
template <class T, int N, bool P> inline vec<T, N> normalize(const vec<T, N, P>& a) { return a * (1.0f / (float)length(a)); }
template <class T, int N, bool P> inline auto distance(const vec<T, N, P>& a, const vec<T, N, P>& b) { return length(a - b); }

// Integer bit functions.
template <class T> inline T popcount(T x) { return T(__builtin_popcountll((unsigned long long)(std::make_unsigned_t<T>)x)); }
template <class T> inline T clz(T x) {
  using U = std::make_unsigned_t<T>; U u = (U)x;
  return u == 0 ? T(sizeof(T) * 8) : T(__builtin_clzll((unsigned long long)u) - (64 - sizeof(T) * 8));
}
template <class T> inline T ctz(T x) { return x == 0 ? T(sizeof(T) * 8) : T(__builtin_ctzll((unsigned long long)(std::make_unsigned_t<T>)x)); }
template <class T> inline T mulhi(T a, T b) {
  if constexpr (sizeof(T) == 4) return T(((int64_t)(std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>)a * (std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>)b) >> 32);
  else return T(((__int128)a * (__int128)b) >> (sizeof(T) * 8));
}
template <class T> inline T extract_bits(T x, uint offset, uint bits) {
  using U = std::make_unsigned_t<T>;
  if (bits == 0) return T(0);
  U v = ((U)x >> offset) & (bits >= sizeof(T) * 8 ? ~U(0) : ((U(1) << bits) - 1));
  if constexpr (std::is_signed_v<T>) { if (bits < sizeof(T) * 8 && (v >> (bits - 1)) & 1) v |= ~((U(1) << bits) - 1); }
  return T(v);
}

// numeric_limits, with 16-bit float specialisations.
template <class T> struct numeric_limits : std::numeric_limits<T> {};
#define LILY_F16_LIMITS(T, MAXB, MINB, LOWB, EPSB)                                     \
  template <> struct numeric_limits<T> {                                              \
    static constexpr bool is_specialized = true;                                      \
    static constexpr T max() { return T(msl_rt::bits_tag{}, MAXB); }                  \
    static constexpr T min() { return T(msl_rt::bits_tag{}, MINB); }                  \
    static constexpr T lowest() { return T(msl_rt::bits_tag{}, LOWB); }               \
    static constexpr T epsilon() { return T(msl_rt::bits_tag{}, EPSB); }              \
    static constexpr T infinity() { return T(msl_rt::bits_tag{}, (uint16_t)(MINB == 0x0400 ? 0x7c00 : 0x7f80)); } \
    static constexpr T quiet_NaN() { return T(msl_rt::bits_tag{}, (uint16_t)(MINB == 0x0400 ? 0x7e00 : 0x7fc0)); } \
  };
LILY_F16_LIMITS(half, 0x7bff, 0x0400, 0xfbff, 0x1400)
LILY_F16_LIMITS(bfloat, 0x7f7f, 0x0080, 0xff7f, 0x3c00)

// metal::fast:: and metal::precise:: name the same functions (host float math for both).
namespace fast { using namespace ::metal; }
namespace precise { using namespace ::metal; }
}  // namespace metal
namespace metal {
template <class A, class B> inline auto divide(A a, B b) { return a / b; }
}  // namespace metal

// MLX's utils.h helpers that kernels use.
template <class U> struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
#define LILY_FLOAT_LIMITS(T)                                                  \
  template <> struct Limits<T> {                                              \
    static inline const T max = metal::numeric_limits<T>::infinity();         \
    static inline const T min = T(-float(metal::numeric_limits<T>::infinity())); \
    static inline const T finite_max = metal::numeric_limits<T>::max();       \
    static inline const T finite_min = metal::numeric_limits<T>::lowest();    \
  };
LILY_FLOAT_LIMITS(float)
LILY_FLOAT_LIMITS(half)
LILY_FLOAT_LIMITS(bfloat)
template <> struct Limits<bool> { static constexpr bool max = true; static constexpr bool min = false; };

inline size_t ceildiv(size_t n, size_t m) { return (n + m - 1) / m; }
