// Decode GEMVs of the dense quantised projections (lily_mlx/ops/linear/kernels.py dispatches them):
//   linear_gemv_q4           y[m] = x[m] . W^T for M <= 8 rows of x, W 4-bit affine (MLX's quantised layout)
//   linear_gemv_q4_rms_norm  y[m] = RMSNorm(x[m]) . W^T: the layer's input norm computed as x is read
// used by a decode step's projections (DeltaNet in/out, attention q/k/v/o, lm_head) in place of MLX's
// quantised matmul (and, for the projections right after an RMSNorm, of the norm's launch as well).
// MLX's layout: w [N, K / 8] uint32, eight nibbles per word, low nibble first; one scale and one bias per
// GS weights of a row (scales, biases [N, K / GS]); a weight is scale * q + bias.
//
// Every loop but the one over K carries `#pragma unroll`: without it NVRTC kept the accumulators and the
// weight pieces in local memory (a 192-320 byte stack frame).
//
// Batch invariance: a row of x gets the same arithmetic whatever M and the other rows are (each output
// element is one fixed chain of fp32 operations over K, in the same order for every M).

// @header
#define LINEAR_GEMV_ROWS 4        // output rows per simdgroup (their weights share each x load)
#define LINEAR_GEMV_SIMDGROUPS 2  // simdgroups per threadgroup
#define LINEAR_GEMV_UNROLL 2      // 16-byte weight pieces per row and lane in flight before the math

// Nibble j of a packed word as a float: exactly float((word >> (4 * j)) & 0xf), without an integer
// to float conversion (on NVIDIA through the bridge, a conversion per weight was one of the decode
// GEMVs' costliest instructions). The nibble is masked in place into the mantissa of 2^23
// (0x4b000000), so m = 2^23 + q * 16^p exactly (p = j; nibbles 5..7 are first shifted down 12 bits,
// p = j - 3, so that q * 16^p < 2^23 stays inside the mantissa), and m * 16^-p - 2^(23 - 4p) = q:
// a power-of-two scaling and an exact difference, the same value fused or not. With j a constant
// (unrolled loops) that is one mask and one multiply-add per weight. `exponent` must be
// Q4_EXPONENT; the GEMVs pass it as a value the compiler cannot fold (kept in a register, the mask
// and the or become one instruction on NVIDIA). Shared with kernels/moe/gemm.metal.
#define Q4_EXPONENT 0x4b000000u  // the bits of 2^23
inline float q4_value(uint32_t word, int j, uint32_t exponent = Q4_EXPONENT) {
  const int p = j < 5 ? j : j - 3;
  const uint32_t bits = (j < 5 ? word : word >> 12) & (0xfu << (4 * p));
  const float m = as_type<float>(bits | exponent);
  const float scale = as_type<float>(uint32_t(127 - 4 * p) << 23);       // 16^-p
  const float offset = as_type<float>(uint32_t(127 + 23 - 4 * p) << 23);  // 2^(23 - 4p)
  return m * scale - offset;
}

// Q4_EXPONENT built from a runtime value (n > 0, so its sign bit is clear and this is the constant):
// the compiler cannot fold it, keeps it in a register and merges the mask and the or.
inline uint32_t q4_exponent_unfolded(int n) {
  return Q4_EXPONENT | (uint32_t(n) & 0x80000000u);
}

// Sum over one 16-byte piece (32 consecutive weights of one row, one quantisation group) of q * x:
// the words in order, each word's nibbles in order, one fp32 fma chain.
inline float linear_q4_piece_dot(uint4 w4, const thread float* xv, uint32_t exponent) {
  float dot = 0.0f;
  #pragma unroll
  for (int c = 0; c < 4; ++c) {
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      dot = metal::fma(q4_value(w4[c], j, exponent), xv[8 * c + j], dot);
    }
  }
  return dot;
}

// The pieces p0, p0 + 32, ... (U of them, LINEAR_GEMV_UNROLL by default) of each of a simdgroup's LINEAR_GEMV_ROWS
// weight rows, with their groups' scales and biases, into registers ([u * LINEAR_GEMV_ROWS + r]); a piece past the row
// loads the row's last piece, which the caller skips.
// wrow[r], srow[r]: row r's first piece (in 16-byte pieces of w) and first group.
template <int GS, int U = LINEAR_GEMV_UNROLL, typename PW, typename PS>
inline void linear_gemv_q4_load(PW w, const thread long* wrow, const thread long* srow, PS scales, PS biases, int p0,
                                int pieces, thread uint4* wq, thread float* sc, thread float* bi) {
  const device uint4* pieces_of_w = reinterpret_cast<const device uint4*>(w);
  #pragma unroll
  for (int u = 0; u < U; ++u) {
    const int p = min(p0 + 32 * u, pieces - 1);
    const int g = (32 * p) / GS;
    #pragma unroll
    for (int r = 0; r < LINEAR_GEMV_ROWS; ++r) {
      wq[u * LINEAR_GEMV_ROWS + r] = pieces_of_w[wrow[r] + p];
      sc[u * LINEAR_GEMV_ROWS + r] = float(scales[srow[r] + g]);
      bi[u * LINEAR_GEMV_ROWS + r] = float(biases[srow[r] + g]);
    }
  }
}

// One value of x normalised with stock's RMSNorm rounding points, as the float of its T value: T(w * T(x * inv_rms)).
// The one definition the norm GEMV and the kernels that stage a normalised row (the folds) share.
template <typename T>
inline float linear_rms_normalised(float x, float inv_rms, float w) {
  const float normalised = float(static_cast<T>(x * inv_rms));
  return float(static_cast<T>(w * normalised));
}

// Row b of x [B, K] into threadgroup memory (x4: K / 4 vectors) by a threadgroup's `threads` threads (this one
// `tid`), NORM: normalised as linear_gemv_q4_accumulate normalises it (norm_weight [K], inv_rms from
// linear_gemv_q4_inv_rms), so that a GEMV over the staged row (NORM false) gives the norm GEMV's bits. The caller
// places the barrier after it.
template <typename T, bool NORM, typename PX, typename PN>
inline void linear_gemv_stage_row(PX x, PN norm_weight, float inv_rms, int K, int b, int tid, int threads,
                                  threadgroup vec<T, 4>* x4) {
  const device vec<T, 4>* x_row = reinterpret_cast<const device vec<T, 4>*>(x + long(b) * K);
  const device vec<T, 4>* nw4 = reinterpret_cast<const device vec<T, 4>*>(norm_weight);
  for (int i = tid; i < K / 4; i += threads) {
    vec<T, 4> v = x_row[i];
    if (NORM) {
      const vec<T, 4> nw = nw4[i];
      for (int c = 0; c < 4; ++c) {
        v[c] = static_cast<T>(linear_rms_normalised<T>(float(v[c]), inv_rms, float(nw[c])));
      }
    }
    x4[i] = v;
  }
}

// inv_rms[m] = rsqrt(mean(x[b0 + m]^2) + eps) for the rows b0 .. b0 + M - 1 of x [B, K] (rows past B: 1): each lane's
// pieces in order (an fp32 fma per element), then simd_sum. A row's own arithmetic whatever M and the other rows.
// All 32 lanes call it (one simd_sum per row).
template <typename T, int M, typename PX>
inline void linear_gemv_q4_inv_rms(PX x, float eps, int K, int B, int b0, int lane, thread float* inv_rms) {
  const int pieces = K / 32;
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    inv_rms[m] = 1.0f;
    if (b0 + m < B) {  // uniform over the simdgroup
      const device vec<T, 4>* xr = reinterpret_cast<const device vec<T, 4>*>(x + long(b0 + m) * K);
      float squares = 0.0f;
      for (int p = lane; p < pieces; p += 32) {
        #pragma unroll
        for (int q = 0; q < 8; ++q) {
          const vec<T, 4> v = xr[8 * p + q];
          #pragma unroll
          for (int c = 0; c < 4; ++c) {
            squares = metal::fma(float(v[c]), float(v[c]), squares);
          }
        }
      }
      inv_rms[m] = metal::precise::rsqrt(simd_sum(squares) / float(K) + eps);
    }
  }
}

// The lane's partial sums acc[m * LINEAR_GEMV_ROWS + r] (zeroed here) of the simdgroup's LINEAR_GEMV_ROWS weight rows
// (wrow, srow: each row's first piece and group) against the rows b0 .. b0 + M - 1 of x. Lane l reads the 16-byte
// pieces l, l + 32, ... of each weight row (adjacent lanes, adjacent bytes), U of them per row before using any
// (LINEAR_GEMV_UNROLL by default; the caller has loaded the first ones into wq, sc, bi: linear_gemv_q4_load), and the
// 32 matching x values of each row of x (L1 hits: every simdgroup reads the same x; x4 and norm_weight4 are x [B, K]
// and the norm's weight [K] as 4-element vectors, in device or threadgroup memory). Per piece and (row of x, output):
//   acc = fma(bias, sum(x), fma(scale, sum(q * x), acc))
// NORM: x is the input of an RMSNorm whose output the projection takes (norm_weight [K], inv_rms[m] from
// linear_gemv_q4_inv_rms), each value normalised as it is read with stock's rounding points:
// n = T(w * T(x * inv_rms)).
template <typename T, int M, int GS, bool NORM, int U = LINEAR_GEMV_UNROLL, typename PX, typename PW, typename PS,
          typename PN>
inline void linear_gemv_q4_accumulate(PX x4, PW w, PS scales, PS biases, PN norm_weight4, const thread float* inv_rms,
                                      const thread long* wrow, const thread long* srow, int K, int B, int b0,
                                      int lane, uint32_t exponent, thread uint4* wq, thread float* sc,
                                      thread float* bi, thread float* acc) {
  const int pieces = K / 32;
  #pragma unroll
  for (int i = 0; i < M * LINEAR_GEMV_ROWS; ++i) {
    acc[i] = 0.0f;
  }
  for (int p0 = lane; p0 < pieces; p0 += 32 * U) {
    if (p0 != lane) {
      linear_gemv_q4_load<GS, U>(w, wrow, srow, scales, biases, p0, pieces, wq, sc, bi);
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = p0 + 32 * u;
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        if (p < pieces && b0 + m < B) {
          const long xp = long(b0 + m) * (K / 4) + 8 * p;  // piece p of row b0 + m, in 4-element vectors
          float xv[32];
          #pragma unroll
          for (int q = 0; q < 8; ++q) {
            const vec<T, 4> v = x4[xp + q];
            #pragma unroll
            for (int c = 0; c < 4; ++c) {
              xv[4 * q + c] = float(v[c]);
            }
            if (NORM) {  // the norm's weights of these 4 values (L1 hits, as x)
              const vec<T, 4> nw = norm_weight4[8 * p + q];
              #pragma unroll
              for (int c = 0; c < 4; ++c) {
                xv[4 * q + c] = linear_rms_normalised<T>(xv[4 * q + c], inv_rms[m], float(nw[c]));
              }
            }
          }
          float xsum = 0.0f;
          #pragma unroll
          for (int i = 0; i < 32; ++i) {
            xsum += xv[i];
          }
          #pragma unroll
          for (int r = 0; r < LINEAR_GEMV_ROWS; ++r) {
            const int i = u * LINEAR_GEMV_ROWS + r;
            const int o = m * LINEAR_GEMV_ROWS + r;
            const float dot = linear_q4_piece_dot(wq[i], xv, exponent);
            acc[o] = metal::fma(bi[i], xsum, metal::fma(sc[i], dot, acc[o]));
          }
        }
      }
    }
  }
}

// The layer's input row b of x [B, K] staged in threadgroup memory (x4 [K / 4]) for GEMVs over it: x itself, or with
// NORM its RMSNorm (norm_weight [K], eps[0]) as linear_gemv_q4_rms_norm computes it (linear_gemv_q4_inv_rms, then
// linear_gemv_stage_row). All threads of the threadgroup call it (thread tid of threads; lane: its simdgroup lane);
// the caller places the barrier after it.
template <typename T, bool NORM, typename PX, typename PN, typename PE>
inline void linear_gemv_stage_input(PX x, PN norm_weight, PE eps, int K, int B, int b, int lane, int tid, int threads,
                                    threadgroup vec<T, 4>* x4) {
  float inv_rms[1] = {1.0f};
  if (NORM) {
    linear_gemv_q4_inv_rms<T, 1>(x, eps[0], K, B, b, lane, inv_rms);
  }
  linear_gemv_stage_row<T, NORM>(x, norm_weight, inv_rms[0], K, b, tid, threads, x4);
}

// The LINEAR_GEMV_ROWS weight rows wrow / srow of W (4-bit, groups of GS) times a staged row x4 [K / 4]
// (linear_gemv_stage_input) by the row GEMV's arithmetic, each rounded once to T as the GEMV writes it, into out[slot[r]]
// (threadgroup memory, fp32 of the T value; slot -1: a padding row, not stored). All 32 lanes of the simdgroup call it.
// What a kernel that computes a projection's rows itself (the folds) takes from the GEMV.
template <typename T, int GS, int U, typename PW, typename PS>
inline void linear_gemv_q4_staged_rows(const threadgroup vec<T, 4>* x4, PW w, PS scales, PS biases,
                                       const thread long* wrow, const thread long* srow, int K, int lane,
                                       uint32_t exponent, const thread int* slot, threadgroup float* out) {
  uint4 wq[U * LINEAR_GEMV_ROWS];
  float sc[U * LINEAR_GEMV_ROWS];
  float bi[U * LINEAR_GEMV_ROWS];
  linear_gemv_q4_load<GS, U>(w, wrow, srow, scales, biases, lane, K / 32, wq, sc, bi);
  float acc[LINEAR_GEMV_ROWS];
  const float no_norm[1] = {1.0f};
  linear_gemv_q4_accumulate<T, 1, GS, false, U>(x4, w, scales, biases, x4, no_norm, wrow, srow, K, 1, 0, lane,
                                                exponent, wq, sc, bi, acc);
  #pragma unroll
  for (int r = 0; r < LINEAR_GEMV_ROWS; ++r) {
    const float total = simd_sum(acc[r]);
    if (lane == r && slot[r] >= 0) {
      out[slot[r]] = static_cast<float>(static_cast<T>(total));
    }
  }
}

// One simdgroup's LINEAR_GEMV_ROWS outputs n0.. for the rows b0 .. b0 + M - 1 of x (both kernels' body), each the lanes'
// partial sums (linear_gemv_q4_accumulate) added in simd_sum's order and rounded once to T.
// NORM: the sum of squares is this file's own (linear_gemv_q4_inv_rms): n may differ from MLX's rms_norm in the last
// bit where the sum rounds differently; it is the same for a row whatever M and the other rows.
// (The pointers' types are template parameters: MLX passes an input of fewer than 8 elements in constant memory.)
template <typename T, int M, int GS, bool NORM, typename PX, typename PW, typename PS, typename PN, typename PY>
inline void linear_gemv_q4_simdgroup(PX x, PW w, PS scales, PS biases, PN norm_weight, float eps, PY y, int K, int N,
                                     int B, int n0, int b0, int lane) {
  long wrow[LINEAR_GEMV_ROWS];  // each row's first 16-byte piece
  long srow[LINEAR_GEMV_ROWS];  // and first group
  #pragma unroll
  for (int r = 0; r < LINEAR_GEMV_ROWS; ++r) {
    const long n = long(min(n0 + r, N - 1));  // rows past N read row N - 1 and are not written
    wrow[r] = n * (K / 32);
    srow[r] = n * (K / GS);
  }
  // The first pieces' loads go out before the norm's sum of squares (which ends in a simd_sum the compiler does not
  // move loads across), so that the weights' trip to memory overlaps it.
  uint4 wq[LINEAR_GEMV_UNROLL * LINEAR_GEMV_ROWS];
  float sc[LINEAR_GEMV_UNROLL * LINEAR_GEMV_ROWS];
  float bi[LINEAR_GEMV_UNROLL * LINEAR_GEMV_ROWS];
  linear_gemv_q4_load<GS>(w, wrow, srow, scales, biases, lane, K / 32, wq, sc, bi);
  float inv_rms[M];
  if (NORM) {
    linear_gemv_q4_inv_rms<T, M>(x, eps, K, B, b0, lane, inv_rms);
  }
  float acc[M * LINEAR_GEMV_ROWS];
  linear_gemv_q4_accumulate<T, M, GS, NORM>(reinterpret_cast<const device vec<T, 4>*>(x), w, scales, biases,
                                            reinterpret_cast<const device vec<T, 4>*>(norm_weight), inv_rms, wrow, srow,
                                            K, B, b0, lane, q4_exponent_unfolded(N), wq, sc, bi, acc);
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    #pragma unroll
    for (int r = 0; r < LINEAR_GEMV_ROWS; ++r) {
      const float total = simd_sum(acc[m * LINEAR_GEMV_ROWS + r]);
      if (lane == r && n0 + r < N && b0 + m < B) {
        y[long(b0 + m) * N + n0 + r] = static_cast<T>(total);
      }
    }
  }
}

// @kernel linear_gemv_q4
// grid (ceil(N / (LINEAR_GEMV_SIMDGROUPS * LINEAR_GEMV_ROWS)) * LINEAR_GEMV_SIMDGROUPS * 32, ceil(B / M), 1),
// threadgroup (LINEAR_GEMV_SIMDGROUPS * 32, 1, 1); template T (activation dtype), M (rows of x per
// threadgroup, 1..8), GS (group size: 32, 64 or 128). params: [K, N, B] (K a multiple of 32).
// x [B, K] T; w [N, K / 8] uint32; scales, biases [N, K / GS] T. y [B, N] T.
// A simdgroup computes LINEAR_GEMV_ROWS consecutive outputs for the M rows of x of its threadgroup's
// y index (linear_gemv_q4_simdgroup).
{
  const int n0 = (int(threadgroup_position_in_grid.x) * LINEAR_GEMV_SIMDGROUPS + int(simdgroup_index_in_threadgroup)) *
                 LINEAR_GEMV_ROWS;
  if (n0 >= N) {
    return;  // the whole simdgroup leaves (no barrier in this kernel)
  }
  linear_gemv_q4_simdgroup<T, M, GS, false>(x, w, scales, biases, x, 0.0f, y, K, N, B, n0,
                                            int(threadgroup_position_in_grid.y) * M, int(thread_index_in_simdgroup));
}

// @kernel linear_gemv_q4_rms_norm
// linear_gemv_q4 of RMSNorm(x): grid, threadgroup, template and params as linear_gemv_q4's; x [B, K] T is the
// norm's input, norm_weight [K] T its weight, eps [1] fp32 its epsilon. Every simdgroup computes the sum of
// squares of its rows of x itself (x is 4 KB at K = 2048, read from L1/L2), so the norm needs no launch and
// no grid-wide dependency of its own.
{
  const int n0 = (int(threadgroup_position_in_grid.x) * LINEAR_GEMV_SIMDGROUPS + int(simdgroup_index_in_threadgroup)) *
                 LINEAR_GEMV_ROWS;
  if (n0 >= N) {
    return;  // the whole simdgroup leaves (no barrier in this kernel)
  }
  linear_gemv_q4_simdgroup<T, M, GS, true>(x, w, scales, biases, norm_weight, eps[0], y, K, N, B, n0,
                                           int(threadgroup_position_in_grid.y) * M, int(thread_index_in_simdgroup));
}
