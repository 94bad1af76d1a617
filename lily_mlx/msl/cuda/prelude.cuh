// lily-mlx Metal->CUDA bridge prelude: the Metal Shading Language names that MLX kernels use,
// defined for CUDA (sm_80+; built for sm_90a by MLX's CUDA backend).
//
// Sections marked `// @section <name>` (simd, atomics, simdgroup_matrix) are spliced in only for
// kernels that use them, and comments and indentation are dropped (kernel.py: trimmed_prelude): MLX
// hashes a custom kernel's whole source at every launch it evaluates.
//
// It is spliced into the `header` of an `mx.fast.cuda_kernel`, after MLX's own
// "mlx/backend/cuda/device/utils.cuh" and before the translated Metal header. Everything lives in
// namespace `lily_metal` (alias `metal`); the names that clash with CUDA's own (vector types, `half`,
// `uint`) are brought into `mlx::core::cu`, where the kernel body lives, by using-declarations, so the
// body sees the Metal meaning of each name.
//
// Semantics follow Metal where kernels can observe them:
// - bfloat16_t/half: arithmetic in fp32, rounded back (RNE) when both operands are 16-bit;
//   a 16-bit value with a float gives a float, with an integer keeps the 16-bit type.
// - simd_sum & co: the xor butterfly 1, 2, 4, 8, 16 (what Apple GPUs run), full 32-lane warps.
// - simdgroup_matrix<T, 8, 8>: in a kernel that calls thread_elements(), each lane holds the same two
//   elements as on Apple GPUs (row (q & 4) + (lane / 2) % 4, columns (q & 2) * 2 + (lane % 2) * 2 +
//   {0, 1}, q = lane / 4), so thread_elements() means the same thing. Other kernels cannot observe the
//   layout and get mma.sync's (LILY_SGM_MMA_LAYOUT, defined by kernel.py: row lane / 4, columns
//   2 (lane % 4) + {0, 1}), which saves lane shuffles: per 8x8x8 product 2 instead of 7 on the tensor
//   cores, 24 instead of 32 in the fp32 loop (float operands). bf16/half products with fp32 accumulators
//   use tensor cores (mma.sync m16n8k8); other type combinations a warp-cooperative fp32 loop.
// - atomics: relaxed order (the only order Metal offers), on int, uint and float.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lily_metal {

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <class T> struct is_float_t { static constexpr bool value = false; };
template <> struct is_float_t<float> { static constexpr bool value = true; };
template <> struct is_float_t<double> { static constexpr bool value = true; };
template <class T> struct is_int_t { static constexpr bool value = false; };
#define LILY_INT_TYPE(T) template <> struct is_int_t<T> { static constexpr bool value = true; };
LILY_INT_TYPE(bool) LILY_INT_TYPE(char) LILY_INT_TYPE(signed char) LILY_INT_TYPE(unsigned char)
LILY_INT_TYPE(short) LILY_INT_TYPE(unsigned short) LILY_INT_TYPE(int) LILY_INT_TYPE(unsigned int)
LILY_INT_TYPE(long) LILY_INT_TYPE(unsigned long) LILY_INT_TYPE(long long) LILY_INT_TYPE(unsigned long long)
#undef LILY_INT_TYPE
template <class A, class B> struct is_same_t { static constexpr bool value = false; };
template <class A> struct is_same_t<A, A> { static constexpr bool value = true; };
template <class T> struct is_arith_t {
  static constexpr bool value = is_float_t<T>::value || is_int_t<T>::value;
};

// ---------------------------------------------------------------------------------------------
// 16-bit floating types with Metal's promotion rules.

#define LILY_LOWP(NAME, RAW, TO_F, FROM_F)                                                        \
  struct NAME {                                                                                   \
    RAW v;                                                                                        \
    NAME() = default;                                                                             \
    __device__ __forceinline__ NAME(RAW r) : v(r) {}                                              \
    template <class S, class = typename enable_if<is_arith_t<S>::value>::type>                    \
    __device__ __forceinline__ NAME(S x) : v(FROM_F(static_cast<float>(x))) {}                     \
    __device__ __forceinline__ operator float() const { return TO_F(v); }                         \
    __device__ __forceinline__ NAME operator-() const { return NAME(-TO_F(v)); }                  \
    __device__ __forceinline__ NAME operator+() const { return *this; }                           \
    template <class S> __device__ __forceinline__ NAME& operator+=(S o) {                         \
      *this = NAME(float(*this) + float(o)); return *this; }                                      \
    template <class S> __device__ __forceinline__ NAME& operator-=(S o) {                         \
      *this = NAME(float(*this) - float(o)); return *this; }                                      \
    template <class S> __device__ __forceinline__ NAME& operator*=(S o) {                         \
      *this = NAME(float(*this) * float(o)); return *this; }                                      \
    template <class S> __device__ __forceinline__ NAME& operator/=(S o) {                         \
      *this = NAME(float(*this) / float(o)); return *this; }                                      \
  };

LILY_LOWP(bfloat16_t, __nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
LILY_LOWP(float16_t, __half, __half2float, __float2half_rn)
#undef LILY_LOWP
typedef bfloat16_t bfloat;
typedef float16_t half;
#define METAL_FUNC __forceinline__
#ifndef INFINITY  // Metal's float infinity macro
#define INFINITY (__int_as_float(0x7f800000))
#endif

template <class T> struct is_lowp_t { static constexpr bool value = false; };
template <> struct is_lowp_t<bfloat16_t> { static constexpr bool value = true; };
template <> struct is_lowp_t<float16_t> { static constexpr bool value = true; };

#define LILY_LOWP_BINOP(OP)                                                                       \
  template <class L, class = typename enable_if<is_lowp_t<L>::value>::type>                      \
  __device__ __forceinline__ L operator OP(L a, L b) { return L(float(a) OP float(b)); }          \
  template <class L, class S,                                                                     \
            class = typename enable_if<is_lowp_t<L>::value && is_float_t<S>::value>::type>       \
  __device__ __forceinline__ S operator OP(L a, S b) { return S(float(a)) OP b; }                 \
  template <class L, class S,                                                                     \
            class = typename enable_if<is_lowp_t<L>::value && is_float_t<S>::value>::type,       \
            class = void>                                                                         \
  __device__ __forceinline__ S operator OP(S a, L b) { return a OP S(float(b)); }                 \
  template <class L, class I, class = typename enable_if<is_lowp_t<L>::value>::type,             \
            class = typename enable_if<is_int_t<I>::value>::type, class = void, class = void>    \
  __device__ __forceinline__ L operator OP(L a, I b) { return L(float(a) OP float(b)); }          \
  template <class L, class I, class = typename enable_if<is_lowp_t<L>::value>::type,             \
            class = typename enable_if<is_int_t<I>::value>::type, class = void, class = void,    \
            class = void>                                                                         \
  __device__ __forceinline__ L operator OP(I a, L b) { return L(float(a) OP float(b)); }
LILY_LOWP_BINOP(+)
LILY_LOWP_BINOP(-)
LILY_LOWP_BINOP(*)
LILY_LOWP_BINOP(/)
#undef LILY_LOWP_BINOP
// bfloat16 with half: both become float (Metal would ask for an explicit cast).
#define LILY_LOWP_MIXED(OP)                                                                       \
  __device__ __forceinline__ float operator OP(bfloat16_t a, float16_t b) { return float(a) OP float(b); } \
  __device__ __forceinline__ float operator OP(float16_t a, bfloat16_t b) { return float(a) OP float(b); }
LILY_LOWP_MIXED(+)
LILY_LOWP_MIXED(-)
LILY_LOWP_MIXED(*)
LILY_LOWP_MIXED(/)
#undef LILY_LOWP_MIXED

#define LILY_LOWP_CMP(OP)                                                                         \
  template <class L, class = typename enable_if<is_lowp_t<L>::value>::type>                      \
  __device__ __forceinline__ bool operator OP(L a, L b) { return float(a) OP float(b); }          \
  template <class L, class S,                                                                     \
            class = typename enable_if<is_lowp_t<L>::value && is_arith_t<S>::value>::type>       \
  __device__ __forceinline__ bool operator OP(L a, S b) { return float(a) OP b; }                 \
  template <class L, class S,                                                                     \
            class = typename enable_if<is_lowp_t<L>::value && is_arith_t<S>::value>::type,       \
            class = void>                                                                         \
  __device__ __forceinline__ bool operator OP(S a, L b) { return a OP float(b); }
LILY_LOWP_CMP(<)
LILY_LOWP_CMP(>)
LILY_LOWP_CMP(<=)
LILY_LOWP_CMP(>=)
LILY_LOWP_CMP(==)
LILY_LOWP_CMP(!=)
#undef LILY_LOWP_CMP

// Raw CUDA element pointers -> Metal element types (same bits, same size).
template <class T> struct metal_elem { typedef T type; };
template <> struct metal_elem<__nv_bfloat16> { typedef bfloat16_t type; };
template <> struct metal_elem<__half> { typedef float16_t type; };
template <class T>
__device__ __forceinline__ const typename metal_elem<T>::type* as_metal(const T* p) {
  return reinterpret_cast<const typename metal_elem<T>::type*>(p);
}
template <class T>
__device__ __forceinline__ typename metal_elem<T>::type* as_metal(T* p) {
  return reinterpret_cast<typename metal_elem<T>::type*>(p);
}

// ---------------------------------------------------------------------------------------------
// Vector types: members x, y, z, w, component and broadcast constructors, element-wise arithmetic.
// Size and alignment as Metal's: 2 and 4 elements aligned to their size, 3 elements like 4 (so a
// uint4 load is one 16-byte load, and arrays of them have Metal's layout).

template <class T, int N> struct vec;
template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
  T x, y;
  vec() = default;
  __device__ __forceinline__ vec(T s) : x(s), y(s) {}
  __device__ __forceinline__ vec(T a, T b) : x(a), y(b) {}
  template <class U> __device__ __forceinline__ explicit vec(vec<U, 2> o) : x(T(o.x)), y(T(o.y)) {}
  __device__ __forceinline__ T& operator[](int i) { return (&x)[i]; }
  __device__ __forceinline__ T operator[](int i) const { return (&x)[i]; }
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 3> {
  T x, y, z;
  vec() = default;
  __device__ __forceinline__ vec(T s) : x(s), y(s), z(s) {}
  __device__ __forceinline__ vec(T a, T b, T c) : x(a), y(b), z(c) {}
  template <class U> __device__ __forceinline__ explicit vec(vec<U, 3> o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  __device__ __forceinline__ T& operator[](int i) { return (&x)[i]; }
  __device__ __forceinline__ T operator[](int i) const { return (&x)[i]; }
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  __device__ __forceinline__ vec(T s) : x(s), y(s), z(s), w(s) {}
  __device__ __forceinline__ vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  template <class U> __device__ __forceinline__ explicit vec(vec<U, 4> o)
      : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  __device__ __forceinline__ T& operator[](int i) { return (&x)[i]; }
  __device__ __forceinline__ T operator[](int i) const { return (&x)[i]; }
};

#define LILY_VEC_BINOP(OP)                                                                        \
  template <class T, int N> __device__ __forceinline__ vec<T, N> operator OP(vec<T, N> a, vec<T, N> b) { \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]); return r; }                  \
  template <class T, int N> __device__ __forceinline__ vec<T, N> operator OP(vec<T, N> a, T b) {  \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b); return r; }                      \
  template <class T, int N> __device__ __forceinline__ vec<T, N> operator OP(T a, vec<T, N> b) {  \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(a OP b[i]); return r; }                      \
  template <class T, int N, class S>                                                              \
  __device__ __forceinline__ vec<T, N>& operator OP##=(vec<T, N>& a, S b) { a = a OP b; return a; }
LILY_VEC_BINOP(+)
LILY_VEC_BINOP(-)
LILY_VEC_BINOP(*)
LILY_VEC_BINOP(/)
#undef LILY_VEC_BINOP

template <class T, int N> __device__ __forceinline__ T dot(vec<T, N> a, vec<T, N> b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; ++i) s = s + a[i] * b[i];
  return s;
}

#define LILY_VEC_NAMES(T, P)                                                                      \
  typedef vec<T, 2> P##2; typedef vec<T, 3> P##3; typedef vec<T, 4> P##4;
LILY_VEC_NAMES(float, float)
LILY_VEC_NAMES(half, half)
LILY_VEC_NAMES(bfloat16_t, bfloat)
LILY_VEC_NAMES(int, int)
LILY_VEC_NAMES(uint, uint)
LILY_VEC_NAMES(short, short)
LILY_VEC_NAMES(ushort, ushort)
LILY_VEC_NAMES(char, char)
LILY_VEC_NAMES(uchar, uchar)
LILY_VEC_NAMES(long, long)
LILY_VEC_NAMES(ulong, ulong)
LILY_VEC_NAMES(bool, bool)
#undef LILY_VEC_NAMES

// ---------------------------------------------------------------------------------------------
// Math. Templates, so that CUDA's own non-template float overloads win where both apply.

// Byte copy through char pointers (legal aliasing; NVRTC has no memcpy builtin). Compiles to moves.
template <class To, class From> __device__ __forceinline__ void copy_bytes(To* to, const From* from, int n) {
  const char* s = reinterpret_cast<const char*>(from);
  char* d = reinterpret_cast<char*>(to);
#pragma unroll
  for (int i = 0; i < n; ++i) d[i] = s[i];
}
template <class To, class From> __device__ __forceinline__ To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To r;
  copy_bytes(&r, &x, sizeof(To));
  return r;
}

#define LILY_UNARY(NAME, FN)                                                                      \
  template <class T> __device__ __forceinline__ typename enable_if<is_lowp_t<T>::value, T>::type  \
  NAME(T x) { return T(FN(float(x))); }                                                           \
  template <class T> __device__ __forceinline__ typename enable_if<is_float_t<T>::value, T>::type \
  NAME(T x) { return FN(float(x)); }
LILY_UNARY(exp, expf)
LILY_UNARY(exp2, exp2f)
LILY_UNARY(log, logf)
LILY_UNARY(log2, log2f)
LILY_UNARY(sqrt, sqrtf)
LILY_UNARY(rsqrt, rsqrtf)
LILY_UNARY(tanh, tanhf)
LILY_UNARY(sin, sinf)
LILY_UNARY(cos, cosf)
LILY_UNARY(floor, floorf)
LILY_UNARY(ceil, ceilf)
LILY_UNARY(round, roundf)
LILY_UNARY(fabs, fabsf)
LILY_UNARY(erf, erff)
LILY_UNARY(log1p, log1pf)
LILY_UNARY(expm1, expm1f)
#undef LILY_UNARY

template <class T> __device__ __forceinline__ T abs(T x) { return x < T(0) ? T(-x) : x; }
template <class T> __device__ __forceinline__ typename enable_if<is_lowp_t<T>::value, T>::type
max(T a, T b) { return T(fmaxf(float(a), float(b))); }
template <class T> __device__ __forceinline__ typename enable_if<is_lowp_t<T>::value, T>::type
min(T a, T b) { return T(fminf(float(a), float(b))); }
template <class T> __device__ __forceinline__ typename enable_if<is_float_t<T>::value, T>::type
max(T a, T b) { return fmaxf(a, b); }
template <class T> __device__ __forceinline__ typename enable_if<is_float_t<T>::value, T>::type
min(T a, T b) { return fminf(a, b); }
template <class T> __device__ __forceinline__ typename enable_if<is_int_t<T>::value, T>::type
max(T a, T b) { return a > b ? a : b; }
template <class T> __device__ __forceinline__ typename enable_if<is_int_t<T>::value, T>::type
min(T a, T b) { return a < b ? a : b; }
template <class T> __device__ __forceinline__ T fmax(T a, T b) { return max(a, b); }
template <class T> __device__ __forceinline__ T fmin(T a, T b) { return min(a, b); }
template <class T> __device__ __forceinline__ T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T> __device__ __forceinline__ T saturate(T x) { return clamp(x, T(0), T(1)); }
template <class T, class C> __device__ __forceinline__ T select(T a, T b, C c) { return c ? b : a; }
template <class T> __device__ __forceinline__ T mix(T a, T b, T t) { return a + (b - a) * t; }
template <class T> __device__ __forceinline__ typename enable_if<is_lowp_t<T>::value, T>::type
fma(T a, T b, T c) { return T(fmaf(float(a), float(b), float(c))); }
template <class T> __device__ __forceinline__ typename enable_if<is_float_t<T>::value, T>::type
fma(T a, T b, T c) { return fmaf(a, b, c); }
template <class T> __device__ __forceinline__ typename enable_if<is_float_t<T>::value, T>::type
pow(T a, T b) { return powf(a, b); }
template <class T> __device__ __forceinline__ typename enable_if<is_lowp_t<T>::value, T>::type
pow(T a, T b) { return T(powf(float(a), float(b))); }
template <class T> __device__ __forceinline__ bool isnan(T x) { return float(x) != float(x); }
template <class T> __device__ __forceinline__ bool isinf(T x) { return fabsf(float(x)) == __int_as_float(0x7f800000); }
template <class T> __device__ __forceinline__ T divide(T a, T b) { return a / b; }

namespace precise {
using lily_metal::exp; using lily_metal::exp2; using lily_metal::log; using lily_metal::log2;
using lily_metal::sqrt; using lily_metal::rsqrt; using lily_metal::tanh; using lily_metal::sin;
using lily_metal::cos; using lily_metal::divide; using lily_metal::pow; using lily_metal::max;
using lily_metal::min; using lily_metal::abs; using lily_metal::fabs; using lily_metal::erf;
}  // namespace precise
namespace fast {
using namespace lily_metal::precise;
}  // namespace fast

template <class T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static __device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }
  static __device__ __forceinline__ float quiet_NaN() { return __int_as_float(0x7fc00000); }
  static __device__ __forceinline__ float max() { return 3.402823466e+38f; }
  static __device__ __forceinline__ float lowest() { return -3.402823466e+38f; }
  static __device__ __forceinline__ float min() { return 1.175494351e-38f; }
  static __device__ __forceinline__ float epsilon() { return 1.192092896e-07f; }
};
template <> struct numeric_limits<bfloat16_t> {
  static __device__ __forceinline__ bfloat16_t infinity() { return bfloat16_t(numeric_limits<float>::infinity()); }
  static __device__ __forceinline__ bfloat16_t max() { return bfloat16_t(3.38953139e38f); }
  static __device__ __forceinline__ bfloat16_t lowest() { return bfloat16_t(-3.38953139e38f); }
};
template <> struct numeric_limits<float16_t> {
  static __device__ __forceinline__ float16_t infinity() { return float16_t(numeric_limits<float>::infinity()); }
  static __device__ __forceinline__ float16_t max() { return float16_t(65504.0f); }
  static __device__ __forceinline__ float16_t lowest() { return float16_t(-65504.0f); }
};
template <> struct numeric_limits<int> {
  static __device__ __forceinline__ int max() { return 2147483647; }
  static __device__ __forceinline__ int min() { return -2147483647 - 1; }
  static __device__ __forceinline__ int lowest() { return -2147483647 - 1; }
};
template <> struct numeric_limits<uint> {
  static __device__ __forceinline__ uint max() { return 0xffffffffu; }
  static __device__ __forceinline__ uint min() { return 0u; }
  static __device__ __forceinline__ uint lowest() { return 0u; }
};

// ---------------------------------------------------------------------------------------------
// Barriers.

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
__device__ __forceinline__ mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}
__device__ __forceinline__ void threadgroup_barrier(mem_flags f = mem_flags::mem_none) {
  if (unsigned(f) & unsigned(mem_flags::mem_device)) __threadfence();
  __syncthreads();
}
__device__ __forceinline__ void simdgroup_barrier(mem_flags f = mem_flags::mem_none) {
  if (unsigned(f) & unsigned(mem_flags::mem_device)) __threadfence();
  __syncwarp();
}

// @section simd
// ---------------------------------------------------------------------------------------------
// SIMD-group functions on warp shuffles (all 32 lanes take part, as the bridge requires).

#define LILY_FULL_MASK 0xffffffffu

__device__ __forceinline__ uint lane_id() {
  uint l;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}

// Shuffle any trivially copyable value, 32 bits at a time. MODE: 0 idx, 1 xor, 2 up, 3 down.
template <int MODE, class T>
__device__ __forceinline__ T shuffle_words(T x, uint arg, int width = 32) {
  constexpr int W = (sizeof(T) + 3) / 4;
  uint w[W] = {};
  copy_bytes(w, &x, sizeof(T));
#pragma unroll
  for (int i = 0; i < W; ++i) {
    if (MODE == 0) w[i] = __shfl_sync(LILY_FULL_MASK, w[i], arg, width);
    if (MODE == 1) w[i] = __shfl_xor_sync(LILY_FULL_MASK, w[i], arg, width);
    if (MODE == 2) w[i] = __shfl_up_sync(LILY_FULL_MASK, w[i], arg, width);
    if (MODE == 3) w[i] = __shfl_down_sync(LILY_FULL_MASK, w[i], arg, width);
  }
  T r;
  copy_bytes(&r, w, sizeof(T));
  return r;
}

template <class T> __device__ __forceinline__ T simd_shuffle(T x, uint lane) { return shuffle_words<0>(x, lane); }
template <class T> __device__ __forceinline__ T simd_shuffle_xor(T x, uint mask) { return shuffle_words<1>(x, mask); }
template <class T> __device__ __forceinline__ T simd_shuffle_up(T x, uint delta) { return shuffle_words<2>(x, delta); }
template <class T> __device__ __forceinline__ T simd_shuffle_down(T x, uint delta) { return shuffle_words<3>(x, delta); }
template <class T> __device__ __forceinline__ T simd_shuffle_rotate_down(T x, uint delta) {
  return shuffle_words<0>(x, (lane_id() + delta) & 31u);
}
template <class T> __device__ __forceinline__ T simd_shuffle_rotate_up(T x, uint delta) {
  return shuffle_words<0>(x, (lane_id() - delta) & 31u);
}
template <class T> __device__ __forceinline__ T simd_broadcast(T x, uint lane) { return shuffle_words<0>(x, lane); }
template <class T> __device__ __forceinline__ T simd_broadcast_first(T x) { return shuffle_words<0>(x, 0u); }

template <class T> __device__ __forceinline__ T simd_sum(T x) {
#pragma unroll
  for (uint m = 1; m < 32; m <<= 1) x = T(x + simd_shuffle_xor(x, m));
  return x;
}
template <class T> __device__ __forceinline__ T simd_product(T x) {
#pragma unroll
  for (uint m = 1; m < 32; m <<= 1) x = T(x * simd_shuffle_xor(x, m));
  return x;
}
template <class T> __device__ __forceinline__ T simd_max(T x) {
#pragma unroll
  for (uint m = 1; m < 32; m <<= 1) x = max(x, simd_shuffle_xor(x, m));
  return x;
}
template <class T> __device__ __forceinline__ T simd_min(T x) {
#pragma unroll
  for (uint m = 1; m < 32; m <<= 1) x = min(x, simd_shuffle_xor(x, m));
  return x;
}
template <class T> __device__ __forceinline__ T simd_and(T x) {
  for (uint m = 1; m < 32; m <<= 1) x = x & simd_shuffle_xor(x, m);
  return x;
}
template <class T> __device__ __forceinline__ T simd_or(T x) {
  for (uint m = 1; m < 32; m <<= 1) x = x | simd_shuffle_xor(x, m);
  return x;
}
template <class T> __device__ __forceinline__ T simd_xor(T x) {
  for (uint m = 1; m < 32; m <<= 1) x = x ^ simd_shuffle_xor(x, m);
  return x;
}
template <class T> __device__ __forceinline__ T simd_prefix_inclusive_sum(T x) {
  uint lane = lane_id();
#pragma unroll
  for (uint d = 1; d < 32; d <<= 1) {
    T y = simd_shuffle_up(x, d);
    if (lane >= d) x = T(x + y);
  }
  return x;
}
template <class T> __device__ __forceinline__ T simd_prefix_exclusive_sum(T x) {
  T inc = simd_prefix_inclusive_sum(x);
  T prev = simd_shuffle_up(inc, 1u);
  return lane_id() == 0 ? T(0) : prev;
}
__device__ __forceinline__ bool simd_all(bool c) { return __all_sync(LILY_FULL_MASK, c); }
__device__ __forceinline__ bool simd_any(bool c) { return __any_sync(LILY_FULL_MASK, c); }
__device__ __forceinline__ unsigned long long simd_ballot(bool c) {
  return (unsigned long long)__ballot_sync(LILY_FULL_MASK, c);
}
__device__ __forceinline__ bool simd_is_first() { return lane_id() == 0; }

template <class T> __device__ __forceinline__ T quad_shuffle(T x, uint l) { return shuffle_words<0>(x, l, 4); }
template <class T> __device__ __forceinline__ T quad_shuffle_xor(T x, uint m) { return shuffle_words<1>(x, m, 4); }
template <class T> __device__ __forceinline__ T quad_shuffle_up(T x, uint d) { return shuffle_words<2>(x, d, 4); }
template <class T> __device__ __forceinline__ T quad_shuffle_down(T x, uint d) { return shuffle_words<3>(x, d, 4); }
template <class T> __device__ __forceinline__ T quad_broadcast(T x, uint l) { return shuffle_words<0>(x, l, 4); }
template <class T> __device__ __forceinline__ T quad_sum(T x) {
  x = T(x + quad_shuffle_xor(x, 1u));
  return T(x + quad_shuffle_xor(x, 2u));
}
template <class T> __device__ __forceinline__ T quad_max(T x) {
  x = max(x, quad_shuffle_xor(x, 1u));
  return max(x, quad_shuffle_xor(x, 2u));
}
template <class T> __device__ __forceinline__ T quad_min(T x) {
  x = min(x, quad_shuffle_xor(x, 1u));
  return min(x, quad_shuffle_xor(x, 2u));
}

// @section atomics
// ---------------------------------------------------------------------------------------------
// Atomics (Metal: relaxed order only).

enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release,
                    memory_order_acq_rel, memory_order_seq_cst };
template <class T> struct atomic { T value; };
template <class T> struct same_type { typedef T type; };  // blocks deduction from the operand
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;

template <class T> __device__ __forceinline__ T atomic_fetch_add_explicit(atomic<T>* o, typename same_type<T>::type v, memory_order = memory_order_relaxed) {
  return atomicAdd(&o->value, v);
}
template <class T> __device__ __forceinline__ T atomic_fetch_sub_explicit(atomic<T>* o, typename same_type<T>::type v, memory_order = memory_order_relaxed) {
  return atomicAdd(&o->value, T(-v));
}
template <class T> __device__ __forceinline__ T atomic_fetch_max_explicit(atomic<T>* o, typename same_type<T>::type v, memory_order = memory_order_relaxed) {
  return atomicMax(&o->value, v);
}
template <class T> __device__ __forceinline__ T atomic_fetch_min_explicit(atomic<T>* o, typename same_type<T>::type v, memory_order = memory_order_relaxed) {
  return atomicMin(&o->value, v);
}
template <class T> __device__ __forceinline__ T atomic_fetch_and_explicit(atomic<T>* o, typename same_type<T>::type v, memory_order = memory_order_relaxed) {
  return atomicAnd(&o->value, v);
}
template <class T> __device__ __forceinline__ T atomic_fetch_or_explicit(atomic<T>* o, typename same_type<T>::type v, memory_order = memory_order_relaxed) {
  return atomicOr(&o->value, v);
}
template <class T> __device__ __forceinline__ T atomic_fetch_xor_explicit(atomic<T>* o, typename same_type<T>::type v, memory_order = memory_order_relaxed) {
  return atomicXor(&o->value, v);
}
template <class T> __device__ __forceinline__ T atomic_exchange_explicit(atomic<T>* o, typename same_type<T>::type v, memory_order = memory_order_relaxed) {
  return atomicExch(&o->value, v);
}
template <class T> __device__ __forceinline__ T atomic_load_explicit(atomic<T>* o, memory_order = memory_order_relaxed) {
  return *reinterpret_cast<volatile T*>(&o->value);
}
template <class T> __device__ __forceinline__ void atomic_store_explicit(atomic<T>* o, typename same_type<T>::type v, memory_order = memory_order_relaxed) {
  *reinterpret_cast<volatile T*>(&o->value) = v;
}
template <class T>
__device__ __forceinline__ bool atomic_compare_exchange_weak_explicit(
    atomic<T>* o, T* expected, T desired, memory_order = memory_order_relaxed,
    memory_order = memory_order_relaxed) {
  static_assert(sizeof(T) == 4, "atomic compare-exchange needs a 32-bit type");
  unsigned int want = as_type<unsigned int>(*expected);
  unsigned int old = atomicCAS(reinterpret_cast<unsigned int*>(&o->value), want, as_type<unsigned int>(desired));
  if (old == want) return true;
  *expected = as_type<T>(old);
  return false;
}
template <class T>
__device__ __forceinline__ atomic<T>* as_atomic(T* p) { return reinterpret_cast<atomic<T>*>(p); }

// @section simdgroup_matrix
// ---------------------------------------------------------------------------------------------
// simdgroup_matrix<T, 8, 8>: two elements per lane, row sgm_row(lane), columns sgm_col(lane) + {0, 1}.
// Two lane layouts (kernel.py picks one per kernel):
// - Apple's (default): what thread_elements() exposes on Apple GPUs, which some kernels rely on.
// - LILY_SGM_MMA_LAYOUT: mma.sync m16n8k8's fragment layout, lane l holds row l / 4, columns
//   2 (l % 4) + {0, 1}. Only thread_elements() can observe a layout, so kernels that never call it get
//   this one: A and C/D are then mma's fragments as they are (2 shuffles per tensor-core product
//   instead of 7), and the fp32 loop finds A's row within the lane's quad (fewer shuffles too).

#ifdef LILY_SGM_MMA_LAYOUT
__device__ __forceinline__ uint sgm_row(uint lane) { return lane >> 2; }
__device__ __forceinline__ uint sgm_col(uint lane) { return (lane & 3u) * 2u; }
// The lane that holds element (row, col) (and its neighbour col ^ 1).
__device__ __forceinline__ uint sgm_lane(uint row, uint col) { return 4u * row + (col >> 1); }
#else
__device__ __forceinline__ uint sgm_row(uint lane) { uint q = lane >> 2; return (q & 4u) + ((lane >> 1) & 3u); }
__device__ __forceinline__ uint sgm_col(uint lane) { uint q = lane >> 2; return (q & 2u) * 2u + (lane & 1u) * 2u; }
// The lane that holds element (row, col) (and its neighbour col ^ 1).
__device__ __forceinline__ uint sgm_lane(uint row, uint col) {
  uint q = (row & 4u) | ((col & 4u) >> 1) | ((row >> 1) & 1u);
  return 4u * q + (((row & 1u) << 1) | ((col >> 1) & 1u));
}
#endif

template <class T, int R, int C> struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "the bridge supports 8x8 simdgroup matrices only");
  vec<T, 2> e;
  simdgroup_matrix() = default;
  __device__ __forceinline__ explicit simdgroup_matrix(T v) : e(v) {}
  __device__ __forceinline__ vec<T, 2>& thread_elements() { return e; }
  __device__ __forceinline__ const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int R, int C>
__device__ __forceinline__ simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  return simdgroup_matrix<T, R, C>(v);
}

template <class T, class S>
__device__ __forceinline__ void simdgroup_load(simdgroup_matrix<T, 8, 8>& m, const S* src, ulong elements_per_row = 8,
                                               ulong2 origin = ulong2(0, 0), bool transpose = false) {
  uint lane = lane_id(), r = sgm_row(lane), c = sgm_col(lane);
  for (int i = 0; i < 2; ++i) {
    ulong row = transpose ? c + i : r, col = transpose ? r : c + i;
    m.e[i] = T(src[(origin.y + row) * elements_per_row + origin.x + col]);
  }
}
template <class T, class S>
__device__ __forceinline__ void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, S* dst, ulong elements_per_row = 8,
                                                ulong2 origin = ulong2(0, 0), bool transpose = false) {
  uint lane = lane_id(), r = sgm_row(lane), c = sgm_col(lane);
  for (int i = 0; i < 2; ++i) {
    ulong row = transpose ? c + i : r, col = transpose ? r : c + i;
    dst[(origin.y + row) * elements_per_row + origin.x + col] = S(m.e[i]);
  }
}

// D = A * B + C, fp32 arithmetic, one lane's two elements: row r, columns col, col + 1. Per element:
// d = C, then d = fma(A(r, k), B(k, col), d) for k = 0..7 in this order, in both layouts (lily's GEMV
// forms of its GEMM tiles reproduce these bits).
template <class TA, class TB, class TC>
__device__ __forceinline__ void sgm_mac_fp32(float& d0, float& d1, const simdgroup_matrix<TA, 8, 8>& a,
                                             const simdgroup_matrix<TB, 8, 8>& b,
                                             const simdgroup_matrix<TC, 8, 8>& c) {
  uint lane = lane_id();
  d0 = float(c.e[0]);
  d1 = float(c.e[1]);
#ifdef LILY_SGM_MMA_LAYOUT
  // Row r = lane / 4 of A is held by the lane's own quad: pair j (A(r, 2j), A(r, 2j + 1)) in lane 4r + j.
  // One shuffle per pair (the lane's own pair too: a per-lane select would cost more than it saves).
  uint quad = lane & ~3u, t = lane & 3u;
  vec<TA, 2> ar[4];
#pragma unroll
  for (uint j = 0; j < 4; ++j) ar[j] = simd_shuffle(a.e, quad + j);
#pragma unroll
  for (uint k = 0; k < 8; ++k) {
    float ak = float(ar[k >> 1][k & 1u]);
    vec<TB, 2> bk = simd_shuffle(b.e, 4u * k + t);  // B(k, col..col+1), col = 2t: lane 4k + t
    d0 = fmaf(ak, float(bk.x), d0);
    d1 = fmaf(ak, float(bk.y), d1);
  }
#else
  uint r = sgm_row(lane), col = sgm_col(lane);
#pragma unroll
  for (uint k = 0; k < 8; ++k) {
    // A(r, k) lives in element k & 1 of lane sgm_lane(r, k); B(k, col..col+1) in lane sgm_lane(k, col).
    float a0 = float(simd_shuffle(a.e[0], sgm_lane(r, k)));
    float a1 = float(simd_shuffle(a.e[1], sgm_lane(r, k)));
    float ak = (k & 1u) ? a1 : a0;
    vec<TB, 2> bk = simd_shuffle(b.e, sgm_lane(k, col));
    d0 = fmaf(ak, float(bk.x), d0);
    d1 = fmaf(ak, float(bk.y), d1);
  }
#endif
}

#ifndef LILY_NO_MMA
// Tensor cores: mma.sync m16n8k8 with A rows 8..15 zero. Its fragments hold (g, 2t..2t+1) of A
// and C/D and (2t..2t+1, g) of B, g = lane / 4, t = lane % 4: in Apple's layout a permutation of the
// lanes' pairs; in the mma layout A's and C/D's are the lanes' own pairs.
template <class L> struct mma_kind;
template <> struct mma_kind<bfloat16_t> { static constexpr int bf16 = 1; };
template <> struct mma_kind<float16_t> { static constexpr int bf16 = 0; };

template <class L>
__device__ __forceinline__ uint pack_pair(L lo, L hi) {
  unsigned short l = as_type<unsigned short>(lo), h = as_type<unsigned short>(hi);
  return uint(l) | (uint(h) << 16);
}

template <class L>
__device__ __forceinline__ void mma_m16n8k8(float& o0, float& o1, uint a_reg, uint b_reg, float c0, float c1) {
  // A rows 8..15 and C/D rows 8..15 (a1, c2, c3 / o2, o3) are padding. asm volatile, as CUTLASS writes
  // mma.sync: the compiler must not sink a warp-synchronous instruction into divergent code; ptxas,
  // which schedules the machine code, still interleaves independent products.
  float o2, o3;
  uint zero = 0u;
  float z = 0.0f;
  if (mma_kind<L>::bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
        : "=f"(o0), "=f"(o1), "=f"(o2), "=f"(o3)
        : "r"(a_reg), "r"(zero), "r"(b_reg), "f"(c0), "f"(c1), "f"(z), "f"(z));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
        : "=f"(o0), "=f"(o1), "=f"(o2), "=f"(o3)
        : "r"(a_reg), "r"(zero), "r"(b_reg), "f"(c0), "f"(c1), "f"(z), "f"(z));
  }
}

template <class L, class TC>
__device__ __forceinline__ void sgm_mac_mma(float& d0, float& d1, const simdgroup_matrix<L, 8, 8>& a,
                                            const simdgroup_matrix<L, 8, 8>& b,
                                            const simdgroup_matrix<TC, 8, 8>& c) {
  uint lane = lane_id(), g = lane >> 2, t = lane & 3u;
#ifdef LILY_SGM_MMA_LAYOUT
  // A (g, 2t..2t+1), C and D (g, 2t..2t+1) are this lane's own pairs. B's fragment (2t, g), (2t + 1, g)
  // is element g & 1 of the pairs of lanes 8t + g / 2 and 8t + 4 + g / 2: 2 shuffles, one byte permute.
  uint b_pair = pack_pair(b.e[0], b.e[1]);
  uint b_lo = simd_shuffle(b_pair, sgm_lane(2u * t, g));
  uint b_hi = simd_shuffle(b_pair, sgm_lane(2u * t + 1u, g));
  uint b_reg = __byte_perm(b_lo, b_hi, (g & 1u) ? 0x7632u : 0x5410u);  // both high or both low halves
  mma_m16n8k8<L>(d0, d1, pack_pair(a.e[0], a.e[1]), b_reg, float(c.e[0]), float(c.e[1]));
#else
  // A and C pairs: the lane holding row g, columns 2t, 2t + 1.
  uint src_ac = sgm_lane(g, 2u * t);
  uint a_reg = simd_shuffle(pack_pair(a.e[0], a.e[1]), src_ac);
  float c0 = simd_shuffle(float(c.e[0]), src_ac);
  float c1 = simd_shuffle(float(c.e[1]), src_ac);
  // B pair: (2t, g) and (2t + 1, g), from two lanes; element g & 1 of each.
  vec<L, 2> b_lo = simd_shuffle(b.e, sgm_lane(2u * t, g));
  vec<L, 2> b_hi = simd_shuffle(b.e, sgm_lane(2u * t + 1u, g));
  uint b_reg = (g & 1u) ? pack_pair(b_lo.y, b_hi.y) : pack_pair(b_lo.x, b_hi.x);
  float o0, o1;
  mma_m16n8k8<L>(o0, o1, a_reg, b_reg, c0, c1);
  // Back to Apple's layout: this lane wants (r, col..col+1), held by mma lane 4r + col / 2.
  uint lane_back = 4u * sgm_row(lane) + sgm_col(lane) / 2u;
  d0 = simd_shuffle(o0, lane_back);
  d1 = simd_shuffle(o1, lane_back);
#endif
}
#endif

template <class TD, class TA, class TB, class TC>
__device__ __forceinline__ void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                                              const simdgroup_matrix<TA, 8, 8>& a,
                                                              const simdgroup_matrix<TB, 8, 8>& b,
                                                              const simdgroup_matrix<TC, 8, 8>& c) {
  float d0, d1;
#ifndef LILY_NO_MMA
  constexpr bool same_lowp = is_lowp_t<TA>::value && sizeof(TA) == 2 &&
                             (sizeof(TA) == sizeof(TB)) && is_lowp_t<TB>::value;
  if constexpr (same_lowp && is_same_t<TA, TB>::value) {
    sgm_mac_mma<TA>(d0, d1, a, b, c);
  } else {
    sgm_mac_fp32(d0, d1, a, b, c);
  }
#else
  sgm_mac_fp32(d0, d1, a, b, c);
#endif
  d.e[0] = TD(d0);
  d.e[1] = TD(d1);
}
template <class TD, class TA, class TB>
__device__ __forceinline__ void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                                   const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, simdgroup_matrix<float, 8, 8>(0.0f));
}

// @section always
}  // namespace lily_metal

namespace metal = lily_metal;

// The kernel body lives in mlx::core::cu: these declarations make the Metal meaning of names that
// CUDA also defines (vector types, half) the one found there.
namespace mlx::core::cu {
using lily_metal::uint; using lily_metal::ushort; using lily_metal::uchar; using lily_metal::ulong;
using lily_metal::bfloat16_t; using lily_metal::float16_t; using lily_metal::bfloat; using lily_metal::half;
using lily_metal::float2; using lily_metal::float3; using lily_metal::float4;
using lily_metal::half2; using lily_metal::half3; using lily_metal::half4;
using lily_metal::bfloat2; using lily_metal::bfloat3; using lily_metal::bfloat4;
using lily_metal::int2; using lily_metal::int3; using lily_metal::int4;
using lily_metal::uint2; using lily_metal::uint3; using lily_metal::uint4;
using lily_metal::short2; using lily_metal::short3; using lily_metal::short4;
using lily_metal::ushort2; using lily_metal::ushort3; using lily_metal::ushort4;
using lily_metal::char2; using lily_metal::char3; using lily_metal::char4;
using lily_metal::uchar2; using lily_metal::uchar3; using lily_metal::uchar4;
using lily_metal::long2; using lily_metal::long3; using lily_metal::long4;
using lily_metal::ulong2; using lily_metal::ulong3; using lily_metal::ulong4;
using lily_metal::bool2; using lily_metal::bool3; using lily_metal::bool4;
using namespace lily_metal;
}  // namespace mlx::core::cu
