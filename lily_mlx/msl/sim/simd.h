// Metal-compatibility prelude, part 4: simdgroup functions (32 lanes, rendezvous per call),
// atomics, simdgroup_matrix. Reductions follow the xor butterfly 1, 2, 4, 8, 16.
#pragma once
#include "runtime.h"

namespace msl_rt {

// One collective simd op: every lane deposits `v` (and an auxiliary integer, e.g. a lane index),
// the last lane to arrive runs `op(in, aux, present, out)` for the whole simdgroup.
template <class R, class T, class Op>
inline R simd_collective(const T& v, uint32_t aux, const char* what, int line, Op op) {
  static_assert(sizeof(T) <= kSlotBytes && sizeof(R) <= kSlotBytes, "simd op on a value larger than 64 bytes");
  Worker* w = tw;
  Fiber* f = w->cur;
  uint lane = f->at.thread_index_in_simdgroup;
  SimdSlot& s = w->simd[f->at.simdgroup_index_in_threadgroup];
  bool last = arrive(w, s, what, line);
  std::memcpy(s.in + lane * sizeof(T), &v, sizeof(T));
  std::memcpy(s.aux + lane * 4, &aux, 4);
  if (last) {
    T in[kSimdWidth];
    uint32_t ax[kSimdWidth];
    std::memcpy((void*)in, s.in, sizeof(in));
    std::memcpy(ax, s.aux, sizeof(ax));
    R out[kSimdWidth];
    op(in, ax, s.present, out);
    std::memcpy((void*)s.out, out, sizeof(out));
    complete(s);
  } else {
    wait_for(w, s, what, line);
  }
  R r;
  std::memcpy((void*)&r, s.out + lane * sizeof(R), sizeof(R));
  return r;
}

// Butterfly reduction over present lanes (absent lanes contribute nothing).
template <class T, class F> inline void butterfly(const T* in, uint32_t present, T* out, F combine) {
  T v[kSimdWidth];
  bool has[kSimdWidth];
  for (int l = 0; l < kSimdWidth; ++l) { v[l] = in[l]; has[l] = (present >> l) & 1u; }
  for (int m = 1; m < kSimdWidth; m <<= 1) {
    T nv[kSimdWidth];
    bool nh[kSimdWidth];
    for (int l = 0; l < kSimdWidth; ++l) {
      int o = l ^ m;
      if (has[l] && has[o]) nv[l] = combine(v[l], v[o]);
      else nv[l] = has[l] ? v[l] : v[o];
      nh[l] = has[l] || has[o];
    }
    for (int l = 0; l < kSimdWidth; ++l) { v[l] = nv[l]; has[l] = nh[l]; }
  }
  for (int l = 0; l < kSimdWidth; ++l) out[l] = v[l];
}

inline int line_of(const std::source_location& loc) { return (int)loc.line(); }
}  // namespace msl_rt

namespace metal {
using msl_rt::line_of;
typedef std::source_location lily_loc;
#define LILY_LOC lily_loc loc = lily_loc::current()

#define LILY_SIMD_REDUCE(NAME, EXPR)                                                               \
  template <class T> inline T NAME(T x, LILY_LOC) {                                                \
    return msl_rt::simd_collective<T>(x, 0, #NAME, line_of(loc), [](const T* in, const uint32_t*,  \
                                                                     uint32_t present, T* out) {    \
      msl_rt::butterfly(in, present, out, [](T a, T b) { return T(EXPR); });                        \
    });                                                                                            \
  }
LILY_SIMD_REDUCE(simd_sum, a + b)
LILY_SIMD_REDUCE(simd_product, a * b)
LILY_SIMD_REDUCE(simd_max, max(a, b))
LILY_SIMD_REDUCE(simd_min, min(a, b))
LILY_SIMD_REDUCE(simd_and, a & b)
LILY_SIMD_REDUCE(simd_or, a | b)
LILY_SIMD_REDUCE(simd_xor, a ^ b)

template <class T> inline T simd_prefix_inclusive_sum(T x, LILY_LOC) {
  return msl_rt::simd_collective<T>(x, 0, "simd_prefix_inclusive_sum", line_of(loc),
                                    [](const T* in, const uint32_t*, uint32_t present, T* out) {
    T acc = T(0);
    for (int l = 0; l < 32; ++l) { if ((present >> l) & 1u) acc = T(acc + in[l]); out[l] = acc; }
  });
}
template <class T> inline T simd_prefix_exclusive_sum(T x, LILY_LOC) {
  return msl_rt::simd_collective<T>(x, 0, "simd_prefix_exclusive_sum", line_of(loc),
                                    [](const T* in, const uint32_t*, uint32_t present, T* out) {
    T acc = T(0);
    for (int l = 0; l < 32; ++l) { out[l] = acc; if ((present >> l) & 1u) acc = T(acc + in[l]); }
  });
}
template <class T> inline T simd_prefix_inclusive_product(T x, LILY_LOC) {
  return msl_rt::simd_collective<T>(x, 0, "simd_prefix_inclusive_product", line_of(loc),
                                    [](const T* in, const uint32_t*, uint32_t present, T* out) {
    T acc = T(1);
    for (int l = 0; l < 32; ++l) { if ((present >> l) & 1u) acc = T(acc * in[l]); out[l] = acc; }
  });
}
template <class T> inline T simd_prefix_exclusive_product(T x, LILY_LOC) {
  return msl_rt::simd_collective<T>(x, 0, "simd_prefix_exclusive_product", line_of(loc),
                                    [](const T* in, const uint32_t*, uint32_t present, T* out) {
    T acc = T(1);
    for (int l = 0; l < 32; ++l) { out[l] = acc; if ((present >> l) & 1u) acc = T(acc * in[l]); }
  });
}

// Shuffles: `aux` carries each lane's own index / delta / mask argument.
#define LILY_SIMD_SHUFFLE(NAME, SRC)                                                                 \
  template <class T, class I> inline T NAME(T x, I arg, LILY_LOC) {                                  \
    return msl_rt::simd_collective<T>(x, (uint32_t)arg, #NAME, line_of(loc),                         \
                                      [](const T* in, const uint32_t* a, uint32_t present, T* out) { \
      for (int l = 0; l < 32; ++l) {                                                                 \
        uint32_t s = (SRC);                                                                          \
        out[l] = (s < 32 && ((present >> s) & 1u)) ? in[s] : in[l];                                  \
      }                                                                                              \
    });                                                                                              \
  }
LILY_SIMD_SHUFFLE(simd_shuffle, a[l])
LILY_SIMD_SHUFFLE(simd_broadcast, a[l])
LILY_SIMD_SHUFFLE(simd_shuffle_xor, (uint32_t)l ^ (a[l] & 31u))
LILY_SIMD_SHUFFLE(simd_shuffle_down, (uint32_t)l + a[l] < 32 ? (uint32_t)l + a[l] : (uint32_t)l)
LILY_SIMD_SHUFFLE(simd_shuffle_up, (uint32_t)l >= a[l] ? (uint32_t)l - a[l] : (uint32_t)l)
LILY_SIMD_SHUFFLE(simd_shuffle_rotate_down, ((uint32_t)l + a[l]) & 31u)
LILY_SIMD_SHUFFLE(simd_shuffle_rotate_up, ((uint32_t)l - a[l]) & 31u)
// quad_*: groups of 4 lanes.
LILY_SIMD_SHUFFLE(quad_shuffle, ((uint32_t)l & ~3u) | (a[l] & 3u))
LILY_SIMD_SHUFFLE(quad_broadcast, ((uint32_t)l & ~3u) | (a[l] & 3u))
LILY_SIMD_SHUFFLE(quad_shuffle_xor, ((uint32_t)l & ~3u) | (((uint32_t)l ^ a[l]) & 3u))
LILY_SIMD_SHUFFLE(quad_shuffle_down, ((uint32_t)l & 3u) + a[l] < 4 ? (uint32_t)l + a[l] : (uint32_t)l)
LILY_SIMD_SHUFFLE(quad_shuffle_up, ((uint32_t)l & 3u) >= a[l] ? (uint32_t)l - a[l] : (uint32_t)l)

// simd_shuffle_and_fill_down/up(data, filling, delta[, modulo]): lanes shifted out are filled from
// `filling` of the lane (l + delta - modulo) / (l - delta + modulo) within each modulo-sized block.
template <class T, class I> inline T simd_shuffle_and_fill_down(T data, T fill, I delta, ushort modulo = 32, LILY_LOC) {
  struct P { T d, f; };
  uint32_t aux = (uint32_t)delta | ((uint32_t)modulo << 16);
  return msl_rt::simd_collective<T>(P{data, fill}, aux, "simd_shuffle_and_fill_down", line_of(loc),
                                    [](const P* in, const uint32_t* a, uint32_t, T* out) {
    for (uint32_t l = 0; l < 32; ++l) {
      uint32_t d = a[l] & 0xffffu, m = a[l] >> 16, base = l / m * m, j = l % m;
      out[l] = j + d < m ? in[base + j + d].d : in[base + j + d - m].f;
    }
  });
}
template <class T, class I> inline T simd_shuffle_and_fill_up(T data, T fill, I delta, ushort modulo = 32, LILY_LOC) {
  struct P { T d, f; };
  uint32_t aux = (uint32_t)delta | ((uint32_t)modulo << 16);
  return msl_rt::simd_collective<T>(P{data, fill}, aux, "simd_shuffle_and_fill_up", line_of(loc),
                                    [](const P* in, const uint32_t* a, uint32_t, T* out) {
    for (uint32_t l = 0; l < 32; ++l) {
      uint32_t d = a[l] & 0xffffu, m = a[l] >> 16, base = l / m * m, j = l % m;
      out[l] = j >= d ? in[base + j - d].d : in[base + j + m - d].f;
    }
  });
}

template <class T> inline T quad_sum(T x, LILY_LOC) {
  return msl_rt::simd_collective<T>(x, 0, "quad_sum", line_of(loc), [](const T* in, const uint32_t*, uint32_t, T* out) {
    for (int q = 0; q < 32; q += 4) {
      T a = T(in[q] + in[q + 1]), b = T(in[q + 2] + in[q + 3]);
      T s = T(a + b);
      for (int i = 0; i < 4; ++i) out[q + i] = s;
    }
  });
}

template <class T> inline T simd_broadcast_first(T x, LILY_LOC) {
  return msl_rt::simd_collective<T>(x, 0, "simd_broadcast_first", line_of(loc),
                                    [](const T* in, const uint32_t*, uint32_t present, T* out) {
    int first = present ? __builtin_ctz(present) : 0;
    for (int l = 0; l < 32; ++l) out[l] = in[first];
  });
}

struct simd_vote {
  typedef uint64_t vote_t;
  vote_t v;
  explicit constexpr simd_vote(vote_t x = 0) : v(x) {}
  explicit operator vote_t() const { return v; }
  bool all() const { return v == 0xffffffffull; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool b, LILY_LOC) {
  uint64_t r = msl_rt::simd_collective<uint64_t>(b, 0, "simd_ballot", line_of(loc),
                                                 [](const bool* in, const uint32_t*, uint32_t present, uint64_t* out) {
    uint64_t m = 0;
    for (int l = 0; l < 32; ++l) if (((present >> l) & 1u) && in[l]) m |= 1ull << l;
    for (int l = 0; l < 32; ++l) out[l] = m;
  });
  return simd_vote(r);
}
inline bool simd_all(bool b, LILY_LOC) {
  return msl_rt::simd_collective<bool>(b, 0, "simd_all", line_of(loc), [](const bool* in, const uint32_t*, uint32_t present, bool* out) {
    bool r = true;
    for (int l = 0; l < 32; ++l) if ((present >> l) & 1u) r = r && in[l];
    for (int l = 0; l < 32; ++l) out[l] = r;
  });
}
inline bool simd_any(bool b, LILY_LOC) {
  return msl_rt::simd_collective<bool>(b, 0, "simd_any", line_of(loc), [](const bool* in, const uint32_t*, uint32_t present, bool* out) {
    bool r = false;
    for (int l = 0; l < 32; ++l) if ((present >> l) & 1u) r = r || in[l];
    for (int l = 0; l < 32; ++l) out[l] = r;
  });
}
// All lanes of a simdgroup are active in this model, so the first active lane is the lowest one.
inline bool simd_is_first() { return msl_rt::tw->cur->at.thread_index_in_simdgroup == (uint)__builtin_ctz(msl_rt::tw->simd[msl_rt::tw->cur->at.simdgroup_index_in_threadgroup].present); }
inline bool simd_is_helper_thread() { return false; }
inline simd_vote simd_active_threads_mask() {
  return simd_vote(msl_rt::tw->simd[msl_rt::tw->cur->at.simdgroup_index_in_threadgroup].present);
}

// ---------------------------------------------------------------------------------------------
// Atomics on device or threadgroup memory (real atomics: groups may run on several OS threads).
enum memory_order { memory_order_relaxed = 0, memory_order_seq_cst = 5 };
template <class T> struct alignas(sizeof(T)) atomic { T value; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

namespace atomic_detail {
template <class P> inline auto* target(const P& p) {
  if constexpr (std::is_pointer_v<P>) return &p->value;
  else return &msl_rt::raw(p)->value;
}
template <class T> using bits_t = std::conditional_t<sizeof(T) == 8, uint64_t, std::conditional_t<sizeof(T) == 4, uint32_t, std::conditional_t<sizeof(T) == 2, uint16_t, uint8_t>>>;
template <class T, class F> inline T rmw(T* addr, F f) {
  using B = bits_t<T>;
  B* b = reinterpret_cast<B*>(addr);
  B old = __atomic_load_n(b, __ATOMIC_RELAXED);
  while (true) {
    T o;
    std::memcpy(&o, &old, sizeof(T));
    T n = f(o);
    B nb;
    std::memcpy(&nb, &n, sizeof(T));
    if (__atomic_compare_exchange_n(b, &old, nb, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return o;
  }
}
}  // namespace atomic_detail

template <class P> inline auto atomic_load_explicit(P obj, memory_order = memory_order_relaxed) {
  auto* a = atomic_detail::target(obj);
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(a)>>;
  using B = atomic_detail::bits_t<T>;
  B b = __atomic_load_n(reinterpret_cast<const B*>(a), __ATOMIC_SEQ_CST);
  T t; std::memcpy(&t, &b, sizeof(T)); return t;
}
template <class P, class V> inline void atomic_store_explicit(P obj, V v, memory_order = memory_order_relaxed) {
  auto* a = atomic_detail::target(obj);
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(a)>>;
  using B = atomic_detail::bits_t<T>;
  T t = T(v); B b; std::memcpy(&b, &t, sizeof(T));
  __atomic_store_n(reinterpret_cast<B*>(a), b, __ATOMIC_SEQ_CST);
}
#define LILY_ATOMIC_RMW(NAME, EXPR)                                                          \
  template <class P, class V> inline auto NAME(P obj, V v, memory_order = memory_order_relaxed) { \
    auto* a = atomic_detail::target(obj);                                                    \
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(a)>>;                          \
    T arg = T(v);                                                                            \
    return atomic_detail::rmw(a, [arg](T o) { return T(EXPR); });                            \
  }
LILY_ATOMIC_RMW(atomic_fetch_add_explicit, o + arg)
LILY_ATOMIC_RMW(atomic_fetch_sub_explicit, o - arg)
LILY_ATOMIC_RMW(atomic_fetch_max_explicit, (o > arg ? o : arg))
LILY_ATOMIC_RMW(atomic_fetch_min_explicit, (o < arg ? o : arg))
LILY_ATOMIC_RMW(atomic_fetch_and_explicit, o & arg)
LILY_ATOMIC_RMW(atomic_fetch_or_explicit, o | arg)
LILY_ATOMIC_RMW(atomic_fetch_xor_explicit, o ^ arg)
LILY_ATOMIC_RMW(atomic_exchange_explicit, arg)

template <class P, class E, class V>
inline bool atomic_compare_exchange_weak_explicit(P obj, E* expected, V desired, memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
  auto* a = atomic_detail::target(obj);
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(a)>>;
  using B = atomic_detail::bits_t<T>;
  T d = T(desired);
  B eb, db;
  std::memcpy(&eb, expected, sizeof(T));
  std::memcpy(&db, &d, sizeof(T));
  bool ok = __atomic_compare_exchange_n(reinterpret_cast<B*>(a), &eb, db, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  if (!ok) std::memcpy(expected, &eb, sizeof(T));
  return ok;
}
template <class P, class E, class V>
inline bool atomic_compare_exchange_strong_explicit(P obj, E* expected, V desired, memory_order s = memory_order_relaxed,
                                                    memory_order f = memory_order_relaxed) {
  return atomic_compare_exchange_weak_explicit(obj, expected, desired, s, f);
}
}  // namespace metal
