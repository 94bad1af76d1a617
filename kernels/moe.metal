// MoE prefill kernels for Qwen3.5/3.6 sparse MoE blocks (lily_mlx/ops/moe_kernels.py dispatches them).
//
// Routing bookkeeping (one prompt chunk, no host synchronisation; integer results are exact and
// deterministic, no atomics):
//   moe_route_histogram_i32   per chunk of CHUNK assignments: rows per expert and each assignment's
//                             rank among the chunk's earlier assignments to the same expert
//   moe_route_scan_i32        per-expert totals, exclusive prefix scan -> offsets, per-chunk offsets
//   moe_route_scatter_i32     slot of every assignment (expert-contiguous, stable) and its inverse
//   moe_route_block_map_i32   the (expert, first slot, rows, tile rows) blocks the GEMMs process
// Grouped GEMMs over the block map (simdgroup_matrix<float, 8, 8>, fp32 accumulation):
//   moe_gemm_gate_up_swiglu   h[slot] = silu(x[token] . Wg[e]^T) * (x[token] . Wu[e]^T)
//   moe_gemm_down             y[slot] = h[slot] . Wd[e]^T
//   Weights either 4-bit affine group-64 (uint32 words of 8 nibbles, low nibble first; one scale and
//   one bias per 64 weights; w = scale * q + bias), dequantised one 32 x 64 tile at a time into
//   threadgroup memory, or already dequantised (moe_dequant_experts_q4 output) [E, O, K].
//
// Tiles: a threadgroup is 4 simdgroups (128 threads) computing one block of TILE rows (16 or 32,
// from the block map) x 32 output columns, stepping K by 64 (one quantisation group). 32-row tiles:
// simdgroups in a 2 x 2 layout of 16 x 16; 16-row tiles: 1 x 4 of 16 x 8.

// @header
#define MOE_BN 32         // output columns per threadgroup
#define MOE_BK 64         // K step = quantisation group size
#define MOE_MAX_ROWS 32   // largest tile rows
#define MOE_THREADS 128   // 4 simdgroups

// Weight tile loaders: fill wt[k][n] (k-major, MOE_BK x MOE_BN floats) for output columns
// [n0, n0 + 32) and K range [k0, k0 + 64) of expert e. O, K: the weight's output and input dims.

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
      float q = float((word >> (4 * j)) & 0xfu);
      wt[(wi * 8 + j) * MOE_BN + n] = scale * q + bias;
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
// GATHER: row r is token sorted_rows[first + r] / top_k of x; else row first + r of x.
template <bool GATHER, typename T>
inline void moe_load_rows_tile(
    const device T* x, const device int* sorted_rows, threadgroup float* xt,
    int first, int rows, int tile_rows, int top_k, int k0, int K, uint tid) {
  for (int i = int(tid); i < tile_rows * MOE_BK; i += MOE_THREADS) {
    int r = i / MOE_BK;
    int kk = i % MOE_BK;
    float v = 0.0f;
    if (r < rows) {
      long src = GATHER ? long(sorted_rows[first + r] / top_k) : long(first + r);
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

// @kernel moe_route_histogram_i32
// grid (n_chunks * CHUNK, 1, 1), threadgroup (CHUNK, 1, 1). params: [A, E, n_chunks].
// inds [A] expert ids; chunk_counts [n_chunks, E]: rows per expert in each chunk;
// local_rank [A]: assignments to the same expert earlier in the same chunk.
threadgroup int chunk_experts[CHUNK];
const int A = params[0];
const int E = params[1];
const uint t = thread_position_in_threadgroup.x;
const int chunk = int(threadgroup_position_in_grid.x);
const int a = chunk * CHUNK + int(t);
const int e = a < A ? int(inds[a]) : -1;
chunk_experts[t] = e;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (a < A) {
  int before = 0;
  for (int j = 0; j < int(t); ++j) {
    before += chunk_experts[j] == e ? 1 : 0;
  }
  local_rank[a] = before;
}
for (int ex = int(t); ex < E; ex += CHUNK) {
  int n = 0;
  for (int j = 0; j < CHUNK; ++j) {
    n += chunk_experts[j] == ex ? 1 : 0;
  }
  chunk_counts[chunk * E + ex] = n;
}

// @kernel moe_route_scan_i32
// grid (NT, 1, 1), threadgroup (NT, 1, 1), NT >= E a multiple of 32, <= 1024. params: [A, E, n_chunks].
// counts [E] rows per expert; offsets [E + 1] exclusive prefix sum (offsets[E] = A);
// chunk_offsets [n_chunks, E] first slot of each chunk's rows of each expert.
threadgroup int scan[NT];
const int E = params[1];
const int n_chunks = params[2];
const int t = int(thread_position_in_threadgroup.x);
int total = 0;
if (t < E) {
  for (int c = 0; c < n_chunks; ++c) {
    total += chunk_counts[c * E + t];
  }
}
// Inclusive Hillis-Steele scan over the threadgroup.
scan[t] = total;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int step = 1; step < NT; step <<= 1) {
  int v = t >= step ? scan[t - step] : 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  scan[t] += v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (t < E) {
  int running = scan[t] - total;
  counts[t] = total;
  offsets[t] = running;
  for (int c = 0; c < n_chunks; ++c) {
    chunk_offsets[c * E + t] = running;
    running += chunk_counts[c * E + t];
  }
}
if (t == 0) {
  offsets[E] = scan[NT - 1];
}

// @kernel moe_route_scatter_i32
// grid (n_chunks * CHUNK, 1, 1), threadgroup (CHUNK, 1, 1). params: [A, E, n_chunks].
// sorted_rows [A]: slot -> assignment; slot_of_row [A]: assignment -> slot (the inverse map).
const int A = params[0];
const int E = params[1];
const int a = int(thread_position_in_grid.x);
if (a < A) {
  const int chunk = a / CHUNK;
  const int slot = chunk_offsets[chunk * E + int(inds[a])] + local_rank[a];
  sorted_rows[slot] = a;
  slot_of_row[a] = slot;
}

// @kernel moe_route_block_map_i32
// grid (NT, 1, 1), threadgroup (NT, 1, 1), NT >= E a multiple of 32, <= 1024.
// params: [A, E, max_blocks, large_min_rows]. Experts with >= large_min_rows rows get 32-row tiles,
// the others 16-row tiles. blocks [max_blocks, 4]: (expert, first slot, rows, tile rows) in expert
// order; entries past the last block are (-1, 0, 0, 0).
threadgroup int scan[NT];
const int E = params[1];
const int max_blocks = params[2];
const int large_min_rows = params[3];
const int t = int(thread_position_in_threadgroup.x);
const int n = t < E ? counts[t] : 0;
const int tile = n >= large_min_rows ? 32 : 16;
const int n_tiles = (n + tile - 1) / tile;
scan[t] = n_tiles;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int step = 1; step < NT; step <<= 1) {
  int v = t >= step ? scan[t - step] : 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  scan[t] += v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
const int total_blocks = scan[NT - 1];
int b = scan[t] - n_tiles;
for (int i = 0; i < n_tiles; ++i, ++b) {
  blocks[4 * b + 0] = t;
  blocks[4 * b + 1] = offsets[t] + i * tile;
  blocks[4 * b + 2] = min(tile, n - i * tile);
  blocks[4 * b + 3] = tile;
}
for (int j = total_blocks + t; j < max_blocks; j += NT) {
  blocks[4 * j + 0] = -1;
  blocks[4 * j + 1] = 0;
  blocks[4 * j + 2] = 0;
  blocks[4 * j + 3] = 0;
}

// @kernel moe_gemm_gate_up_swiglu
// grid (I / 32 * 128, max_blocks, 1), threadgroup (128, 1, 1). params: [top_k, D, I].
// x [N, D] tokens; sorted_rows [A]; blocks [max_blocks, 4]; w_gate, w_up: [E, I, D / 8] uint32
// (+ scales/biases [E, I, D / 64]) or dequantised [E, I, D]. h [A, I]: rows in slot order.
threadgroup float xt[MOE_MAX_ROWS * MOE_BK];
threadgroup float wg[MOE_BK * MOE_BN];
threadgroup float wu[MOE_BK * MOE_BN];
const int top_k = params[0];
const int D = params[1];
const int I = params[2];
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
for (int k0 = 0; k0 < D; k0 += MOE_BK) {
  moe_load_rows_tile<true>(x, sorted_rows, xt, first, rows, tile_rows, top_k, k0, D, tid);
  moe_load_weight_tile(w_gate, scales_gate, biases_gate, wg, e, n0, k0, I, D, tid);
  moe_load_weight_tile(w_up, scales_up, biases_up, wu, e, n0, k0, I, D, tid);
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
// grid (D / 32 * 128, max_blocks, 1), threadgroup (128, 1, 1). params: [I, D].
// h [A, I] rows in slot order; w_down [E, D, I / 8] uint32 (+ scales/biases [E, D, I / 64]) or
// dequantised [E, D, I]. y [A, D] rows in slot order.
threadgroup float xt[MOE_MAX_ROWS * MOE_BK];
threadgroup float wt[MOE_BK * MOE_BN];
const int I = params[0];
const int D = params[1];
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
  moe_load_weight_tile(w_down, scales_down, biases_down, wt, e, n0, k0, D, I, tid);
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
const int O = params[0];
const int K = params[1];
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
