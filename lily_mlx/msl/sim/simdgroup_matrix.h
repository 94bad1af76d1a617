// Metal-compatibility prelude, part 6: simdgroup_matrix<T, 8, 8>. Each lane holds its two elements
// (Apple's fragment layout, as thread_elements() exposes it); products are simdgroup collectives
// that gather the 32 lanes' fragments, multiply in float (k ascending, no fused multiply-add) and
// scatter the rounded result back.
#pragma once
#include "simd.h"

namespace metal {

template <class T, int Cols, int Rows> struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "simulator: only simdgroup_matrix<T, 8, 8> is supported");
  vec<T, 2> e;  // this lane's elements (row r, columns c and c + 1)
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T v) { e[0] = v; e[1] = v; }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

namespace sgm_detail {
// Row and first column of lane `l`'s two elements in an 8x8 fragment.
inline void coord(uint l, int& r, int& c) {
  uint q = l / 4;
  r = (int)((q & 4) + ((l / 2) % 4));
  c = (int)((q & 2) * 2 + (l % 2) * 2);
}
inline uint lane() { return msl_rt::tw->cur->at.thread_index_in_simdgroup; }
inline void require_full_simdgroup(const char* what) {
  msl_rt::Worker* w = msl_rt::tw;
  if (w->simd[w->cur->at.simdgroup_index_in_threadgroup].present != 0xffffffffu)
    msl_rt::fail(what, "simdgroup_matrix operations need a full simdgroup of 32 threads");
}
template <class T> struct Frag3 { vec<T, 2> a, b, c; };
}  // namespace sgm_detail

template <class T, int C, int R> inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
  return simdgroup_matrix<T, C, R>(v);
}

template <class T, int C, int R, class P>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, P src, ulong elements_per_row = C, ulong2 origin = ulong2(0, 0),
                           bool transpose = false) {
  int r, c;
  sgm_detail::coord(sgm_detail::lane(), r, c);
  for (int i = 0; i < 2; ++i) {
    long row = r, col = c + i;
    if (transpose) { long t = row; row = col; col = t; }
    d.e[i] = T(src[(long)((origin.y + row) * elements_per_row + origin.x + col)]);
  }
}
template <class T, int C, int R, class P>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& m, P dst, ulong elements_per_row = C, ulong2 origin = ulong2(0, 0),
                            bool transpose = false) {
  int r, c;
  sgm_detail::coord(sgm_detail::lane(), r, c);
  for (int i = 0; i < 2; ++i) {
    long row = r, col = c + i;
    if (transpose) { long t = row; row = col; col = t; }
    dst[(long)((origin.y + row) * elements_per_row + origin.x + col)] = m.e[i];
  }
}

template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c,
                                          LILY_LOC) {
  sgm_detail::require_full_simdgroup("simdgroup_multiply_accumulate");
  struct In { vec<TA, 2> a; vec<TB, 2> b; vec<TC, 2> c; };
  In in{a.e, b.e, c.e};
  d.e = msl_rt::simd_collective<vec<TD, 2>>(in, 0, "simdgroup_multiply_accumulate", line_of(loc),
      [](const In* frag, const uint32_t*, uint32_t, vec<TD, 2>* out) {
    float A[8][8], B[8][8], Cm[8][8];
    for (uint l = 0; l < 32; ++l) {
      int r, c0;
      sgm_detail::coord(l, r, c0);
      for (int i = 0; i < 2; ++i) {
        A[r][c0 + i] = (float)frag[l].a[i];
        B[r][c0 + i] = (float)frag[l].b[i];
        Cm[r][c0 + i] = (float)frag[l].c[i];
      }
    }
    for (uint l = 0; l < 32; ++l) {
      int r, c0;
      sgm_detail::coord(l, r, c0);
      for (int i = 0; i < 2; ++i) {
        float acc = Cm[r][c0 + i];
        for (int k = 0; k < 8; ++k) acc += A[r][k] * B[k][c0 + i];
        out[l][i] = TD(acc);
      }
    }
  });
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b, LILY_LOC) {
  simdgroup_matrix<TD, 8, 8> zero(TD(0));
  simdgroup_multiply_accumulate(d, a, b, zero, loc);
}
}  // namespace metal
