// Metal-compatibility prelude, part 1: scalar and vector types, conversions, as_type.
// Compiled as C++20 by the lily_mlx CPU simulator; see docs/simulator.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

namespace msl_rt {
[[noreturn]] void fail(const char* kind, const char* msg);

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// IEEE binary16, round to nearest even (also for subnormals), NaN payload kept quiet.
inline uint16_t float_to_half_bits(float f) {
  uint32_t x = f2u(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u)  // inf / nan
    return (uint16_t)(sign | (x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u));
  if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to inf
  if (x < 0x38800000u) {  // below the smallest normal half: the FPU rounds in float at 2^-24 units
    float a = u2f(x) + 0.5f;
    return (uint16_t)(sign | (f2u(a) - 0x3f000000u));
  }
  uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round half to even
  return (uint16_t)(sign | (x >> 13));
}
inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return u2f(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em >= 0x0400u) return u2f(sign | ((em << 13) + 0x38000000u));
  return u2f(sign | f2u((float)em * 5.9604644775390625e-08f));
}
// bfloat16, round to nearest even.
inline uint16_t float_to_bfloat_bits(float f) {
  uint32_t x = f2u(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}
inline float bfloat_bits_to_float(uint16_t b) { return u2f((uint32_t)b << 16); }

struct bits_tag {};
}  // namespace msl_rt

// 16-bit floats: storage is the IEEE/bfloat bit pattern; every operation computes in float and
// rounds the result back (exact for + - * / of two operands: float has more than 2p+2 bits).
#define LILY_DEFINE_F16(NAME, TO_BITS, TO_FLOAT)                                             \
  struct NAME {                                                                              \
    uint16_t bits;                                                                           \
    NAME() = default;                                                                        \
    constexpr NAME(msl_rt::bits_tag, uint16_t b) : bits(b) {}                                \
    NAME(float f) : bits(TO_BITS(f)) {}                                                      \
    NAME(double f) : bits(TO_BITS((float)f)) {}                                              \
    template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>                     \
    NAME(I i) : bits(TO_BITS((float)i)) {}                                                   \
    /* implicit to floating types; explicit to integers, so `c ? h : 0` is a half (as in Metal) */ \
    template <class U, std::enable_if_t<std::is_floating_point_v<U>, int> = 0>               \
    operator U() const { return U(TO_FLOAT(bits)); }                                         \
    template <class U, std::enable_if_t<std::is_integral_v<U>, int> = 0>                     \
    explicit operator U() const { return U(TO_FLOAT(bits)); }                                \
    NAME operator-() const { return NAME(msl_rt::bits_tag{}, (uint16_t)(bits ^ 0x8000u)); }  \
    NAME operator+() const { return *this; }                                                 \
    NAME& operator++() { return *this = NAME(float(*this) + 1.0f); }                         \
    NAME& operator--() { return *this = NAME(float(*this) - 1.0f); }                         \
    NAME operator++(int) { NAME t = *this; ++*this; return t; }                              \
    NAME operator--(int) { NAME t = *this; --*this; return t; }                              \
  };

LILY_DEFINE_F16(half, msl_rt::float_to_half_bits, msl_rt::half_bits_to_float)
LILY_DEFINE_F16(bfloat, msl_rt::float_to_bfloat_bits, msl_rt::bfloat_bits_to_float)
typedef half float16_t;
typedef bfloat bfloat16_t;

namespace msl_rt {
template <class T> struct is_f16 : std::false_type {};
template <> struct is_f16<half> : std::true_type {};
template <> struct is_f16<bfloat> : std::true_type {};
template <class T> inline constexpr bool is_f16_v = is_f16<std::remove_cv_t<T>>::value;
template <class T> inline constexpr bool is_scalar_v = std::is_arithmetic_v<std::remove_cv_t<T>> || is_f16_v<T>;
template <class T> inline constexpr bool is_floating_v = std::is_floating_point_v<std::remove_cv_t<T>> || is_f16_v<T>;

// Result type of a binary op between Metal scalars: f16 op f16 -> that type; f16 op integer ->
// the f16 type; f16 op float/double -> float/double; half op bfloat -> float.
template <class A, class B, class = void> struct promote { using type = decltype(std::declval<A>() + std::declval<B>()); };
template <class A> struct promote<A, A, std::enable_if_t<is_f16_v<A>>> { using type = A; };
template <class A, class B> struct promote<A, B, std::enable_if_t<is_f16_v<A> && !is_f16_v<B>>> {
  using type = std::conditional_t<std::is_integral_v<B> || std::is_same_v<B, bool>, A, B>;
};
template <class A, class B> struct promote<A, B, std::enable_if_t<!is_f16_v<A> && is_f16_v<B>>> {
  using type = std::conditional_t<std::is_integral_v<A> || std::is_same_v<A, bool>, B, A>;
};
template <class A, class B> struct promote<A, B, std::enable_if_t<is_f16_v<A> && is_f16_v<B> && !std::is_same_v<A, B>>> {
  using type = float;
};
template <class A, class B> using promote_t = typename promote<std::remove_cv_t<A>, std::remove_cv_t<B>>::type;
template <class T> using compute_t = std::conditional_t<is_f16_v<T>, float, T>;
}  // namespace msl_rt

#define LILY_F16_BINOP(OP)                                                                         \
  template <class A, class B,                                                                      \
            std::enable_if_t<(msl_rt::is_f16_v<A> || msl_rt::is_f16_v<B>) && msl_rt::is_scalar_v<A> && \
                                 msl_rt::is_scalar_v<B>, int> = 0>                                 \
  inline msl_rt::promote_t<A, B> operator OP(A a, B b) {                                           \
    using R = msl_rt::promote_t<A, B>;                                                             \
    using C = msl_rt::compute_t<R>;                                                                \
    return R((C)(msl_rt::compute_t<A>)a OP (C)(msl_rt::compute_t<B>)b);                            \
  }
LILY_F16_BINOP(+)
LILY_F16_BINOP(-)
LILY_F16_BINOP(*)
LILY_F16_BINOP(/)
#define LILY_F16_CMP(OP)                                                                           \
  template <class A, class B,                                                                      \
            std::enable_if_t<(msl_rt::is_f16_v<A> || msl_rt::is_f16_v<B>) && msl_rt::is_scalar_v<A> && \
                                 msl_rt::is_scalar_v<B>, int> = 0>                                 \
  inline bool operator OP(A a, B b) {                                                              \
    using C = msl_rt::compute_t<msl_rt::promote_t<A, B>>;                                          \
    return (C)(msl_rt::compute_t<A>)a OP (C)(msl_rt::compute_t<B>)b;                               \
  }
LILY_F16_CMP(<)
LILY_F16_CMP(>)
LILY_F16_CMP(<=)
LILY_F16_CMP(>=)
LILY_F16_CMP(==)
LILY_F16_CMP(!=)
#define LILY_F16_ASSIGN(OP, BIN)                                                               \
  template <class A, class B, std::enable_if_t<msl_rt::is_f16_v<A> && msl_rt::is_scalar_v<B>, int> = 0> \
  inline A& operator OP(A& a, B b) { return a = A(a BIN b); }                                  \
  template <class A, class B, std::enable_if_t<!msl_rt::is_f16_v<A> && std::is_arithmetic_v<A> && \
                                               msl_rt::is_f16_v<B>, int> = 0>                 \
  inline A& operator OP(A& a, B b) { return a = A(a BIN b); }
LILY_F16_ASSIGN(+=, +)
LILY_F16_ASSIGN(-=, -)
LILY_F16_ASSIGN(*=, *)
LILY_F16_ASSIGN(/=, /)

// ---------------------------------------------------------------------------------------------
// Vectors: vec<T, N> with .x .y .z .w (also .r .g .b .a through accessors is not modelled),
// [] indexing, component-wise arithmetic with scalar broadcast. 3-vectors are padded to 4 like
// Metal's; packed_ vectors are not.
namespace metal {
template <class T, int N, bool Packed = false> struct vec;
template <class T, int N, int... I> struct swizzle;
}
namespace msl_rt {
template <class V> struct is_vec : std::false_type {};
template <class T, int N, bool P> struct is_vec<metal::vec<T, N, P>> : std::true_type {};
template <class T, int N, int... I> struct is_vec<metal::swizzle<T, N, I...>> : std::true_type {};
template <class V> inline constexpr bool is_vec_v = is_vec<std::remove_cv_t<std::remove_reference_t<V>>>::value;
template <class V> struct vec_traits { using elem = V; static constexpr int n = 1; };
template <class T, int N, bool P> struct vec_traits<metal::vec<T, N, P>> { using elem = T; static constexpr int n = N; };
template <class T, int N, int... I> struct vec_traits<metal::swizzle<T, N, I...>> { using elem = T; static constexpr int n = sizeof...(I); };
constexpr size_t vec_align(size_t e, int n, bool packed) { return packed ? e : e * (n == 3 ? 4 : n); }
}  // namespace msl_rt

namespace metal {
template <class T, int N, bool P> struct vec_storage;
// Swizzles (v.xy, v.zyx, v.xz = ...): views of the vector's storage that read as / assign from a
// vector. Two-component swizzles come in every combination, longer ones in the common orders.
template <class T, int N, int... I> struct swizzle {
  static constexpr int size = sizeof...(I);
  T d[N];
  using vec_type = vec<T, sizeof...(I)>;
  swizzle& operator=(const vec_type& v) { int k = 0; ((d[I] = v[k++]), ...); return *this; }
  swizzle& operator=(const swizzle& o) { return *this = vec_type(o); }
  T operator[](int k) const { constexpr int idx[] = {I...}; return d[idx[k]]; }
};
template <class T, bool P> struct vec_storage<T, 2, P> {
  union {
    struct { T x, y; };
    struct { T r, g; };
    swizzle<T, 2, 0, 0> xx;
    swizzle<T, 2, 0, 0> rr;
    swizzle<T, 2, 0, 1> xy;
    swizzle<T, 2, 0, 1> rg;
    swizzle<T, 2, 1, 0> yx;
    swizzle<T, 2, 1, 0> gr;
    swizzle<T, 2, 1, 1> yy;
    swizzle<T, 2, 1, 1> gg;
  };
};
template <class T, bool P> struct vec_storage<T, 3, P> {
  union {
    struct { T x, y, z; };
    struct { T r, g, b; };
    swizzle<T, 3, 0, 0> xx;
    swizzle<T, 3, 0, 0> rr;
    swizzle<T, 3, 0, 1> xy;
    swizzle<T, 3, 0, 1> rg;
    swizzle<T, 3, 0, 2> xz;
    swizzle<T, 3, 0, 2> rb;
    swizzle<T, 3, 1, 0> yx;
    swizzle<T, 3, 1, 0> gr;
    swizzle<T, 3, 1, 1> yy;
    swizzle<T, 3, 1, 1> gg;
    swizzle<T, 3, 1, 2> yz;
    swizzle<T, 3, 1, 2> gb;
    swizzle<T, 3, 2, 0> zx;
    swizzle<T, 3, 2, 0> br;
    swizzle<T, 3, 2, 1> zy;
    swizzle<T, 3, 2, 1> bg;
    swizzle<T, 3, 2, 2> zz;
    swizzle<T, 3, 2, 2> bb;
    swizzle<T, 3, 0, 1, 2> xyz;
    swizzle<T, 3, 0, 1, 2> rgb;
    swizzle<T, 3, 2, 1, 0> zyx;
    swizzle<T, 3, 2, 1, 0> bgr;
  };
};
template <class T, bool P> struct vec_storage<T, 4, P> {
  union {
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
    swizzle<T, 4, 0, 0> xx;
    swizzle<T, 4, 0, 0> rr;
    swizzle<T, 4, 0, 1> xy;
    swizzle<T, 4, 0, 1> rg;
    swizzle<T, 4, 0, 2> xz;
    swizzle<T, 4, 0, 2> rb;
    swizzle<T, 4, 0, 3> xw;
    swizzle<T, 4, 0, 3> ra;
    swizzle<T, 4, 1, 0> yx;
    swizzle<T, 4, 1, 0> gr;
    swizzle<T, 4, 1, 1> yy;
    swizzle<T, 4, 1, 1> gg;
    swizzle<T, 4, 1, 2> yz;
    swizzle<T, 4, 1, 2> gb;
    swizzle<T, 4, 1, 3> yw;
    swizzle<T, 4, 1, 3> ga;
    swizzle<T, 4, 2, 0> zx;
    swizzle<T, 4, 2, 0> br;
    swizzle<T, 4, 2, 1> zy;
    swizzle<T, 4, 2, 1> bg;
    swizzle<T, 4, 2, 2> zz;
    swizzle<T, 4, 2, 2> bb;
    swizzle<T, 4, 2, 3> zw;
    swizzle<T, 4, 2, 3> ba;
    swizzle<T, 4, 3, 0> wx;
    swizzle<T, 4, 3, 0> ar;
    swizzle<T, 4, 3, 1> wy;
    swizzle<T, 4, 3, 1> ag;
    swizzle<T, 4, 3, 2> wz;
    swizzle<T, 4, 3, 2> ab;
    swizzle<T, 4, 3, 3> ww;
    swizzle<T, 4, 3, 3> aa;
    swizzle<T, 4, 0, 1, 2> xyz;
    swizzle<T, 4, 0, 1, 2> rgb;
    swizzle<T, 4, 0, 1, 3> xyw;
    swizzle<T, 4, 0, 1, 3> rga;
    swizzle<T, 4, 0, 2, 3> xzw;
    swizzle<T, 4, 0, 2, 3> rba;
    swizzle<T, 4, 1, 2, 3> yzw;
    swizzle<T, 4, 1, 2, 3> gba;
    swizzle<T, 4, 2, 1, 0> zyx;
    swizzle<T, 4, 2, 1, 0> bgr;
    swizzle<T, 4, 0, 1, 2, 3> xyzw;
    swizzle<T, 4, 0, 1, 2, 3> rgba;
    swizzle<T, 4, 3, 2, 1, 0> wzyx;
    swizzle<T, 4, 3, 2, 1, 0> abgr;
  };
};

}  // namespace metal
#ifdef LILY_MSL_TRACE
namespace msl_rt {
// Race-check builds: a vector assigned to or from threadgroup memory at an address its alignment does not divide
// (trace.h). The compiler sees the copy as a memcpy (no alignment), so the check is made here.
void trace_vec_align(const volatile void* p, size_t align, bool write);
}  // namespace msl_rt
#define LILY_VEC_ALIGN(p, write) msl_rt::trace_vec_align((p), alignof(vec), (write))
#else
#define LILY_VEC_ALIGN(p, write) ((void)0)
#endif
namespace metal {
template <class T, int N, bool Packed>
struct alignas(msl_rt::vec_align(sizeof(T), N, Packed)) vec : vec_storage<T, N, Packed> {
  using elem_type = T;
  static constexpr int size = N;
  T& operator[](int i) { return (&this->x)[i]; }
  const T& operator[](int i) const { return (&this->x)[i]; }
  vec() = default;
  vec(const vec&) = default;
  vec& operator=(const vec& o) {
    LILY_VEC_ALIGN(&o, false);
    LILY_VEC_ALIGN(this, true);
    std::memcpy((void*)this, (const void*)&o, sizeof(vec));
    return *this;
  }
  // A swizzle (v.xy) converts to the vector it reads.
  template <int M, int... I, std::enable_if_t<sizeof...(I) == N, int> = 0>
  vec(const swizzle<T, M, I...>& s) { int k = 0; ((( *this)[k++] = s.d[I]), ...); }
  // Scalar broadcast (Metal allows `float4 v = 0.0f;`).
  template <class S, std::enable_if_t<msl_rt::is_scalar_v<S>, int> = 0>
  vec(S s) { for (int i = 0; i < N; ++i) (*this)[i] = T(s); }
  // Component / sub-vector constructors: float4(a, b, c, d), float4(float2, float2), float4(float3, w).
  template <class A, class B, class... R>
  vec(const A& a, const B& b, const R&... r) {
    int k = 0;
    fill(k, a); fill(k, b); (fill(k, r), ...);
    if (k != N) msl_rt::fail("type", "vector constructor: wrong number of components");
  }
  // Conversions between vector types of the same length are explicit in Metal.
  template <class U, bool P2, std::enable_if_t<!std::is_same_v<U, T> || P2 != Packed, int> = 0>
  explicit(std::is_same_v<U, T> ? false : true) vec(const vec<U, N, P2>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);
  }
 private:
  template <class S> void fill(int& k, const S& s) {
    if constexpr (msl_rt::is_vec_v<S>) { for (int i = 0; i < S::size; ++i) (*this)[k++] = T(s[i]); }
    else { (*this)[k++] = T(s); }
  }
};
}  // namespace metal

namespace msl_rt {
template <class A, class B> struct vec_result;
template <class T, int N, bool P, class S> struct vec_result<metal::vec<T, N, P>, S> { using type = metal::vec<T, N>; };
template <class A, class B> using vec_elem_t = typename vec_traits<std::remove_cv_t<std::remove_reference_t<A>>>::elem;
template <class A, class B> constexpr int vec_n() {
  return is_vec_v<A> ? vec_traits<std::remove_cv_t<std::remove_reference_t<A>>>::n : vec_traits<std::remove_cv_t<std::remove_reference_t<B>>>::n;
}
template <class V> inline auto vget(const V& v, int i) {
  if constexpr (is_vec_v<V>) return v[i]; else return v;
}
// Element type of a vector op: the vector's element type (scalars convert to it, as in Metal).
template <class A, class B> using vop_elem_t = std::conditional_t<is_vec_v<A>, typename vec_traits<std::remove_cv_t<A>>::elem, typename vec_traits<std::remove_cv_t<B>>::elem>;
}  // namespace msl_rt

#define LILY_VEC_BINOP(OP)                                                                       \
  namespace metal {                                                                              \
  template <class A, class B,                                                                    \
            std::enable_if_t<(msl_rt::is_vec_v<A> || msl_rt::is_vec_v<B>) &&                    \
                                 (msl_rt::is_vec_v<A> || msl_rt::is_scalar_v<A>) &&            \
                                 (msl_rt::is_vec_v<B> || msl_rt::is_scalar_v<B>), int> = 0>    \
  inline auto operator OP(const A& a, const B& b) {                                              \
    using E = msl_rt::vop_elem_t<A, B>;                                                          \
    constexpr int N = msl_rt::vec_n<A, B>();                                                     \
    vec<E, N> r;                                                                                 \
    for (int i = 0; i < N; ++i) r[i] = E(E(msl_rt::vget(a, i)) OP E(msl_rt::vget(b, i)));        \
    return r;                                                                                    \
  }                                                                                              \
  template <class T, int N, bool P, class B>                                                     \
  inline vec<T, N, P>& operator OP##=(vec<T, N, P>& a, const B& b) {                            \
    for (int i = 0; i < N; ++i) a[i] = T(a[i] OP T(msl_rt::vget(b, i)));                         \
    return a;                                                                                    \
  }                                                                                              \
  }
LILY_VEC_BINOP(+)
LILY_VEC_BINOP(-)
LILY_VEC_BINOP(*)
LILY_VEC_BINOP(/)
LILY_VEC_BINOP(%)
LILY_VEC_BINOP(&)
LILY_VEC_BINOP(|)
LILY_VEC_BINOP(^)
LILY_VEC_BINOP(<<)
LILY_VEC_BINOP(>>)

#define LILY_VEC_CMP(OP)                                                                         \
  namespace metal {                                                                              \
  template <class A, class B,                                                                    \
            std::enable_if_t<(msl_rt::is_vec_v<A> || msl_rt::is_vec_v<B>) &&                    \
                                 (msl_rt::is_vec_v<A> || msl_rt::is_scalar_v<A>) &&            \
                                 (msl_rt::is_vec_v<B> || msl_rt::is_scalar_v<B>), int> = 0>    \
  inline auto operator OP(const A& a, const B& b) {                                              \
    using E = msl_rt::vop_elem_t<A, B>;                                                          \
    constexpr int N = msl_rt::vec_n<A, B>();                                                     \
    vec<bool, N> r;                                                                              \
    for (int i = 0; i < N; ++i) r[i] = E(msl_rt::vget(a, i)) OP E(msl_rt::vget(b, i));           \
    return r;                                                                                    \
  }                                                                                              \
  }
LILY_VEC_CMP(<)
LILY_VEC_CMP(>)
LILY_VEC_CMP(<=)
LILY_VEC_CMP(>=)
LILY_VEC_CMP(==)
LILY_VEC_CMP(!=)

namespace metal {
template <class T, int N, bool P> inline vec<T, N> operator-(const vec<T, N, P>& a) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(-a[i]); return r;
}
template <class T, int N, bool P> inline vec<T, N> operator+(const vec<T, N, P>& a) { return vec<T, N>(a); }
template <class T, int N, bool P> inline vec<T, N> operator~(const vec<T, N, P>& a) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(~a[i]); return r;
}
template <class T, int N, bool P> inline vec<bool, N> operator!(const vec<T, N, P>& a) {
  vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = !a[i]; return r;
}
template <int N, bool P> inline bool all(const vec<bool, N, P>& v) { for (int i = 0; i < N; ++i) if (!v[i]) return false; return true; }
template <int N, bool P> inline bool any(const vec<bool, N, P>& v) { for (int i = 0; i < N; ++i) if (v[i]) return true; return false; }
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
}  // namespace metal

#define LILY_VEC_TYPEDEFS(T, NAME)                                   \
  typedef metal::vec<T, 2> NAME##2;                                  \
  typedef metal::vec<T, 3> NAME##3;                                  \
  typedef metal::vec<T, 4> NAME##4;                                  \
  typedef metal::vec<T, 2, true> packed_##NAME##2;                   \
  typedef metal::vec<T, 3, true> packed_##NAME##3;                   \
  typedef metal::vec<T, 4, true> packed_##NAME##4;
LILY_VEC_TYPEDEFS(float, float)
LILY_VEC_TYPEDEFS(half, half)
LILY_VEC_TYPEDEFS(bfloat, bfloat)
LILY_VEC_TYPEDEFS(int, int)
LILY_VEC_TYPEDEFS(uint, uint)
LILY_VEC_TYPEDEFS(short, short)
LILY_VEC_TYPEDEFS(ushort, ushort)
LILY_VEC_TYPEDEFS(char, char)
LILY_VEC_TYPEDEFS(uchar, uchar)
LILY_VEC_TYPEDEFS(bool, bool)
LILY_VEC_TYPEDEFS(long, long)
LILY_VEC_TYPEDEFS(ulong, ulong)

namespace metal {
// as_type<T>(x): bit reinterpretation between types of equal size.
template <class T, class S> inline T as_type(const S& s) {
  static_assert(sizeof(T) == sizeof(S), "as_type: source and destination sizes differ");
  T t; std::memcpy(&t, &s, sizeof(T)); return t;
}
}  // namespace metal
