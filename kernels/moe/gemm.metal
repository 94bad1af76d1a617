// MoE grouped GEMMs over the routing block map (lily_mlx/ops/moe/kernels.py dispatches them; every
// call size, prefill and decode, where the kernels apply).
//   moe_gemm_gate_up_swiglu   h[slot] = silu(x[token] . Wg[e]^T) * (x[token] . Wu[e]^T)
//   moe_gemm_down             y[slot] = h[slot] . Wd[e]^T
//   moe_dequant_experts_q4    the fused_dequant=off ablation: experts dequantised to [E, O, K] first
//   moe_combine_weighted_rows out[token] = sum_j score[token, j] * y[slot of (token, j)] (fused_combine)
//                             + gate[token] * y[shared slot of token] (shared expert, fused_expert_down)
// The shared expert (fused_expert_down), of width S = m * I (m >= 1 chunks of the experts' width I),
// is m more experts of the GEMMs: chunk c has expert id E + c, its rows are slots A + c * N + n
// (chunk-major after the A routed slots, token order within a chunk), and reads rows c * I .. of the
// shared gate/up weights and columns c * I .. of the shared down weights (the *_s arrays, 4-bit like
// the experts'). Each chunk row then gets the same per-element arithmetic as a routed row, in any
// block layout; the combine adds the m chunk rows, gated.
// Weights either 4-bit affine group-64 (uint32 words of 8 nibbles, low nibble first; one scale and
// one bias per 64 weights; w = scale * q + bias), dequantised one 32 x 64 tile at a time into
// threadgroup memory, or already dequantised [E, O, K]. simdgroup_matrix<float, 8, 8>, fp32
// accumulation, output in the activation type.
//
// Tiles: a threadgroup is 4 simdgroups (128 threads) computing one block of TILE rows (16 or 32,
// from the block map) x 32 output columns, stepping K by 64 (one quantisation group). 32-row tiles:
// simdgroups in a 2 x 2 layout of 16 x 16; 16-row tiles: 1 x 4 of 16 x 8.
//
// Batch invariance (keep it): a row's results must not depend on the other rows of the call, yet the
// tile size and a row's place in its tile do (they follow the rows per expert). So every output
// element has one fp32 accumulator that takes the same 8 x 8 multiply-accumulates in the same K
// order (K step 64, then 8 at a time) in either tile, from the same operand values (x converted
// from T, w = scale * q + bias, or the dequantised array); SwiGLU, the roundings and the combine are
// per element / per token. No split-K, no reduction across rows or tiles.

// @header
#define MOE_BN 32         // output columns per threadgroup
#define MOE_BK 64         // K step = quantisation group size
#define MOE_MAX_ROWS 32   // largest tile rows
#define MOE_THREADS 128   // 4 simdgroups

// Weight tile loaders: fill wt[k][n] (k-major, MOE_BK x MOE_BN floats) for output columns
// [n0, n0 + 32) and K range [k0, k0 + 64) of expert e. O, K: the weight's output and input dims.

// One 4-bit weight: w = scale * q + bias. The tile loader and the decode GEMVs both use this one
// expression, so a weight has the same float value (and rounding) on either path.
inline float moe_dequant_q4(uint32_t word, int j, float scale, float bias) {
  return scale * float((word >> (4 * j)) & 0xfu) + bias;
}

// 4-bit affine, group 64: one uint32 word holds 8 consecutive K values, low nibble first.
template <typename S>
inline void moe_load_weight_tile(
    const device uint32_t* w, const device S* scales, const device S* biases,
    threadgroup float* wt, int e, int n0, int k0, int O, int K, uint tid) {
  const int words_per_row = K / 8;
  const int groups_per_row = K / 64;
  // 32 columns x 8 words per tile: 256 words, 2 per thread.
  for (int i = int(tid); i < MOE_BN * (MOE_BK / 8); i += MOE_THREADS) {
    int n = i / (MOE_BK / 8);
    int wi = i % (MOE_BK / 8);
    long row = long(e) * O + (n0 + n);
    uint32_t word = w[row * words_per_row + (k0 / 8) + wi];
    float scale = float(scales[row * groups_per_row + k0 / 64]);
    float bias = float(biases[row * groups_per_row + k0 / 64]);
    for (int j = 0; j < 8; ++j) {
      wt[(wi * 8 + j) * MOE_BN + n] = moe_dequant_q4(word, j, scale, bias);
    }
  }
}

// Already dequantised weights [E, O, K] (the fused_dequant=off ablation).
template <typename W, typename S>
inline void moe_load_weight_tile(
    const device W* w, const device S* scales, const device S* biases,
    threadgroup float* wt, int e, int n0, int k0, int O, int K, uint tid) {
  for (int i = int(tid); i < MOE_BN * MOE_BK; i += MOE_THREADS) {
    int n = i / MOE_BK;
    int kk = i % MOE_BK;
    wt[kk * MOE_BN + n] = float(w[(long(e) * O + (n0 + n)) * K + k0 + kk]);
  }
}

// Activation tile xt[r][k] (rows x 64 floats) of a block; rows past `rows` are zero.
// GATHER: row r is token sorted_rows[first + r] / top_k of x, or token token_base + r when
// token_base >= 0 (shared-expert rows, in token order); else row first + r of x.
template <bool GATHER, typename T>
inline void moe_load_rows_tile(
    const device T* x, const device int* sorted_rows, threadgroup float* xt,
    int first, int rows, int tile_rows, int top_k, int k0, int K, uint tid, int token_base = -1) {
  for (int i = int(tid); i < tile_rows * MOE_BK; i += MOE_THREADS) {
    int r = i / MOE_BK;
    int kk = i % MOE_BK;
    float v = 0.0f;
    if (r < rows) {
      long src = !GATHER ? long(first + r)
                 : token_base >= 0 ? long(token_base + r) : long(sorted_rows[first + r] / top_k);
      v = float(x[src * K + k0 + kk]);
    }
    xt[r * MOE_BK + kk] = v;
  }
}

// acc[i][j] += xt[rows of i] . wt[:, cols of j] over one 64-wide K step, for this simdgroup's
// 16 x (8 * NJ) sub-tile at (row0, col0).
template <int NJ>
inline void moe_mma_step(
    thread simdgroup_matrix<float, 8, 8> (&acc)[2][2], const threadgroup float* xt,
    const threadgroup float* wt, int row0, int col0) {
  for (int kk = 0; kk < MOE_BK; kk += 8) {
    simdgroup_matrix<float, 8, 8> a0, a1, b0, b1;
    simdgroup_load(a0, xt + row0 * MOE_BK + kk, MOE_BK);
    simdgroup_load(a1, xt + (row0 + 8) * MOE_BK + kk, MOE_BK);
    simdgroup_load(b0, wt + kk * MOE_BN + col0, MOE_BN);
    simdgroup_multiply_accumulate(acc[0][0], a0, b0, acc[0][0]);
    simdgroup_multiply_accumulate(acc[1][0], a1, b0, acc[1][0]);
    if (NJ == 2) {
      simdgroup_load(b1, wt + kk * MOE_BN + col0 + 8, MOE_BN);
      simdgroup_multiply_accumulate(acc[0][1], a0, b1, acc[0][1]);
      simdgroup_multiply_accumulate(acc[1][1], a1, b1, acc[1][1]);
    }
  }
}

// Where simdgroup sg works in a block of tile_rows rows: (row0, col0) and 8-column fragments NJ.
inline void moe_simdgroup_origin(int tile_rows, uint sg, thread int& row0, thread int& col0) {
  if (tile_rows == 32) {  // 2 x 2 simdgroups of 16 x 16
    row0 = int(sg / 2) * 16;
    col0 = int(sg % 2) * 16;
  } else {                // 1 x 4 simdgroups of 16 x 8
    row0 = 0;
    col0 = int(sg) * 8;
  }
}

inline void moe_store_acc(
    thread simdgroup_matrix<float, 8, 8> (&acc)[2][2], threadgroup float* out, int ld,
    int row0, int col0, int nj) {
  simdgroup_store(acc[0][0], out + row0 * ld + col0, ld);
  simdgroup_store(acc[1][0], out + (row0 + 8) * ld + col0, ld);
  if (nj == 2) {
    simdgroup_store(acc[0][1], out + row0 * ld + col0 + 8, ld);
    simdgroup_store(acc[1][1], out + (row0 + 8) * ld + col0 + 8, ld);
  }
}

// Decode GEMV (switch row_gemv): one output element per thread, one fp32 accumulator taking
// acc += x[k] * w[k] for k = 0 .. K - 1 in order: exactly what the GEMMs' 8 x 8 multiply-accumulates
// do for that element (K step 64, then 8 at a time, each in k order), so a row gets the same bits
// from a GEMV and from a GEMM tile (batch invariance). xs: the row, as floats, in threadgroup memory.
template <typename S>
inline float moe_gemv_q4_dot(const device uint32_t* w, const device S* scales, const device S* biases,
                             const threadgroup float* xs, int K) {
  float acc = 0.0f;
  for (int g = 0; g < K / 64; ++g) {
    const float scale = float(scales[g]);
    const float bias = float(biases[g]);
    for (int wi = 0; wi < 8; ++wi) {
      const uint32_t word = w[g * 8 + wi];
      for (int j = 0; j < 8; ++j) {
        acc += xs[g * 64 + wi * 8 + j] * moe_dequant_q4(word, j, scale, bias);
      }
    }
  }
  return acc;
}

// Stage one activation row (K values of type T) as floats into threadgroup memory.
template <typename T>
inline void moe_stage_row(const device T* row, threadgroup float* xs, int K, uint tid, uint threads) {
  for (int k = int(tid); k < K; k += int(threads)) {
    xs[k] = float(row[k]);
  }
}

#define MOE_GEMV_MAX_K 4096  // threadgroup row buffer (16 KB); the host checks

// @kernel moe_gemm_gate_up_swiglu
// grid (I / 32 * 128, max_blocks, 1), threadgroup (128, 1, 1). params: [top_k, D, I, E, A, N].
// x [N, D] tokens; sorted_rows [A]; blocks [max_blocks, 4]; w_gate, w_up: [E, I, D / 8] uint32
// (+ scales/biases [E, I, D / 64]) or dequantised [E, I, D]; w_gate_s, w_up_s: the shared expert's
// [m * I, D / 8] uint32 (+ scales/biases), read by blocks of experts E + c. h [A (+ m * N), I]: rows
// in slot order.
threadgroup float xt[MOE_MAX_ROWS * MOE_BK];
threadgroup float wg[MOE_BK * MOE_BN];
threadgroup float wu[MOE_BK * MOE_BN];
const uint tid = thread_index_in_threadgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int n0 = int(threadgroup_position_in_grid.x) * MOE_BN;
const int blk = int(threadgroup_position_in_grid.y);
const int e = blocks[4 * blk + 0];
const int first = blocks[4 * blk + 1];
const int rows = blocks[4 * blk + 2];
const int tile_rows = blocks[4 * blk + 3];
if (rows == 0) {
  return;  // padding entry of the block map: the whole threadgroup leaves
}
int row0, col0;
moe_simdgroup_origin(tile_rows, sg, row0, col0);
const int nj = tile_rows == 32 ? 2 : 1;
simdgroup_matrix<float, 8, 8> acc_g[2][2];
simdgroup_matrix<float, 8, 8> acc_u[2][2];
for (int i = 0; i < 2; ++i) {
  for (int j = 0; j < 2; ++j) {
    acc_g[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    acc_u[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
}
const int chunk = e - E;  // >= 0: a chunk of the shared expert
for (int k0 = 0; k0 < D; k0 += MOE_BK) {
  moe_load_rows_tile<true>(x, sorted_rows, xt, first, rows, tile_rows, top_k, k0, D, tid,
                           chunk >= 0 ? first - A - chunk * N : -1);
  if (chunk >= 0) {
    moe_load_weight_tile(w_gate_s, scales_gate_s, biases_gate_s, wg, chunk, n0, k0, I, D, tid);
    moe_load_weight_tile(w_up_s, scales_up_s, biases_up_s, wu, chunk, n0, k0, I, D, tid);
  } else {
    moe_load_weight_tile(w_gate, scales_gate, biases_gate, wg, e, n0, k0, I, D, tid);
    moe_load_weight_tile(w_up, scales_up, biases_up, wu, e, n0, k0, I, D, tid);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (nj == 2) {
    moe_mma_step<2>(acc_g, xt, wg, row0, col0);
    moe_mma_step<2>(acc_u, xt, wu, row0, col0);
  } else {
    moe_mma_step<1>(acc_g, xt, wg, row0, col0);
    moe_mma_step<1>(acc_u, xt, wu, row0, col0);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
// Gate and up results side by side in xt ([rows][64]: gate in columns 0..31, up in 32..63).
moe_store_acc(acc_g, xt, MOE_BK, row0, col0, nj);
moe_store_acc(acc_u, xt, MOE_BK, row0, MOE_BN + col0, nj);
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int i = int(tid); i < tile_rows * MOE_BN; i += MOE_THREADS) {
  int r = i / MOE_BN;
  int c = i % MOE_BN;
  if (r < rows) {
    float g = xt[r * MOE_BK + c];
    float u = xt[r * MOE_BK + MOE_BN + c];
    h[long(first + r) * I + n0 + c] = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);
  }
}

// @kernel moe_gemm_down
// grid (D / 32 * 128, max_blocks, 1), threadgroup (128, 1, 1). params: [I, D, E, Is].
// h [A (+ N), I] rows in slot order; w_down [E, D, I / 8] uint32 (+ scales/biases [E, D, I / 64]) or
// dequantised [E, D, I]; w_down_s the shared expert's [D, Is / 8] (Is = m * I; blocks of expert E + c
// read its columns c * I ..). y [A (+ m * N), D] rows in slot order.
threadgroup float xt[MOE_MAX_ROWS * MOE_BK];
threadgroup float wt[MOE_BK * MOE_BN];
const uint tid = thread_index_in_threadgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int n0 = int(threadgroup_position_in_grid.x) * MOE_BN;
const int blk = int(threadgroup_position_in_grid.y);
const int e = blocks[4 * blk + 0];
const int first = blocks[4 * blk + 1];
const int rows = blocks[4 * blk + 2];
const int tile_rows = blocks[4 * blk + 3];
if (rows == 0) {
  return;  // padding entry of the block map: the whole threadgroup leaves
}
int row0, col0;
moe_simdgroup_origin(tile_rows, sg, row0, col0);
const int nj = tile_rows == 32 ? 2 : 1;
simdgroup_matrix<float, 8, 8> acc[2][2];
for (int i = 0; i < 2; ++i) {
  for (int j = 0; j < 2; ++j) {
    acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
}
for (int k0 = 0; k0 < I; k0 += MOE_BK) {
  moe_load_rows_tile<false>(h, blocks, xt, first, rows, tile_rows, 1, k0, I, tid);
  if (e >= E) {  // chunk e - E of the shared expert: its K range within the shared rows
    moe_load_weight_tile(w_down_s, scales_down_s, biases_down_s, wt, 0, n0, (e - E) * I + k0, D, Is, tid);
  } else {
    moe_load_weight_tile(w_down, scales_down, biases_down, wt, e, n0, k0, D, I, tid);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (nj == 2) {
    moe_mma_step<2>(acc, xt, wt, row0, col0);
  } else {
    moe_mma_step<1>(acc, xt, wt, row0, col0);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
moe_store_acc(acc, xt, MOE_BN, row0, col0, nj);
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int i = int(tid); i < tile_rows * MOE_BN; i += MOE_THREADS) {
  int r = i / MOE_BN;
  int c = i % MOE_BN;
  if (r < rows) {
    y[long(first + r) * D + n0 + c] = static_cast<T>(xt[r * MOE_BN + c]);
  }
}

// @kernel moe_dequant_experts_q4
// grid (O * K / 8, E, 1) (a multiple of 256), threadgroup (256, 1, 1). params: [O, K].
// w [E, O, K / 8] uint32, scales/biases [E, O, K / 64]; counts [E]: experts with no rows are skipped
// (their rows of w_out stay unwritten, no GEMM block reads them). w_out [E, O, K].
const int e = int(threadgroup_position_in_grid.y);
const long word = long(thread_position_in_grid.x);  // word index within the expert
if (counts[e] > 0) {
  const long row = long(e) * O + word / (K / 8);
  const long col = (word % (K / 8)) * 8;
  const uint32_t bits = w[long(e) * O * (K / 8) + word];
  const float scale = float(scales[row * (K / 64) + col / 64]);
  const float bias = float(biases[row * (K / 64) + col / 64]);
  for (int j = 0; j < 8; ++j) {
    w_out[row * K + col + j] = static_cast<T>(scale * float((bits >> (4 * j)) & 0xfu) + bias);
  }
}

// @kernel moe_combine_weighted_rows
// grid (ceil(D / 4 / 128) * 128, N, 1), threadgroup (128, 1, 1). params: [k, D, A, shared_chunks]
// (D % 4 == 0). y [A (+ m * N), D] the down GEMM's rows in slot order; slot_of_row [A]: slot of
// assignment a = token * k + j; scores [N, k] routing weights; gate [N] fp32 the shared expert's
// sigmoid gate (m = shared_chunks > 0: its chunk rows of token n are slots A + c * N + n). out [N, D]:
// each token's k rows read straight from slot order, weighted and summed in fp32 (then the gated
// shared chunks), rounded once (no [A, D] gather or product arrays in between).
const int d0 = int(thread_position_in_grid.x) * 4;
const long n = long(thread_position_in_grid.y);
if (d0 < D) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j = 0; j < k; ++j) {
    const float w = float(scores[n * k + j]);
    const long src = long(slot_of_row[n * k + j]) * D + d0;
    for (int c = 0; c < 4; ++c) {
      acc[c] += w * float(y[src + c]);
    }
  }
  const long num_tokens = long(threads_per_grid.y);
  for (int chunk = 0; chunk < shared_chunks; ++chunk) {
    const float g = gate[n];
    const long src = (long(A) + chunk * num_tokens + n) * D + d0;
    for (int c = 0; c < 4; ++c) {
      acc[c] += g * float(y[src + c]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    out[n * D + d0 + c] = static_cast<T>(acc[c]);
  }
}

// @kernel moe_gemv_gate_up_swiglu
// grid (I, n_blocks, 1), threadgroup (TG, 1, 1) with I % TG == 0. params: [top_k, D, I, E, A, N].
// The decode form of moe_gemm_gate_up_swiglu for one-row blocks (expert, slot, 1, tile): same
// inputs, same h, the same bits per element. Rows of shared chunk c (expert id E + c) are token
// slot - A - c * N; routed rows are token sorted_rows[slot] / top_k.
threadgroup float xs[MOE_GEMV_MAX_K];
const uint tid = thread_index_in_threadgroup;
const int blk = int(threadgroup_position_in_grid.y);
const int e = blocks[4 * blk + 0];
const int slot = blocks[4 * blk + 1];
if (blocks[4 * blk + 2] == 0) {
  return;  // padding entry
}
const bool shared = e >= E;
const long token = shared ? long(slot - A - (e - E) * N) : long(sorted_rows[slot] / top_k);
moe_stage_row(x + token * D, xs, D, tid, threads_per_threadgroup.x);
threadgroup_barrier(mem_flags::mem_threadgroup);
const int col = int(thread_position_in_grid.x);
const long row = long(shared ? e - E : e) * I + col;
const device uint32_t* wg_row = (shared ? w_gate_s : w_gate) + row * (D / 8);
const device uint32_t* wu_row = (shared ? w_up_s : w_up) + row * (D / 8);
const long srow = row * (D / 64);
const float g = shared ? moe_gemv_q4_dot(wg_row, scales_gate_s + srow, biases_gate_s + srow, xs, D)
                       : moe_gemv_q4_dot(wg_row, scales_gate + srow, biases_gate + srow, xs, D);
const float u = shared ? moe_gemv_q4_dot(wu_row, scales_up_s + srow, biases_up_s + srow, xs, D)
                       : moe_gemv_q4_dot(wu_row, scales_up + srow, biases_up + srow, xs, D);
h[long(slot) * I + col] = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);

// @kernel moe_gemv_down
// grid (D, n_blocks, 1), threadgroup (TG, 1, 1) with D % TG == 0. params: [I, D, E, Is].
// The decode form of moe_gemm_down for one-row blocks: y[slot] = h[slot] . Wd[e]^T, same bits.
threadgroup float xs[MOE_GEMV_MAX_K];
const uint tid = thread_index_in_threadgroup;
const int blk = int(threadgroup_position_in_grid.y);
const int e = blocks[4 * blk + 0];
const int slot = blocks[4 * blk + 1];
if (blocks[4 * blk + 2] == 0) {
  return;  // padding entry
}
moe_stage_row(h + long(slot) * I, xs, I, tid, threads_per_threadgroup.x);
threadgroup_barrier(mem_flags::mem_threadgroup);
const int col = int(thread_position_in_grid.x);
float acc;
if (e >= E) {  // chunk e - E of the shared expert: columns (e - E) * I .. of its row col
  const long words = long(col) * (Is / 8) + (e - E) * (I / 8);
  const long groups = long(col) * (Is / 64) + (e - E) * (I / 64);
  acc = moe_gemv_q4_dot(w_down_s + words, scales_down_s + groups, biases_down_s + groups, xs, I);
} else {
  const long row = long(e) * D + col;
  acc = moe_gemv_q4_dot(w_down + row * (I / 8), scales_down + row * (I / 64), biases_down + row * (I / 64), xs, I);
}
y[long(slot) * D + col] = static_cast<T>(acc);
