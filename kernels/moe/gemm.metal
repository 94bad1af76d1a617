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
// threadgroup memory, or already dequantised [E, O, K]. Tile operands of type MT: float (the default,
// bit-compatible with the decode GEMVs below) or the activation type T (bf16/f16 fragments, which Apple
// GPUs and the bridge's tensor-core path multiply natively: a benchmark variant until timed, see
// docs/moe.md); fp32 accumulation either way, output in the activation type.
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
// per element / per token. No split of K across threadgroups, no reduction across rows or tiles (the K-split
// candidate, SK > 1, splits each sum into SK ranges inside one threadgroup and adds them in range order: its own
// bits, in the GEMV and the register tiles alike).

// @header
// @include moe/router.metal
// @include linear/gemv.metal
#define MOE_BN 32         // output columns per threadgroup
// Row strides of the staged tiles in threadgroup memory, padded so that the 8 rows of a fragment load
// (and the loaders' stores) fall on different banks: wt [MOE_BK][MOE_WT_LD] (the dequantising loader's
// stores: 8-way conflicts at stride 32, none at 33), xt [rows][MOE_XT_LD] (fragment loads: 8-way at
// stride 64, 2-way at 68). Padding columns are never read.
#define MOE_WT_LD (MOE_BN + 1)
#define MOE_XT_LD (MOE_BK + 4)
#define MOE_BK 64         // K step = quantisation group size
#define MOE_MAX_ROWS 32   // largest tile rows
#define MOE_THREADS 128   // 4 simdgroups
#define MOE_COMBINE_LOADS 8  // routed rows whose loads moe_combine_weighted_rows issues together

// Weight tile loaders: fill wt[k][n] (k-major, MOE_BK rows of MOE_WT_LD, MOE_BN used) for output columns
// [n0, n0 + 32) and K range [k0, k0 + 64) of expert e. O, K: the weight's output and input dims.

// The nibble helpers (q4_value, Q4_EXPONENT, q4_exponent_unfolded) are linear/gemv.metal's.

// One 4-bit weight: w = scale * q + bias. The tile loader and the decode GEMVs both use this one
// expression, so a weight has the same float value (and rounding) on either path.
inline float moe_dequant_q4(uint32_t word, int j, float scale, float bias,
                            uint32_t exponent = Q4_EXPONENT) {
  return scale * q4_value(word, j, exponent) + bias;
}

// 4-bit affine, group 64: one uint32 word holds 8 consecutive K values, low nibble first.
template <typename S, typename MT>
inline void moe_load_weight_tile(
    const device uint32_t* w, const device S* scales, const device S* biases,
    threadgroup MT* wt, int e, int n0, int k0, int O, int K, uint tid) {
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
      wt[(wi * 8 + j) * MOE_WT_LD + n] = MT(moe_dequant_q4(word, j, scale, bias));
    }
  }
}

// Already dequantised weights [E, O, K] (the fused_dequant=off ablation).
template <typename W, typename S, typename MT>
inline void moe_load_weight_tile(
    const device W* w, const device S* scales, const device S* biases,
    threadgroup MT* wt, int e, int n0, int k0, int O, int K, uint tid) {
  for (int i = int(tid); i < MOE_BN * MOE_BK; i += MOE_THREADS) {
    int n = i / MOE_BK;
    int kk = i % MOE_BK;
    wt[kk * MOE_WT_LD + n] = MT(float(w[(long(e) * O + (n0 + n)) * K + k0 + kk]));
  }
}

// Activation tile xt[r][k] (rows of MOE_XT_LD, 64 used) of a block; rows past `rows` are zero.
// GATHER: row r is token sorted_rows[first + r] / top_k of x, or token token_base + r when
// token_base >= 0 (shared-expert rows, in token order); else row first + r of x.
// (Pointer types are template parameters: a call of few assignments hands sorted_rows over in the
// constant address space, as MLX passes every input of fewer than 8 elements.)
template <bool GATHER, typename PX, typename PR, typename MT>
inline void moe_load_rows_tile(
    PX x, PR sorted_rows, threadgroup MT* xt,
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
    xt[r * MOE_XT_LD + kk] = MT(v);
  }
}

// acc[i][j] += xt[rows of i] . wt[:, cols of j] over one 64-wide K step, for this simdgroup's
// 16 x (8 * NJ) sub-tile at (row0, col0).
template <int NJ, typename MT>
inline void moe_mma_step(
    thread simdgroup_matrix<float, 8, 8> (&acc)[2][2], const threadgroup MT* xt,
    const threadgroup MT* wt, int row0, int col0) {
  for (int kk = 0; kk < MOE_BK; kk += 8) {
    simdgroup_matrix<MT, 8, 8> a0, a1, b0, b1;
    simdgroup_load(a0, xt + row0 * MOE_XT_LD + kk, MOE_XT_LD);
    simdgroup_load(a1, xt + (row0 + 8) * MOE_XT_LD + kk, MOE_XT_LD);
    simdgroup_load(b0, wt + kk * MOE_WT_LD + col0, MOE_WT_LD);
    simdgroup_multiply_accumulate(acc[0][0], a0, b0, acc[0][0]);
    simdgroup_multiply_accumulate(acc[1][0], a1, b0, acc[1][0]);
    if (NJ == 2) {
      simdgroup_load(b1, wt + kk * MOE_WT_LD + col0 + 8, MOE_WT_LD);
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

// Decode GEMVs (switch row_gemv): one output element per thread, one fp32 accumulator taking
// acc += x[k] * w[k] for k = 0 .. K - 1 in order: exactly what the GEMMs' 8 x 8 multiply-accumulates
// do for that element (K step 64, then 8 at a time, each in k order), so a row gets the same bits
// from a GEMV and from a GEMM tile (batch invariance).
//
// The rowwise form (moe_gemv_*_rowwise; kept as the benchmark baseline and test oracle) reads each
// thread's weight row straight from device memory: adjacent threads read words K / 2 bytes apart, so a
// simdgroup load touches 32 cache lines. xs: the row, as floats, in threadgroup memory.
// CVT 1: the weight as moe_dequant_q4 gives it; CVT 0: with an integer to float conversion of the
// nibble (the form before q4_value; the same value, kept as the benchmark baseline).
template <int CVT, typename S>
inline float moe_gemv_q4_dot(const device uint32_t* w, const device S* scales, const device S* biases,
                             const threadgroup float* xs, int K) {
  float acc = 0.0f;
  for (int g = 0; g < K / 64; ++g) {
    const float scale = float(scales[g]);
    const float bias = float(biases[g]);
    for (int wi = 0; wi < 8; ++wi) {
      const uint32_t word = w[g * 8 + wi];
      for (int j = 0; j < 8; ++j) {
        if (CVT) {
          acc += xs[g * 64 + wi * 8 + j] * moe_dequant_q4(word, j, scale, bias);
        } else {
          acc += xs[g * 64 + wi * 8 + j] * (scale * float((word >> (4 * j)) & 0xfu) + bias);
        }
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

// The staged form (moe_gemv_gate_up_swiglu, moe_gemv_down): a threadgroup computes R consecutive
// outputs (weight rows) of NM matrices (gate and up: NM = 2, one thread per (matrix, row) chain;
// down: NM = 1) for one block row; NT = NM * R threads. K advances in chunks of KC (a multiple of 64
// dividing K): the threads copy the chunk's packed words of the NM x R rows into threadgroup memory
// as 16-byte uint4 pieces (adjacent threads read adjacent pieces of a row: KC / 2 contiguous bytes
// per row), the chunk's scales and biases (as floats) and the chunk of the activation row (as
// floats); then every chain continues its own accumulation from threadgroup memory, in the same k
// order with the same expression (moe_dequant_q4) and fp32 operations as the rowwise form: same bits.
// Software pipelined: the next chunk's device loads go to registers before the current chunk's
// chains run and are stored to the other of two buffers after them (one barrier per chunk), so the
// memory latency overlaps the arithmetic. Rows are padded by one uint4 (stride KC / 8 + 4 words), so
// the chains' 16-byte reads of 32 different rows hit distinct banks.
// SK (split K, a candidate; 1 everywhere the product runs): each sum as SK chains over contiguous K ranges of K / SK
// values (range s from s K / SK), added in s order at the end (moe_gemv_staged). Chain (s, m, r) is virtual row
// v = s * NM * R + m * R + r of the staged buffers, with range s's activations; SK = 1 is the form above.
template <int NM, int R, int KC, int SK = 1>
struct MoeGemvShape {
  static constant constexpr int NMR = NM * R;               // sums
  static constant constexpr int NT = NMR * SK;              // threads, one chain each
  static constant constexpr int P = KC / 32;                // uint4 pieces per row and chunk
  static constant constexpr int STRIDE = P + 1;             // padded row stride (uint4)
  static constant constexpr int G = KC / 64;                // scales per row and chunk
  static constant constexpr int XQ = (SK * KC / 4 + NT - 1) / NT;  // 4-value pieces of x per thread and chunk
};

// This thread's share of chunk k0 (of every K range) into registers: P uint4 pieces (piece i = tid + q * NT of the
// NT * P, virtual-row-major, pieces of a row adjacent), G scales and G biases, XQ x 4 activation values.
// Row r of matrix m: packed words w_m + r * wstride, scales/biases s_m / b_m + r * sstride; KS = K / SK.
template <int NM, int R, int KC, typename T, int SK = 1>
inline void moe_gemv_fetch(
    const device uint32_t* w0, const device uint32_t* w1, long wstride,
    const device T* s0, const device T* s1, const device T* b0, const device T* b1, long sstride,
    const device T* xrow, int k0, uint tid, thread uint4* wr, thread T* sr, thread T* br, thread T* xr,
    int KS = 0) {
  typedef MoeGemvShape<NM, R, KC, SK> Shape;
  for (int q = 0; q < Shape::P; ++q) {
    const int i = int(tid) + q * Shape::NT;
    const int v = i / Shape::P;
    const int vr = SK > 1 ? v % Shape::NMR : v;  // (SK = 1: the same expressions as before the split)
    const int m = vr / R;
    const int r = vr % R;
    const int p = i % Shape::P;
    const int k = SK > 1 ? (v / Shape::NMR) * KS + k0 : k0;
    const device uint32_t* src = (m == 0 ? w0 : w1) + r * wstride + k / 8 + 4 * p;
    wr[q] = *reinterpret_cast<const device uint4*>(src);
  }
  for (int q = 0; q < Shape::G; ++q) {
    const int i = int(tid) + q * Shape::NT;
    const int v = i / Shape::G;
    const int vr = SK > 1 ? v % Shape::NMR : v;
    const int m = vr / R;
    const int r = vr % R;
    const int k = SK > 1 ? (v / Shape::NMR) * KS + k0 : k0;
    const long off = r * sstride + k / 64 + i % Shape::G;
    sr[q] = (m == 0 ? s0 : s1)[off];
    br[q] = (m == 0 ? b0 : b1)[off];
  }
  for (int q = 0; q < Shape::XQ; ++q) {
    const int i = int(tid) + q * Shape::NT;  // piece i % (KC / 4) of range i / (KC / 4)
    if (i < SK * KC / 4) {
      for (int c = 0; c < 4; ++c) {
        xr[4 * q + c] = SK > 1 ? xrow[(i / (KC / 4)) * KS + k0 + 4 * (i % (KC / 4)) + c] : xrow[k0 + 4 * i + c];
      }
    }
  }
}

// The registers of moe_gemv_fetch into one buffer: ws [NT][STRIDE] uint4, ss / bs [SK][NM][G][R]
// floats, xs [SK][KC / 4] float4 (the conversions float(T) of the rowwise form).
template <int NM, int R, int KC, typename T, int SK = 1>
inline void moe_gemv_store(
    threadgroup uint4* ws, threadgroup float* ss, threadgroup float* bs, threadgroup float4* xs, uint tid,
    const thread uint4* wr, const thread T* sr, const thread T* br, const thread T* xr) {
  typedef MoeGemvShape<NM, R, KC, SK> Shape;
  for (int q = 0; q < Shape::P; ++q) {
    const int i = int(tid) + q * Shape::NT;
    ws[(i / Shape::P) * Shape::STRIDE + i % Shape::P] = wr[q];
  }
  for (int q = 0; q < Shape::G; ++q) {
    const int i = int(tid) + q * Shape::NT;
    const int v = i / Shape::G;
    const int vr = SK > 1 ? v % Shape::NMR : v;
    const int m = vr / R;
    const int r = vr % R;
    const int at = (((SK > 1 ? v / Shape::NMR : 0) * NM + m) * Shape::G + i % Shape::G) * R + r;
    ss[at] = float(sr[q]);
    bs[at] = float(br[q]);
  }
  for (int q = 0; q < Shape::XQ; ++q) {
    const int i = int(tid) + q * Shape::NT;
    if (i < SK * KC / 4) {
      xs[i] = float4(float(xr[4 * q]), float(xr[4 * q + 1]), float(xr[4 * q + 2]), float(xr[4 * q + 3]));
    }
  }
}

// One chain over one staged chunk: acc += x[k] * w[k] for the chunk's k in order (a 64-wide group at
// a time, its 8 words, each word's 8 nibbles low first): the rowwise form's loop, reading threadgroup
// memory. wrow: this chain's padded row; ss / bs: its matrix's [G][R] scales and biases; r: its row.
template <int R, int KC>
inline float moe_gemv_chain(float acc, const threadgroup uint4* wrow, const threadgroup float* ss,
                            const threadgroup float* bs, int r, const threadgroup float4* xs, uint32_t exponent) {
  for (int g = 0; g < KC / 64; ++g) {
    const float scale = ss[g * R + r];
    const float bias = bs[g * R + r];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 w4 = wrow[2 * g + h];
      #pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        const uint32_t word = w4[wi];
        const float4 xa = xs[16 * g + 8 * h + 2 * wi];
        const float4 xb = xs[16 * g + 8 * h + 2 * wi + 1];
        const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc += xv[j] * moe_dequant_q4(word, j, scale, bias, exponent);
        }
      }
    }
  }
  return acc;
}

// The staged chains' barrier between chunks: the threadgroup's, or with SIMD_SYNC the simdgroup's, for callers whose
// chains stage and read only their own buffers and lie in one simdgroup with everyone who shares them (the
// down+combine's groups of R threads, R dividing 32): then a group waits for its own chunk, not for the slowest
// group's.
template <bool SIMD_SYNC>
inline void moe_gemv_chunk_barrier() {
  if (SIMD_SYNC) {
    simdgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// moe_gemv_staged (SK = 1) with PD chunks in flight: each thread keeps the packed words, scales, biases and activations
// of the PD chunks after the staged one in a ring of registers (chunk n in slot n % PD), loaded PD chunks before they
// are staged, so that a chunk's trip to memory overlaps PD chunks of sums instead of one (the down+combine's 8 chunks
// of 64 at K = 512 take ~4x their instruction time: docs/moe.md). The same chains on the same staged values: the
// same bits. K / KC a multiple of PD; PD = 1 is moe_gemv_staged's schedule. SIMD_SYNC: moe_gemv_chunk_barrier's (the
// caller then synchronises the threadgroup before it reuses another group's buffers).
template <int NM, int R, int KC, typename T, int PD, bool SIMD_SYNC = false>
inline float moe_gemv_staged_ring(
    const device uint32_t* w0, const device uint32_t* w1, long wstride,
    const device T* s0, const device T* s1, const device T* b0, const device T* b1, long sstride,
    const device T* xrow, int K, uint tid,
    threadgroup uint4* ws, threadgroup float* ss, threadgroup float* bs, threadgroup float4* xs,
    uint32_t exponent) {
  typedef MoeGemvShape<NM, R, KC> Shape;
  constexpr int WS = Shape::NT * Shape::STRIDE, SB = Shape::NT * Shape::G, XS = KC / 4;  // one buffer
  uint4 wr[PD][Shape::P];
  T sr[PD][Shape::G];
  T br[PD][Shape::G];
  T xr[PD][4 * Shape::XQ];
  const int chunks = K / KC;
  #pragma unroll
  for (int u = 0; u < PD; ++u) {
    moe_gemv_fetch<NM, R, KC, T>(w0, w1, wstride, s0, s1, b0, b1, sstride, xrow, u * KC, tid, wr[u], sr[u], br[u],
                                 xr[u]);
  }
  moe_gemv_store<NM, R, KC, T>(ws, ss, bs, xs, tid, wr[0], sr[0], br[0], xr[0]);
  if (PD < chunks) {
    moe_gemv_fetch<NM, R, KC, T>(w0, w1, wstride, s0, s1, b0, b1, sstride, xrow, PD * KC, tid, wr[0], sr[0], br[0],
                                 xr[0]);
  }
  moe_gemv_chunk_barrier<SIMD_SYNC>();
  const int m = int(tid) / R;
  const int r = int(tid) % R;
  float acc = 0.0f;
  for (int c0 = 0; c0 < chunks; c0 += PD) {
    #pragma unroll
    for (int u = 0; u < PD; ++u) {
      const int c = c0 + u;
      const int cur = c & 1;
      acc = moe_gemv_chain<R, KC>(acc, ws + cur * WS + (m * R + r) * Shape::STRIDE, ss + cur * SB + m * Shape::G * R,
                                  bs + cur * SB + m * Shape::G * R, r, xs + cur * XS, exponent);
      if (c + 1 < chunks) {  // uniform; chunk c + 1 into the other buffer (its last readers passed the last barrier)
        const int slot = (u + 1) % PD;
        const int nb = cur ^ 1;
        moe_gemv_store<NM, R, KC, T>(ws + nb * WS, ss + nb * SB, bs + nb * SB, xs + nb * XS, tid, wr[slot], sr[slot],
                                     br[slot], xr[slot]);
        if (c + 1 + PD < chunks) {
          moe_gemv_fetch<NM, R, KC, T>(w0, w1, wstride, s0, s1, b0, b1, sstride, xrow, (c + 1 + PD) * KC, tid,
                                       wr[slot], sr[slot], br[slot], xr[slot]);
        }
      }
      moe_gemv_chunk_barrier<SIMD_SYNC>();
    }
  }
  return acc;
}

// The whole K loop of one chain (thread tid = m * R + r: matrix m, row r; with SK > 1, tid = s NM R + m R + r, range
// s), pipelined as described above; every thread of the threadgroup calls it (it holds barriers). Returns the chain's
// sum (SK > 1: the first NM R threads return the ranges' sums added in range order).
// ws, ss, bs, xs: two buffers each, back to back: [2 * NT * (KC / 32 + 1)] uint4, [2 * NT * (KC / 64)]
// floats twice, [2 * SK * KC / 4] float4 (NT = NM R SK; 24.5 KB for gate+up at R = 32, KC = 256 and for down at
// R = 64, KC = 256; the host keeps them within Apple's 32 KB).
template <int NM, int R, int KC, typename T, int SK = 1>
inline float moe_gemv_staged(
    const device uint32_t* w0, const device uint32_t* w1, long wstride,
    const device T* s0, const device T* s1, const device T* b0, const device T* b1, long sstride,
    const device T* xrow, int K, uint tid,
    threadgroup uint4* ws, threadgroup float* ss, threadgroup float* bs, threadgroup float4* xs,
    uint32_t exponent) {
  typedef MoeGemvShape<NM, R, KC, SK> Shape;
  const int KS = K / SK;  // values a chain sums
  uint4 wr[Shape::P];
  T sr[Shape::G];
  T br[Shape::G];
  T xr[4 * Shape::XQ];
  moe_gemv_fetch<NM, R, KC, T, SK>(w0, w1, wstride, s0, s1, b0, b1, sstride, xrow, 0, tid, wr, sr, br, xr, KS);
  constexpr int WS = Shape::NT * Shape::STRIDE, SB = Shape::NT * Shape::G, XS = SK * KC / 4;  // one buffer
  moe_gemv_store<NM, R, KC, T, SK>(ws, ss, bs, xs, tid, wr, sr, br, xr);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int split = SK > 1 ? int(tid) / Shape::NMR : 0;  // this chain's K range
  const int m = (SK > 1 ? int(tid) % Shape::NMR : int(tid)) / R;
  const int r = int(tid) % R;
  float acc = 0.0f;
  const int chunks = KS / KC;
  for (int c = 0; c < chunks; ++c) {
    const int cur = c & 1;
    const bool next = c + 1 < chunks;  // uniform over the threadgroup
    if (next) {
      moe_gemv_fetch<NM, R, KC, T, SK>(w0, w1, wstride, s0, s1, b0, b1, sstride, xrow, (c + 1) * KC, tid,
                                       wr, sr, br, xr, KS);
    }
    acc = moe_gemv_chain<R, KC>(acc, ws + cur * WS + (m * R + r + split * Shape::NMR) * Shape::STRIDE,
                                ss + cur * SB + (split * NM + m) * Shape::G * R,
                                bs + cur * SB + (split * NM + m) * Shape::G * R, r,
                                xs + cur * XS + split * (KC / 4), exponent);
    if (next) {  // the other buffer: its last readers passed the previous barrier
      const int nb = cur ^ 1;
      moe_gemv_store<NM, R, KC, T, SK>(ws + nb * WS, ss + nb * SB, bs + nb * SB, xs + nb * XS, tid, wr, sr, br,
                                       xr);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (SK > 1) {  // the ranges' sums added in range order by the first SK-th of the threads (ss is free)
    ss[tid] = acc;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (split == 0) {
      for (int s = 1; s < SK; ++s) {
        acc += ss[s * Shape::NMR + int(tid)];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  return acc;
}

// One chain of moe_gemv_down_combine_direct: this thread's weight row read straight from device memory (no
// staging through threadgroup memory, no barrier per chunk), KB quantisation groups (2 KB uint4 pieces, KB scales
// and biases) a register batch, the next batch's loads issued before this batch's sums. The sums are
// moe_gemv_chain's (the same expression in the same k order), so the chain has moe_gemv_staged's bits.
// wrow, srow, brow: the row's packed words, scales and biases; xs: the row's K activations as floats. Every loop
// over a batch is unrolled: its register arrays are then indexed by constants only (else a stack frame).
template <int KB, typename T>
inline float moe_gemv_chain_direct(const device uint32_t* wrow, const device T* srow, const device T* brow,
                                   const threadgroup float4* xs, int K, uint32_t exponent) {
  const device uint4* w4 = reinterpret_cast<const device uint4*>(wrow);
  uint4 cur[2 * KB];
  float cs[KB];
  float cb[KB];
  #pragma unroll
  for (int i = 0; i < 2 * KB; ++i) {
    cur[i] = w4[i];
  }
  #pragma unroll
  for (int i = 0; i < KB; ++i) {
    cs[i] = float(srow[i]);
    cb[i] = float(brow[i]);
  }
  float acc = 0.0f;
  const int groups = K / 64;
  for (int g0 = 0; g0 < groups; g0 += KB) {
    const bool more = g0 + KB < groups;  // uniform over the threadgroup
    uint4 nxt[2 * KB];
    float ns[KB];
    float nb[KB];
    if (more) {
      #pragma unroll
      for (int i = 0; i < 2 * KB; ++i) {
        nxt[i] = w4[2 * (g0 + KB) + i];
      }
      #pragma unroll
      for (int i = 0; i < KB; ++i) {
        ns[i] = float(srow[g0 + KB + i]);
        nb[i] = float(brow[g0 + KB + i]);
      }
    }
    #pragma unroll
    for (int gg = 0; gg < KB; ++gg) {
      const int g = g0 + gg;
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 wv = cur[2 * gg + h];
        #pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
          const uint32_t word = wv[wi];
          const float4 xa = xs[16 * g + 8 * h + 2 * wi];
          const float4 xb = xs[16 * g + 8 * h + 2 * wi + 1];
          const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
          #pragma unroll
          for (int j = 0; j < 8; ++j) {
            acc += xv[j] * moe_dequant_q4(word, j, cs[gg], cb[gg], exponent);
          }
        }
      }
    }
    if (more) {
      #pragma unroll
      for (int i = 0; i < 2 * KB; ++i) {
        cur[i] = nxt[i];
      }
      #pragma unroll
      for (int i = 0; i < KB; ++i) {
        cs[i] = ns[i];
        cb[i] = nb[i];
      }
    }
  }
  return acc;
}

// The combine of moe_gemv_down_combine (both layouts), by the first group's R threads: ys [NBLK][R] holds each
// block's GEMV result rounded to T as y would hold it; routed rows in j order weighted by their scores, then the
// gated shared chunks, rounded once, then the residual add as MLX adds two T arrays (moe_combine_weighted_rows'
// expression and order). PS: scores' pointer type (an input of under 8 elements arrives in the constant space).
template <int R, typename T, typename PS>
inline void moe_down_combine_out(const threadgroup float* ys, int r, long n, int o, int D, int k, int shared_chunks,
                                 float g, float res, int has_residual, PS scores, device T* out) {
  float sum = 0.0f;
  for (int jj = 0; jj < k; ++jj) {
    sum += float(scores[n * k + jj]) * ys[jj * R + r];
  }
  for (int c = 0; c < shared_chunks; ++c) {
    sum += g * ys[(k + c) * R + r];
  }
  const T mixed = static_cast<T>(sum);
  out[n * D + o] = has_residual != 0 ? static_cast<T>(res + float(mixed)) : mixed;
}

// The gate+up GEMVs' last step (every thread of the threadgroup: it holds a barrier): thread R + r holds output r's up
// sum (holds_up), thread r its gate sum; h = silu(gate) * up, rounded once to T.
template <int R, typename T>
inline void moe_gemv_swiglu_out(float acc, uint tid, bool holds_up, int slot, int I, int o0,
                                threadgroup float* up_sums, device T* h) {
  if (holds_up) {
    up_sums[int(tid) - R] = acc;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (int(tid) < R) {
    const float g = acc;
    const float u = up_sums[tid];
    h[long(slot) * I + o0 + int(tid)] = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);
  }
}

// One block row of the gate/up GEMV (moe_gemv_gate_up_swiglu and its routed form): expert e (E + c: the
// shared expert's chunk c), output slot `slot`, activation row `token`; h[slot, o0 .. o0 + R) =
// silu(gate) * up from the staged chains (threads 0 .. R-1 the gate chains, R .. 2R-1 the up chains).
// Every thread of the threadgroup calls it (it holds barriers). PD > 1 (SK = 1): PD chunks in flight
// (moe_gemv_staged_ring; the same bits).
template <int R, int KC, typename T, int SK = 1, int PD = 1>
inline void moe_gemv_gate_up_rows(
    int e, int slot, long token, int E, int I, int D, int o0, uint tid, const device T* x,
    const device uint32_t* w_gate, const device T* scales_gate, const device T* biases_gate,
    const device uint32_t* w_up, const device T* scales_up, const device T* biases_up,
    const device uint32_t* w_gate_s, const device T* scales_gate_s, const device T* biases_gate_s,
    const device uint32_t* w_up_s, const device T* scales_up_s, const device T* biases_up_s,
    threadgroup uint4* ws, threadgroup float* ss, threadgroup float* bs, threadgroup float4* xs,
    threadgroup float* up_sums, device T* h) {
  static_assert(PD == 1 || SK == 1, "chunks in flight without the K split only (moe_gemv_staged_ring has no ranges)");
  const bool shared = e >= E;
  const long row0 = long(shared ? e - E : e) * I + o0;
  const long words = row0 * (D / 8);
  const long groups = row0 * (D / 64);
  const device uint32_t* w0 = (shared ? w_gate_s : w_gate) + words;
  const device uint32_t* w1 = (shared ? w_up_s : w_up) + words;
  const device T* s0 = (shared ? scales_gate_s : scales_gate) + groups;
  const device T* s1 = (shared ? scales_up_s : scales_up) + groups;
  const device T* b0 = (shared ? biases_gate_s : biases_gate) + groups;
  const device T* b1 = (shared ? biases_up_s : biases_up) + groups;
  const float acc = PD > 1
      ? moe_gemv_staged_ring<2, R, KC, T, PD>(w0, w1, D / 8, s0, s1, b0, b1, D / 64, x + token * D, D, tid, ws, ss, bs,
                                               xs, q4_exponent_unfolded(E))
      : moe_gemv_staged<2, R, KC, T, SK>(w0, w1, D / 8, s0, s1, b0, b1, D / 64, x + token * D, D, tid, ws, ss, bs, xs,
                                         q4_exponent_unfolded(E));
  moe_gemv_swiglu_out<R, T>(acc, tid, int(tid) >= R && (SK == 1 || int(tid) < 2 * R), slot, I, o0, up_sums, h);
}


// The routed decode GEMVs' first step, by simdgroup 0 (the others pass by; the caller's barrier follows): token
// `token`'s experts from moe_router_logits_q's logits (moe_router_picks, the bits of moe_router_topk_from_logits),
// block `blk`'s expert into block_expert (pick j, or shared chunk j), and, from the x = 0 threadgroup of each block
// (`writer`), that block's share of the top-k kernel's outputs: pick j's inds / scores / block row, the gate (pick 0's),
// a shared chunk's block row.
template <typename T, int NPL>
inline void moe_routed_block_expert(const device float* logits, long token, int j, bool shared, int blk, int E,
                                    int top_k, int has_gate, int norm_topk, int decode_tile, bool writer,
                                    uint simdgroup, uint lane, threadgroup float* probs,
                                    threadgroup int* block_expert, device int* inds, device T* scores,
                                    device float* gate, device int* blocks) {
  if (simdgroup != 0) {  // uniform: every lane of simdgroup 0 reaches the simd ops
    return;
  }
  for (int row = int(lane); row < E + has_gate; row += 32) {
    probs[row] = logits[token * (E + 1) + row];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  float picked_sum;
  const uint mine = moe_router_picks<T, NPL>(probs, lane, E, top_k, picked_sum);
  const uint key = simd_shuffle(mine, ushort(shared ? 0 : j));
  if (lane == 0) {
    if (shared) {
      *block_expert = E + j;
      if (writer) {
        moe_router_write_shared_block(blk, E, j, decode_tile, blocks);
      }
    } else {
      *block_expert = int(MOE_ROUTER_ID_BITS - (key & MOE_ROUTER_ID_BITS));
      if (writer) {
        moe_router_write_pick<T>(key, picked_sum, blk, norm_topk, decode_tile, inds, scores, blocks);
        if (j == 0) {
          gate[token] = moe_router_gate<T>(probs, E, has_gate);
        }
      }
    }
  }
}

// Register-tiled GEMMs (switch register_tiles: moe_gemm_gate_up_swiglu_regtile, moe_gemm_down_regtile).
// Same block map, same per-element arithmetic as the simdgroup tiles above, so the same bits: every
// output element has one fp32 accumulator taking acc += x[k] * w[k] for k = 0 .. K - 1 in order, with
// x = float(x) and w = moe_dequant_q4(...) (or the dequantised array), exactly as the decode GEMVs do.
// What differs is who holds the accumulators: each thread keeps a TM x TN block of outputs in
// registers (a classic register-blocked GEMM), so one K step costs a thread a few 16-byte threadgroup
// loads per TM * TN (* 2 for gate and up) FMAs, where a simdgroup_matrix product on a GPU without fp32
// matrix units (the bridge on NVIDIA) moves its operands between lanes with shuffles.
// The threadgroup size NT is a template parameter. Its threads form NT / 16 row groups x 16 column groups:
// thread (rg, cg) computes rows rg * TM .. + TM (TM = tile_rows * 16 / NT) and columns cg * TN .. + TN
// (moe_rt_thread_origin). NT = 64 (the product): 32-row tiles at TM = 8, 16-row at TM = 4; NT = 128: TM = 4 / 2;
// NT = 256 (a benchmark variant that also takes 64-row tiles): TM = 4 / 2 / 1. The FMAs per threadgroup load
// grow with TM * TN, and the loads are what bounds these kernels on the H200 (docs/moe.md).
// K advances MOE_RT_BK at a time (half a quantisation group, so the staged tiles fit Apple's 32 KB): the next
// step's weights (one 16-byte word of 32 nibbles per staged column) and activations go to registers before the
// current step's FMAs and into threadgroup memory after them (weights dequantised once per tile).
#define MOE_RT_BK 32
#define MOE_RT_MAX_ROWS(NT) ((NT) >= 128 ? (NT) / 4 : 32)   // the largest tile NT threads take
#define MOE_RT_TM_MAX(NT) (MOE_RT_MAX_ROWS(NT) * 16 / (NT))  // its rows per thread: 8 at 64 threads, else 4
#define MOE_RT_XLD(NT) (MOE_RT_MAX_ROWS(NT) + 4)             // xt [MOE_RT_BK][MOE_RT_XLD]: k-major, a thread's rows adjacent
#define MOE_RT_XV(NT) (MOE_RT_MAX_ROWS(NT) * MOE_RT_BK / (NT))  // activation values a thread stages per step, at most
#define MOE_RT_GU_COLS 64                    // gate/up columns per threadgroup (of each matrix)
#define MOE_RT_GU_LD (MOE_RT_GU_COLS + 4)     // row stride of the staged gate and up tiles

// One weight row's share of a K step, held in registers between the fetch and the store.
struct MoeRtWeightRegs {
  uint4 words;  // 32 nibbles: k0 .. k0 + 31
  float scale;
  float bias;
};

// 4-bit affine: row `row` of a [rows, K / 8] uint32 matrix, K range [k0, k0 + 32). The scale and bias are read
// at the first half of each 64-group only and kept for the second (each is its own 2-byte read from another row's
// cache line, a large part of the L1 traffic when read at every step).
template <typename S>
inline void moe_rt_fetch_weight(const device uint32_t* w, const device S* scales, const device S* biases,
                                long row, int k0, int K, thread MoeRtWeightRegs& regs) {
  regs.words = *reinterpret_cast<const device uint4*>(w + row * (K / 8) + k0 / 8);
  if (k0 % 64 == 0) {
    regs.scale = float(scales[row * (K / 64) + k0 / 64]);
    regs.bias = float(biases[row * (K / 64) + k0 / 64]);
  }
}

// Column `col` of the staged weight tile (stride ld between k rows), dequantised once.
template <typename S>
inline void moe_rt_store_weight(const device uint32_t*, const device S*, const device S*, long, int, int,
                                thread const MoeRtWeightRegs& regs, threadgroup float* col, int ld) {
  for (int wi = 0; wi < 4; ++wi) {
    const uint32_t word = regs.words[wi];
    for (int j = 0; j < 8; ++j) {
      col[(wi * 8 + j) * ld] = moe_dequant_q4(word, j, regs.scale, regs.bias);
    }
  }
}

// Already dequantised [rows, K] weights (the fused_dequant=off ablation): nothing is held in registers,
// the store reads the row's 32 values itself.
template <typename W, typename S>
inline void moe_rt_fetch_weight(const device W*, const device S*, const device S*, long, int, int,
                                thread MoeRtWeightRegs&) {}

template <typename W, typename S>
inline void moe_rt_store_weight(const device W* w, const device S*, const device S*, long row, int k0, int K,
                                thread const MoeRtWeightRegs&, threadgroup float* col, int ld) {
  for (int kk = 0; kk < MOE_RT_BK; ++kk) {
    col[kk * ld] = float(w[row * K + k0 + kk]);
  }
}

// The activation tile of a K step, TR rows (the block's tile rows): thread tid stages row tid % TR, values
// k0 + (tid / TR) * V .. + V (V = TR * MOE_RT_BK / NT, 2 to 16) in loads of up to 16 bytes (one or two for bf16 and
// f16, up to four for fp32), and a simdgroup's
// stores into the k-major tile fall on 32 (or 2 x 16) adjacent rows, on distinct banks but at NT = 64 with
// 16-row tiles (2-way). `src`: the row of x it reads (moe_rt_row_source).
template <int NT, int TR, typename T, typename PX>
inline void moe_rt_fetch_rows_of(PX x, int src, int k0, int K, uint tid, thread uint* xw) {
  constexpr int V = TR * MOE_RT_BK / NT;
  const device T* p = x + long(src) * K + k0 + (int(tid) / TR) * V;
  moe_load_words<V / MoeWords<T>::PER>(reinterpret_cast<const device uint*>(p), xw);
}

template <int NT, int TR, typename T>
inline void moe_rt_store_rows_of(thread const uint* xw, uint tid, threadgroup float* xt) {
  constexpr int V = TR * MOE_RT_BK / NT;
  const int r = int(tid) % TR;
  const int kb = (int(tid) / TR) * V;
  for (int v = 0; v < V; ++v) {
    xt[(kb + v) * MOE_RT_XLD(NT) + r] = MoeWords<T>::get(xw[v / MoeWords<T>::PER], v % MoeWords<T>::PER);
  }
}

// The two above at this block's tile rows (uniform over the threadgroup): the largest tile, half, a quarter.
template <int NT, typename T, typename PX>
inline void moe_rt_fetch_rows(PX x, int src, int tile_rows, int k0, int K, uint tid, thread uint* xw) {
  constexpr int MR = MOE_RT_MAX_ROWS(NT);
  if (tile_rows == MR) {
    moe_rt_fetch_rows_of<NT, MR, T>(x, src, k0, K, tid, xw);
  } else if (tile_rows == MR / 2) {
    moe_rt_fetch_rows_of<NT, MR / 2, T>(x, src, k0, K, tid, xw);
  } else {
    moe_rt_fetch_rows_of<NT, MR / 4, T>(x, src, k0, K, tid, xw);
  }
}

template <int NT, typename T>
inline void moe_rt_store_rows(thread const uint* xw, int tile_rows, uint tid, threadgroup float* xt) {
  constexpr int MR = MOE_RT_MAX_ROWS(NT);
  if (tile_rows == MR) {
    moe_rt_store_rows_of<NT, MR, T>(xw, tid, xt);
  } else if (tile_rows == MR / 2) {
    moe_rt_store_rows_of<NT, MR / 2, T>(xw, tid, xt);
  } else {
    moe_rt_store_rows_of<NT, MR / 4, T>(xw, tid, xt);
  }
}

// The row of x this thread stages (row tid % tile_rows of the block; GATHER as moe_load_rows_tile). A padded
// row (past `rows`) reads the block's last row instead: its outputs are never written, and no other output
// reads it, so the fetch needs no branch.
template <bool GATHER, typename PR>
inline int moe_rt_row_source(PR sorted_rows, int first, int rows, int tile_rows, int top_k, uint tid,
                             int token_base) {
  const int r = min(int(tid) % tile_rows, rows - 1);
  return !GATHER ? first + r : token_base >= 0 ? token_base + r : int(sorted_rows[first + r]) / top_k;
}

// N consecutive floats of threadgroup memory (N = 1, 2, 4 or 8; aligned to their size up to 16 bytes) into
// registers.
template <int N>
inline void moe_rt_load(const threadgroup float* p, thread float* out) {
  if (N == 1) {
    out[0] = p[0];
  } else if (N >= 4) {
    for (int v = 0; v < N / 4; ++v) {
      const float4 f = reinterpret_cast<const threadgroup float4*>(p)[v];
      out[4 * v] = f.x;
      out[4 * v + 1] = f.y;
      out[4 * v + 2] = f.z;
      out[4 * v + 3] = f.w;
    }
  } else {
    const float2 f = *reinterpret_cast<const threadgroup float2*>(p);
    out[0] = f.x;
    out[1] = f.y;
  }
}

// One K step of NM matrices (gate and up: 2; down: 1) sharing the activation tile:
// acc[m][i][j] += x[row r0 + i][k] * w_m[k][col c0 + j] for k in the step, in order.
template <int NT, int NM, int TM, int TN>
inline void moe_rt_mac(thread float (&acc)[2][MOE_RT_TM_MAX(NT)][8], const threadgroup float* xt,
                       const threadgroup float* w0, const threadgroup float* w1, int ld, int r0, int c0) {
  #pragma unroll 2
  for (int kk = 0; kk < MOE_RT_BK; ++kk) {
    float a[TM];
    float b[NM][TN];
    moe_rt_load<TM>(xt + kk * MOE_RT_XLD(NT) + r0, a);
    moe_rt_load<TN>(w0 + kk * ld + c0, b[0]);
    if (NM == 2) {
      moe_rt_load<TN>(w1 + kk * ld + c0, b[NM - 1]);
    }
    #pragma unroll
    for (int m = 0; m < NM; ++m) {
      #pragma unroll
      for (int i = 0; i < TM; ++i) {
        #pragma unroll
        for (int j = 0; j < TN; ++j) {
          acc[m][i][j] += a[i] * b[m][j];
        }
      }
    }
  }
}

// Thread tid's outputs: rows r0 .. r0 + TM of the tile (TM = tile_rows * 16 / NT), columns c0 .. c0 + TN. A
// simdgroup covers 4 row groups x 8 column groups (not 2 x 16), so that each of its 16-byte threadgroup loads
// per K index touches 32 adjacent floats of a weight tile (one wavefront on NVIDIA GPUs) and 16 (or 32) of the
// activation tile (the first layout's shared loads were its largest pipe load under Nsight Compute).
template <int NT>
inline void moe_rt_thread_origin(uint tid, int tile_rows, int tn, thread int& r0, thread int& c0) {
  constexpr int ROW_BLOCKS = NT / 64;  // simdgroups along the rows (4 row groups each)
  const int sg = int(tid) / 32;
  const int lane = int(tid) % 32;
  r0 = (4 * (sg % ROW_BLOCKS) + lane / 8) * (tile_rows * 16 / NT);
  c0 = (8 * (sg / ROW_BLOCKS) + lane % 8) * tn;
}

// One K step's multiply-accumulates at this block's rows per thread (uniform over the threadgroup).
template <int NT, int NM, int TN>
inline void moe_rt_mac_rows(int tile_rows, thread float (&acc)[2][MOE_RT_TM_MAX(NT)][8], const threadgroup float* xt,
                            const threadgroup float* w0, const threadgroup float* w1, int ld, int r0, int c0) {
  constexpr int TMX = MOE_RT_TM_MAX(NT);
  const int tm = tile_rows * 16 / NT;
  if (tm == TMX) {
    moe_rt_mac<NT, NM, TMX, TN>(acc, xt, w0, w1, ld, r0, c0);
  } else if (tm == TMX / 2) {
    moe_rt_mac<NT, NM, TMX / 2, TN>(acc, xt, w0, w1, ld, r0, c0);
  } else {
    moe_rt_mac<NT, NM, TMX / 4, TN>(acc, xt, w0, w1, ld, r0, c0);
  }
}

// @kernel moe_gemm_gate_up_swiglu
// grid (I / 32 * 128, max_blocks, 1), threadgroup (128, 1, 1). params: [top_k, D, I, E, A, N].
// x [N, D] tokens; sorted_rows [A]; blocks [max_blocks, 4]; w_gate, w_up: [E, I, D / 8] uint32
// (+ scales/biases [E, I, D / 64]) or dequantised [E, I, D]; w_gate_s, w_up_s: the shared expert's
// [m * I, D / 8] uint32 (+ scales/biases), read by blocks of experts E + c. h [A (+ m * N), I]: rows
// in slot order. MT: the tile operands' type (float, or T for tensor-core fragments).
// xs holds the activation tile (as MT) during the K loop, then the fp32 results of the epilogue.
threadgroup float xs[MOE_MAX_ROWS * MOE_XT_LD];
threadgroup MT* xt = reinterpret_cast<threadgroup MT*>(xs);
threadgroup MT wg[MOE_BK * MOE_WT_LD];
threadgroup MT wu[MOE_BK * MOE_WT_LD];
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
// Gate and up results side by side in xs ([rows][64]: gate in columns 0..31, up in 32..63).
moe_store_acc(acc_g, xs, MOE_BK, row0, col0, nj);
moe_store_acc(acc_u, xs, MOE_BK, row0, MOE_BN + col0, nj);
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int i = int(tid); i < tile_rows * MOE_BN; i += MOE_THREADS) {
  int r = i / MOE_BN;
  int c = i % MOE_BN;
  if (r < rows) {
    float g = xs[r * MOE_BK + c];
    float u = xs[r * MOE_BK + MOE_BN + c];
    h[long(first + r) * I + n0 + c] = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);
  }
}

// @kernel moe_gemm_down
// grid (D / 32 * 128, max_blocks, 1), threadgroup (128, 1, 1). params: [I, D, E, Is].
// h [A (+ N), I] rows in slot order; w_down [E, D, I / 8] uint32 (+ scales/biases [E, D, I / 64]) or
// dequantised [E, D, I]; w_down_s the shared expert's [D, Is / 8] (Is = m * I; blocks of expert E + c
// read its columns c * I ..). y [A (+ m * N), D] rows in slot order. MT: as in moe_gemm_gate_up_swiglu.
threadgroup float xs[MOE_MAX_ROWS * MOE_XT_LD];
threadgroup MT* xt = reinterpret_cast<threadgroup MT*>(xs);
threadgroup MT wt[MOE_BK * MOE_WT_LD];
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
moe_store_acc(acc, xs, MOE_BN, row0, col0, nj);
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int i = int(tid); i < tile_rows * MOE_BN; i += MOE_THREADS) {
  int r = i / MOE_BN;
  int c = i % MOE_BN;
  if (r < rows) {
    y[long(first + r) * D + n0 + c] = static_cast<T>(xs[r * MOE_BN + c]);
  }
}

// @kernel moe_gemm_gate_up_swiglu_regtile
// grid (I / 64 * NT, max_blocks, 1), threadgroup (NT, 1, 1), NT = 64, 128 or 256 (template); inputs, params and
// output as moe_gemm_gate_up_swiglu (I % 64 == 0), same bits. Thread (rg, cg): rows rg * TM .., gate and up
// columns n0 + cg * 4 .. + 4 of both matrices. The 128 staged columns (gate 0 .. 63, then up) go to threads
// c % NT, WPASS = 128 / NT of them a thread at NT = 64, one to each of the first 128 threads otherwise. WR
// (template, 0 or 1): the loops over a thread's staged columns unrolled, so that their weights stay in registers
// (with WR = 0 at NT = 64 the compiler keeps the loop and puts them in local memory, 4-7 % slower on the H200;
// the product launches WR = 1, tiles "register64_rolled" WR = 0). Same operations either way, so the same bits.
// SK (template): 1, or the K-split candidate's arithmetic (the staged GEMV's layout (R, KC, SK)): each output's sums
// over K ranges of D / SK values, kept apart and added in range order as each range ends, so that a row has the
// split GEMV's bits.
threadgroup float4 xt4[MOE_RT_BK * MOE_RT_XLD(NT) / 4];  // float4: 16-byte aligned for the vector loads
threadgroup float* xt = reinterpret_cast<threadgroup float*>(xt4);
threadgroup float4 wt4[2 * MOE_RT_BK * MOE_RT_GU_LD / 4];  // gate tile, then up tile
threadgroup float* wt = reinterpret_cast<threadgroup float*>(wt4);
constexpr int WPASS = NT >= 2 * MOE_RT_GU_COLS ? 1 : 2 * MOE_RT_GU_COLS / NT;
const uint tid = thread_index_in_threadgroup;
const int n0 = int(threadgroup_position_in_grid.x) * MOE_RT_GU_COLS;
const int blk = int(threadgroup_position_in_grid.y);
const int e = blocks[4 * blk + 0];
const int first = blocks[4 * blk + 1];
const int rows = blocks[4 * blk + 2];
const int tile_rows = blocks[4 * blk + 3];
if (rows == 0) {
  return;  // padding entry of the block map: the whole threadgroup leaves
}
int r0, c0;
moe_rt_thread_origin<NT>(tid, tile_rows, 4, r0, c0);
const int chunk = e - E;  // >= 0: a chunk of the shared expert
const bool loads = int(tid) < 2 * MOE_RT_GU_COLS;  // this thread stages weight columns
const int src = moe_rt_row_source<true>(sorted_rows, first, rows, tile_rows, top_k, tid,
                                        chunk >= 0 ? first - A - chunk * N : -1);
float acc[2][MOE_RT_TM_MAX(NT)][8];
for (int m = 0; m < 2; ++m) {
  for (int i = 0; i < MOE_RT_TM_MAX(NT); ++i) {
    for (int j = 0; j < 8; ++j) {
      acc[m][i][j] = 0.0f;
    }
  }
}
float tot[2][MOE_RT_TM_MAX(NT)][4];  // SK > 1: the ended K ranges' sums, added in range order
MoeRtWeightRegs wr[WPASS];
uint xw[MOE_RT_XV(NT)];
for (int k0 = 0; k0 < D; k0 += MOE_RT_BK) {
  // Step k0's operands: fetched ahead during the last step (or now, for the first), staged now.
  #pragma unroll (WR != 0 ? WPASS : 1)
  for (int p = 0; p < WPASS; ++p) {
    const int c = int(tid) + p * NT;  // staged column: matrix c / 64, column c % 64
    const long wrow = long(chunk >= 0 ? chunk : e) * I + n0 + c % MOE_RT_GU_COLS;
    threadgroup float* wcol = wt + (c / MOE_RT_GU_COLS) * MOE_RT_BK * MOE_RT_GU_LD + c % MOE_RT_GU_COLS;
    const bool gate = c < MOE_RT_GU_COLS;
    if (k0 == 0 && loads && chunk >= 0) {
      moe_rt_fetch_weight(gate ? w_gate_s : w_up_s, gate ? scales_gate_s : scales_up_s,
                          gate ? biases_gate_s : biases_up_s, wrow, 0, D, wr[p]);
    } else if (k0 == 0 && loads) {
      moe_rt_fetch_weight(gate ? w_gate : w_up, gate ? scales_gate : scales_up, gate ? biases_gate : biases_up,
                          wrow, 0, D, wr[p]);
    }
    if (loads && chunk >= 0) {
      moe_rt_store_weight(gate ? w_gate_s : w_up_s, gate ? scales_gate_s : scales_up_s,
                          gate ? biases_gate_s : biases_up_s, wrow, k0, D, wr[p], wcol, MOE_RT_GU_LD);
    } else if (loads) {
      moe_rt_store_weight(gate ? w_gate : w_up, gate ? scales_gate : scales_up, gate ? biases_gate : biases_up,
                          wrow, k0, D, wr[p], wcol, MOE_RT_GU_LD);
    }
  }
  if (k0 == 0) {
    moe_rt_fetch_rows<NT, T>(x, src, tile_rows, 0, D, tid, xw);
  }
  moe_rt_store_rows<NT, T>(xw, tile_rows, tid, xt);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (k0 + MOE_RT_BK < D) {  // the next step's device loads, in flight during this step's FMAs
    #pragma unroll (WR != 0 ? WPASS : 1)
    for (int p = 0; p < WPASS; ++p) {
      const int c = int(tid) + p * NT;
      const long wrow = long(chunk >= 0 ? chunk : e) * I + n0 + c % MOE_RT_GU_COLS;
      const bool gate = c < MOE_RT_GU_COLS;
      if (loads && chunk >= 0) {
        moe_rt_fetch_weight(gate ? w_gate_s : w_up_s, gate ? scales_gate_s : scales_up_s,
                            gate ? biases_gate_s : biases_up_s, wrow, k0 + MOE_RT_BK, D, wr[p]);
      } else if (loads) {
        moe_rt_fetch_weight(gate ? w_gate : w_up, gate ? scales_gate : scales_up, gate ? biases_gate : biases_up,
                            wrow, k0 + MOE_RT_BK, D, wr[p]);
      }
    }
    moe_rt_fetch_rows<NT, T>(x, src, tile_rows, k0 + MOE_RT_BK, D, tid, xw);
  }
  moe_rt_mac_rows<NT, 2, 4>(tile_rows, acc, xt, wt, wt + MOE_RT_BK * MOE_RT_GU_LD, MOE_RT_GU_LD, r0, c0);
  if (SK > 1 && (k0 + MOE_RT_BK) % (D / SK) == 0) {  // a K range ends here (uniform over the threadgroup)
    const bool first_range = k0 + MOE_RT_BK == D / SK;
    #pragma unroll
    for (int m = 0; m < 2; ++m) {
      #pragma unroll
      for (int i = 0; i < MOE_RT_TM_MAX(NT); ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          tot[m][i][j] = first_range ? acc[m][i][j] : tot[m][i][j] + acc[m][i][j];
          acc[m][i][j] = 0.0f;
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
#pragma unroll
for (int i = 0; i < MOE_RT_TM_MAX(NT); ++i) {  // constant trip count: acc stays in registers
  if (i < tile_rows * 16 / NT && r0 + i < rows) {
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float g = SK > 1 ? tot[0][i][j] : acc[0][i][j];
      const float u = SK > 1 ? tot[1][i][j] : acc[1][i][j];
      h[long(first + r0 + i) * I + n0 + c0 + j] = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);
    }
  }
}

// @kernel moe_gemm_down_regtile
// grid (D / (16 * TN) * NT, max_blocks, 1), threadgroup (NT, 1, 1), NT = 64, 128 or 256; TN (4 or 8) columns per
// thread (templates). Inputs, params and output as moe_gemm_down, same bits. Thread (rg, cg): rows rg * TM ..,
// columns n0 + cg * TN .. + TN; the 16 * TN staged columns go to threads c % NT (WPASS a thread).
threadgroup float4 xt4[MOE_RT_BK * MOE_RT_XLD(NT) / 4];  // float4: 16-byte aligned for the vector loads
threadgroup float* xt = reinterpret_cast<threadgroup float*>(xt4);
threadgroup float4 wt4[MOE_RT_BK * (16 * TN + 4) / 4];
threadgroup float* wt = reinterpret_cast<threadgroup float*>(wt4);
constexpr int WPASS = NT >= 16 * TN ? 1 : 16 * TN / NT;
const int cols = 16 * TN;
const int ld = cols + 4;
const uint tid = thread_index_in_threadgroup;
const int n0 = int(threadgroup_position_in_grid.x) * cols;
const int blk = int(threadgroup_position_in_grid.y);
const int e = blocks[4 * blk + 0];
const int first = blocks[4 * blk + 1];
const int rows = blocks[4 * blk + 2];
const int tile_rows = blocks[4 * blk + 3];
if (rows == 0) {
  return;  // padding entry of the block map: the whole threadgroup leaves
}
int r0, c0;
moe_rt_thread_origin<NT>(tid, tile_rows, TN, r0, c0);
const bool loads = int(tid) < cols;  // this thread stages weight columns tid (+ NT ..)
const bool shared = e >= E;          // chunk e - E of the shared expert: its K range within the shared rows
const long wrow0 = shared ? long(n0 + int(tid)) : long(e) * D + n0 + int(tid);
const int koff = shared ? (e - E) * I : 0;
const int src = moe_rt_row_source<false>(blocks, first, rows, tile_rows, 1, tid, -1);
float acc[2][MOE_RT_TM_MAX(NT)][8];
for (int i = 0; i < MOE_RT_TM_MAX(NT); ++i) {
  for (int j = 0; j < 8; ++j) {
    acc[0][i][j] = 0.0f;
  }
}
MoeRtWeightRegs wr[WPASS];
uint xw[MOE_RT_XV(NT)];
for (int k0 = 0; k0 < I; k0 += MOE_RT_BK) {
  for (int p = 0; p < WPASS; ++p) {
    const long wrow = wrow0 + p * NT;
    if (k0 == 0 && loads && shared) {
      moe_rt_fetch_weight(w_down_s, scales_down_s, biases_down_s, wrow, koff, Is, wr[p]);
    } else if (k0 == 0 && loads) {
      moe_rt_fetch_weight(w_down, scales_down, biases_down, wrow, 0, I, wr[p]);
    }
    if (loads && shared) {
      moe_rt_store_weight(w_down_s, scales_down_s, biases_down_s, wrow, koff + k0, Is, wr[p], wt + tid + p * NT, ld);
    } else if (loads) {
      moe_rt_store_weight(w_down, scales_down, biases_down, wrow, k0, I, wr[p], wt + tid + p * NT, ld);
    }
  }
  if (k0 == 0) {
    moe_rt_fetch_rows<NT, T>(h, src, tile_rows, 0, I, tid, xw);
  }
  moe_rt_store_rows<NT, T>(xw, tile_rows, tid, xt);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (k0 + MOE_RT_BK < I) {
    for (int p = 0; p < WPASS; ++p) {
      const long wrow = wrow0 + p * NT;
      if (loads && shared) {
        moe_rt_fetch_weight(w_down_s, scales_down_s, biases_down_s, wrow, koff + k0 + MOE_RT_BK, Is, wr[p]);
      } else if (loads) {
        moe_rt_fetch_weight(w_down, scales_down, biases_down, wrow, k0 + MOE_RT_BK, I, wr[p]);
      }
    }
    moe_rt_fetch_rows<NT, T>(h, src, tile_rows, k0 + MOE_RT_BK, I, tid, xw);
  }
  moe_rt_mac_rows<NT, 1, TN>(tile_rows, acc, xt, wt, wt, ld, r0, c0);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
#pragma unroll
for (int i = 0; i < MOE_RT_TM_MAX(NT); ++i) {  // constant trip count: acc stays in registers
  if (i < tile_rows * 16 / NT && r0 + i < rows) {
    #pragma unroll
    for (int j = 0; j < TN; ++j) {
      y[long(first + r0 + i) * D + n0 + c0 + j] = static_cast<T>(acc[0][i][j]);
    }
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
// grid (ceil(D / 4 / 128) * 128, N, 1), threadgroup (128, 1, 1). params: [k, D, A, shared_chunks,
// has_residual] (D % 4 == 0). y [A (+ m * N), D] the down GEMM's rows in slot order; slot_of_row [A]:
// slot of assignment a = token * k + j; scores [N, k] routing weights; gate [N] fp32 the shared
// expert's sigmoid gate (m = shared_chunks > 0: its chunk rows of token n are slots A + c * N + n);
// residual [N, D] T (if has_residual). out [N, D]: each token's k rows read straight from slot order,
// weighted and summed in fp32 (then the gated shared chunks), rounded once (no [A, D] gather or product
// arrays in between); with has_residual (switch fused_residual) the decoder layer's residual add
// follows, as MLX adds two T arrays: T(float(residual) + float(T(sum))), the same bits as that add.
// The k rows are taken MOE_COMBINE_LOADS at a time: their weights and slots, then their values, all
// loaded before the first is added (the loads' latencies overlap), then added in j order as before. The
// residual and the first shared chunk (gate and row) are loaded first: they depend on no other load, so
// their latency overlaps the routed rows' (Nsight Compute on the H200: a decode launch is a chain of
// dependent loads, 4 threadgroups).
const int d0 = int(thread_position_in_grid.x) * 4;
const long n = long(thread_position_in_grid.y);
if (d0 < D) {
  const long num_tokens = long(threads_per_grid.y);
  float res[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float shared0[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const float g = shared_chunks > 0 ? gate[n] : 0.0f;
  for (int c = 0; c < 4; ++c) {
    if (has_residual != 0) {
      res[c] = float(residual[n * D + d0 + c]);
    }
    if (shared_chunks > 0) {
      shared0[c] = float(y[(long(A) + n) * D + d0 + c]);
    }
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j0 = 0; j0 < k; j0 += MOE_COMBINE_LOADS) {
    float w[MOE_COMBINE_LOADS];
    long src[MOE_COMBINE_LOADS];
    for (int u = 0; u < MOE_COMBINE_LOADS; ++u) {
      if (j0 + u < k) {
        w[u] = float(scores[n * k + j0 + u]);
        src[u] = long(slot_of_row[n * k + j0 + u]) * D + d0;
      }
    }
    float v[MOE_COMBINE_LOADS][4];
    for (int u = 0; u < MOE_COMBINE_LOADS; ++u) {
      if (j0 + u < k) {
        for (int c = 0; c < 4; ++c) {
          v[u][c] = float(y[src[u] + c]);
        }
      }
    }
    for (int u = 0; u < MOE_COMBINE_LOADS; ++u) {
      if (j0 + u < k) {
        for (int c = 0; c < 4; ++c) {
          acc[c] += w[u] * v[u][c];
        }
      }
    }
  }
  for (int chunk = 0; chunk < shared_chunks; ++chunk) {
    const long src = (long(A) + chunk * num_tokens + n) * D + d0;
    for (int c = 0; c < 4; ++c) {
      acc[c] += g * (chunk == 0 ? shared0[c] : float(y[src + c]));
    }
  }
  for (int c = 0; c < 4; ++c) {
    const T mixed = static_cast<T>(acc[c]);
    out[n * D + d0 + c] = has_residual != 0 ? static_cast<T>(res[c] + float(mixed)) : mixed;
  }
}

// @kernel moe_gemv_gate_up_swiglu
// grid (I / R * 2R SK, n_blocks, 1), threadgroup (2R SK, 1, 1); template T, R (outputs per threadgroup,
// dividing I), KC (K chunk: a multiple of 64 dividing D / SK), SK (1 but for the candidate below). params: [top_k, D,
// I, E, A, N].
// The decode form of moe_gemm_gate_up_swiglu for one-row blocks (expert, slot, 1, tile): same
// inputs, same h, the same bits per element. Rows of shared chunk c (expert id E + c) are token
// slot - A - c * N; routed rows are token sorted_rows[slot] / top_k. Threads 0 .. R-1 run the gate
// chains of outputs o0 .. o0 + R - 1, threads R .. 2R-1 their up chains (staged form: see the header).
// SK (template): 1, or the K split (MoeGemvShape: 2R SK threads, each sum SK chains added in order), under switch
// split_k_gate_up (off by default), where the register tiles of larger calls split alike (the same bits).
threadgroup uint4 gemv_ws[2 * 2 * R * SK * (KC / 32 + 1)];
threadgroup float gemv_ss[2 * 2 * R * SK * (KC / 64)];
threadgroup float gemv_bs[2 * 2 * R * SK * (KC / 64)];
threadgroup float4 gemv_xs[2 * SK * (KC / 4)];
threadgroup float up_sums[R];
const uint tid = thread_index_in_threadgroup;
const int blk = int(threadgroup_position_in_grid.y);
const int e = blocks[4 * blk + 0];
const int slot = blocks[4 * blk + 1];
if (blocks[4 * blk + 2] == 0) {
  return;  // padding entry: the whole threadgroup leaves
}
const long token = e >= E ? long(slot - A - (e - E) * N) : long(sorted_rows[slot] / top_k);
moe_gemv_gate_up_rows<R, KC, T, SK>(e, slot, token, E, I, D, int(threadgroup_position_in_grid.x) * R, tid, x, w_gate,
                                scales_gate, biases_gate, w_up, scales_up, biases_up, w_gate_s, scales_gate_s,
                                biases_gate_s, w_up_s, scales_up_s, biases_up_s, gemv_ws, gemv_ss, gemv_bs, gemv_xs,
                                up_sums, h);

// @kernel moe_gemv_gate_up_swiglu_direct
// moe_gemv_gate_up_swiglu with each chain's weight row read by its own thread straight from device memory
// (moe_gemv_chain_direct: KB quantisation groups a register batch, the next batch's loads issued before this batch's
// sums) instead of staged chunks: no barrier and no threadgroup copy per chunk, a chain's memory latency exposed
// once per KB groups. The threadgroup first stages its token's activation row as floats (KX = D floats). A benchmark
// layout (level with the staged form as an op, slower in a decode step on the H100, 2026-12-05; docs/moe.md): same
// grid, inputs and outputs as moe_gemv_gate_up_swiglu, the same sums in the same k order, so the same bits.
// grid (I / R * 2R, n_blocks, 1), threadgroup (2R, 1, 1); template T, R (dividing I; 2R whole simdgroups), KB
// (dividing D / 64), KX (= D). params: [top_k, D, I, E, A, N]. Threads 0 .. R-1 run the gate chains, R .. 2R-1 up.
threadgroup float4 gemv_xrow[KX / 4];
threadgroup float up_sums[R];
const uint tid = thread_index_in_threadgroup;
const int blk = int(threadgroup_position_in_grid.y);
const int e = blocks[4 * blk + 0];
const int slot = blocks[4 * blk + 1];
if (blocks[4 * blk + 2] == 0) {
  return;  // padding entry: the whole threadgroup leaves
}
const long token = e >= E ? long(slot - A - (e - E) * N) : long(sorted_rows[slot] / top_k);
const bool shared = e >= E;
const int o0 = int(threadgroup_position_in_grid.x) * R;
const bool up = int(tid) >= R;
const long row = long(shared ? e - E : e) * I + o0 + int(tid) % R;  // this chain's weight row
const device T* xsrc = x + token * D;
for (int i = int(tid); i < KX / 4; i += 2 * R) {  // the activations as floats, moe_gemv_staged's values
  gemv_xrow[i] = float4(float(xsrc[4 * i]), float(xsrc[4 * i + 1]), float(xsrc[4 * i + 2]), float(xsrc[4 * i + 3]));
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const device uint32_t* w = shared ? (up ? w_up_s : w_gate_s) : (up ? w_up : w_gate);
const device T* sc = shared ? (up ? scales_up_s : scales_gate_s) : (up ? scales_up : scales_gate);
const device T* bi = shared ? (up ? biases_up_s : biases_gate_s) : (up ? biases_up : biases_gate);
const float acc = moe_gemv_chain_direct<KB, T>(w + row * (D / 8), sc + row * (D / 64), bi + row * (D / 64), gemv_xrow,
                                               KX, q4_exponent_unfolded(E));
moe_gemv_swiglu_out<R, T>(acc, tid, up, slot, I, o0, up_sums, h);

// @kernel moe_gemv_gate_up_swiglu_routed
// moe_gemv_gate_up_swiglu for a decode call with the router's top-k inside (switch fused_topk_gemv): one
// launch fewer per MoE layer. Each threadgroup selects its token's experts from moe_router_logits_q's
// logits itself (simdgroup 0, moe_router_picks: ~1 us of redundant work per threadgroup, the bits of
// moe_router_topk_from_logits), takes its block's expert, and runs the same rows as the plain form.
// The x = 0 threadgroup of each block writes that block's share of the top-k kernel's outputs (each
// element written once): pick j's inds / scores / block row, the gate (pick 0's), a shared chunk's block row.
// grid (I / R * 2R SK, N * (k + m), 1), threadgroup (2R SK, 1, 1); template T, R, KC, NPL (ceil(E / 32)), SK (1;
// switch split_k_gate_up: the K split of moe_gemv_gate_up_swiglu, KC dividing D / SK), PD (chunks in flight, with SK
// = 1, dividing D / KC; the same bits at any value: GATE_UP_IN_FLIGHT).
// params: [top_k, D, I, E, A, N, norm_topk, has_gate, decode_tile, shared_chunks] (A = N * top_k, m =
// shared_chunks). Block b < A: assignment b (token b / k, pick b % k); b >= A: shared chunk (b - A) / N of
// token (b - A) % N. x [N, D]; logits [N, E + 1] fp32; weights as moe_gemv_gate_up_swiglu's.
// Outputs: h [A + m N, I]; inds [N, k] int32, scores [N, k] T, gate [N] fp32, blocks [A + m N, 4] int32.
threadgroup uint4 gemv_ws[2 * 2 * R * SK * (KC / 32 + 1)];
threadgroup float gemv_ss[2 * 2 * R * SK * (KC / 64)];
threadgroup float gemv_bs[2 * 2 * R * SK * (KC / 64)];
threadgroup float4 gemv_xs[2 * SK * (KC / 4)];
threadgroup float up_sums[R];
threadgroup float probs[MOE_ROUTER_MAX_E + 1];
threadgroup int block_expert;
const uint tid = thread_index_in_threadgroup;
const int blk = int(threadgroup_position_in_grid.y);
const bool shared = blk >= A;
const long token = shared ? long((blk - A) % N) : long(blk / top_k);
const int j = shared ? (blk - A) / N : blk % top_k;  // the pick, or the shared chunk
moe_routed_block_expert<T, NPL>(logits, token, j, shared, blk, E, top_k, has_gate, norm_topk, decode_tile,
                                threadgroup_position_in_grid.x == 0, simdgroup_index_in_threadgroup,
                                thread_index_in_simdgroup, probs, &block_expert, inds, scores, gate, blocks);
threadgroup_barrier(mem_flags::mem_threadgroup);
moe_gemv_gate_up_rows<R, KC, T, SK, PD>(block_expert, blk, token, E, I, D, int(threadgroup_position_in_grid.x) * R,
                                        tid, x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, w_gate_s,
                                        scales_gate_s, biases_gate_s, w_up_s, scales_up_s, biases_up_s, gemv_ws,
                                        gemv_ss, gemv_bs, gemv_xs, up_sums, h);

// @kernel moe_gemv_down
// grid (D / R * R, n_blocks, 1), threadgroup (R, 1, 1); template T, R (outputs per threadgroup,
// dividing D), KC (a multiple of 64 dividing I). params: [I, D, E, Is].
// The decode form of moe_gemm_down for one-row blocks: y[slot] = h[slot] . Wd[e]^T, same bits.
// Thread t: output o0 + t (staged form: see the header).
threadgroup uint4 gemv_ws[2 * R * (KC / 32 + 1)];
threadgroup float gemv_ss[2 * R * (KC / 64)];
threadgroup float gemv_bs[2 * R * (KC / 64)];
threadgroup float4 gemv_xs[2 * (KC / 4)];
const uint tid = thread_index_in_threadgroup;
const int blk = int(threadgroup_position_in_grid.y);
const int e = blocks[4 * blk + 0];
const int slot = blocks[4 * blk + 1];
if (blocks[4 * blk + 2] == 0) {
  return;  // padding entry: the whole threadgroup leaves
}
const int o0 = int(threadgroup_position_in_grid.x) * R;
// Routed: rows e * D + o0 .. of w_down [E, D, I / 8]. Chunk e - E of the shared expert: columns
// (e - E) * I .. of rows o0 .. of w_down_s [D, Is / 8].
const bool shared = e >= E;
const long words = shared ? long(o0) * (Is / 8) + (e - E) * (I / 8) : (long(e) * D + o0) * (I / 8);
const long groups = shared ? long(o0) * (Is / 64) + (e - E) * (I / 64) : (long(e) * D + o0) * (I / 64);
const device uint32_t* w = (shared ? w_down_s : w_down) + words;
const device T* s = (shared ? scales_down_s : scales_down) + groups;
const device T* b = (shared ? biases_down_s : biases_down) + groups;
const float acc = moe_gemv_staged<1, R, KC, T>(w, w, shared ? Is / 8 : I / 8, s, s, b, b, shared ? Is / 64 : I / 64,
                                               h + long(slot) * I, I, tid, gemv_ws, gemv_ss, gemv_bs, gemv_xs,
                                               q4_exponent_unfolded(E));
y[long(slot) * D + o0 + int(tid)] = static_cast<T>(acc);

// @kernel moe_gemv_down_combine
// moe_gemv_down and moe_combine_weighted_rows in one launch for a decode call (switch fused_down_combine): a
// threadgroup per (token, R output columns) runs the down GEMV of each of the token's NBLK = k + m blocks (its k
// routed rows, then its m shared-expert chunks) in its own group of R threads (group j: threads j * R .. j * R +
// R - 1), with moe_gemv_down's staged chains (moe_gemv_staged), keeps each result rounded to T as y would hold it,
// and the first R threads then combine them with the combine kernel's expression and order (routed rows in j order
// weighted by their scores, then the gated shared chunks, rounded once, then the residual add as MLX adds two T
// arrays). So out has the bits of moe_gemv_down followed by moe_combine_weighted_rows, and y never goes to memory:
// one launch and one dependent round trip fewer per MoE layer. The threadgroup is NG >= NBLK groups, whole
// simdgroups: groups past NBLK repeat block 0's GEMV (every thread reaches every barrier) and are not used.
// The decode schedule's blocks: routed row j of token n is block (and slot) n * k + j, shared chunk c is block
// A + c * N + n (moe_router_write_pick, moe_router_write_shared_block).
// grid (D / R * R * NG, N, 1), threadgroup (R * NG, 1, 1); template T, R (dividing D), KC (a multiple of 64
// dividing I; the host fits NG double buffers in 32 KB), NBLK, NG, PD (chunks in flight, dividing I / KC: 1 is
// moe_gemv_staged's schedule, more moe_gemv_staged_ring's; the same bits; switch down_combine_ring), GS (1: each group
// waits for its own chunks at a simdgroup barrier, R dividing 32; switch down_combine_simd_barriers). params: [I, D,
// E, Is, k, A, shared_chunks, has_residual]. h [A + m N, I] T; blocks [A + m N, 4] int32; the down weights as moe_gemv_down's; scores [N, k] T;
// gate [N] fp32 (read when m > 0); residual [N, D] T (read when has_residual). out [N, D] T.
// Each group's two staging buffers (moe_gemv_staged), as moe_gemv_down declares them, one after another.
constexpr int WS = 2 * R * (KC / 32 + 1);  // uint4, padded rows
constexpr int SB = 2 * R * (KC / 64);      // floats
constexpr int XS = 2 * (KC / 4);           // float4
threadgroup uint4 gemv_ws[NG * WS];
threadgroup float gemv_ss[NG * SB];
threadgroup float gemv_bs[NG * SB];
threadgroup float4 gemv_xs[NG * XS];
const uint tid = thread_index_in_threadgroup;
const int group = int(tid) / R;
const uint r = tid % uint(R);
const int j = group < NBLK ? group : 0;  // the token's block j
const int n = int(threadgroup_position_in_grid.y);
const int num_tokens = int(threads_per_grid.y);
const int o0 = int(threadgroup_position_in_grid.x) * R;
// The combine's own inputs first: they depend on no other load.
float res = 0.0f;
float g = 0.0f;
if (group == 0) {
  if (has_residual != 0) {
    res = float(residual[long(n) * D + o0 + int(r)]);
  }
  if (shared_chunks > 0) {
    g = gate[n];
  }
}
const int blk = j < k ? n * k + j : A + (j - k) * num_tokens + n;
const int e = blocks[4 * blk + 0];
const int slot = blocks[4 * blk + 1];
// moe_gemv_down's rows: routed rows e * D + o0 .. of w_down [E, D, I / 8]; chunk e - E of the shared expert:
// columns (e - E) * I .. of rows o0 .. of w_down_s [D, Is / 8].
const bool shared = e >= E;
const long words = shared ? long(o0) * (Is / 8) + (e - E) * (I / 8) : (long(e) * D + o0) * (I / 8);
const long groups = shared ? long(o0) * (Is / 64) + (e - E) * (I / 64) : (long(e) * D + o0) * (I / 64);
const device uint32_t* w = (shared ? w_down_s : w_down) + words;
const device T* s = (shared ? scales_down_s : scales_down) + groups;
const device T* b = (shared ? biases_down_s : biases_down) + groups;
const float acc = PD > 1 || GS != 0
    ? moe_gemv_staged_ring<1, R, KC, T, PD, GS != 0>(
          w, w, shared ? Is / 8 : I / 8, s, s, b, b, shared ? Is / 64 : I / 64, h + long(slot) * I, I, r,
          gemv_ws + group * WS, gemv_ss + group * SB, gemv_bs + group * SB, gemv_xs + group * XS,
          q4_exponent_unfolded(E))
    : moe_gemv_staged<1, R, KC, T>(
          w, w, shared ? Is / 8 : I / 8, s, s, b, b, shared ? Is / 64 : I / 64, h + long(slot) * I, I, r,
          gemv_ws + group * WS, gemv_ss + group * SB, gemv_bs + group * SB, gemv_xs + group * XS,
          q4_exponent_unfolded(E));
// moe_gemv_staged ends on a barrier: every chain is done with the staging buffers, gemv_ss is free (with GS, only the
// group's own chains: the threadgroup's barrier first, as the sums below land in other groups' buffers).
if (GS != 0) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (group < NBLK) {
  gemv_ss[group * R + int(r)] = float(static_cast<T>(acc));  // y[slot, o0 + r] as moe_gemv_down stores it
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (group == 0) {
  moe_down_combine_out<R>(gemv_ss, int(r), n, o0 + int(r), D, k, shared_chunks, g, res, has_residual, scores, out);
}

// @kernel moe_gemv_down_combine_direct
// moe_gemv_down_combine with each chain's weight row read by its own thread straight from device memory
// (moe_gemv_chain_direct: KB quantisation groups a register batch, the next batch in flight during this one's
// sums) instead of staged chunks: no barrier per chunk, a chunk's latency exposed once per KB groups rather than
// once per 64-wide chunk (the staged layout's 32 KB of threadgroup memory allows no more for 10 groups). Each
// group first stages its block's activation row as floats (KX = I floats; the host fits NG rows in 32 KB). Same
// grid, threadgroup, inputs, blocks and combine as moe_gemv_down_combine, so the same bits; template T, R, KB
// (dividing I / 64), KX (= I), NBLK, NG.
threadgroup float4 gemv_xrows[NG * (KX / 4)];
threadgroup float gemv_ys[NG * R];
const uint tid = thread_index_in_threadgroup;
const int group = int(tid) / R;
const uint r = tid % uint(R);
const int j = group < NBLK ? group : 0;
const int n = int(threadgroup_position_in_grid.y);
const int num_tokens = int(threads_per_grid.y);
const int o0 = int(threadgroup_position_in_grid.x) * R;
float res = 0.0f;
float g = 0.0f;
if (group == 0) {
  if (has_residual != 0) {
    res = float(residual[long(n) * D + o0 + int(r)]);
  }
  if (shared_chunks > 0) {
    g = gate[n];
  }
}
const int blk = j < k ? n * k + j : A + (j - k) * num_tokens + n;
const int e = blocks[4 * blk + 0];
const int slot = blocks[4 * blk + 1];
const bool shared = e >= E;
const long row = long(o0) + int(r);  // this chain's output column
const long words = shared ? row * (Is / 8) + (e - E) * (I / 8) : (long(e) * D + row) * (I / 8);
const long groups = shared ? row * (Is / 64) + (e - E) * (I / 64) : (long(e) * D + row) * (I / 64);
threadgroup float4* xrow = gemv_xrows + group * (KX / 4);
const device T* hrow = h + long(slot) * I;
for (int i = int(r); i < KX / 4; i += R) {  // the activations as floats, moe_gemv_staged's values
  xrow[i] = float4(float(hrow[4 * i]), float(hrow[4 * i + 1]), float(hrow[4 * i + 2]), float(hrow[4 * i + 3]));
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float acc = moe_gemv_chain_direct<KB, T>((shared ? w_down_s : w_down) + words,
                                               (shared ? scales_down_s : scales_down) + groups,
                                               (shared ? biases_down_s : biases_down) + groups, xrow, KX,
                                               q4_exponent_unfolded(E));
if (group < NBLK) {
  gemv_ys[group * R + int(r)] = float(static_cast<T>(acc));  // y[slot, o0 + r] as moe_gemv_down stores it
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (group == 0) {
  moe_down_combine_out<R>(gemv_ys, int(r), n, o0 + int(r), D, k, shared_chunks, g, res, has_residual, scores, out);
}

// @kernel moe_gemv_gate_up_swiglu_rowwise
// grid (I, n_blocks, 1), threadgroup (TG, 1, 1) with I % TG == 0, D <= MOE_GEMV_MAX_K; template T, CVT
// (moe_gemv_q4_dot). params: [top_k, D, I, E, A, N].
// The rowwise decode form of moe_gemm_gate_up_swiglu (benchmark baseline and test oracle of the staged
// moe_gemv_gate_up_swiglu; same inputs, same h, the same bits per element). Rows of shared chunk c (expert id E + c) are token
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
const float g = shared ? moe_gemv_q4_dot<CVT>(wg_row, scales_gate_s + srow, biases_gate_s + srow, xs, D)
                       : moe_gemv_q4_dot<CVT>(wg_row, scales_gate + srow, biases_gate + srow, xs, D);
const float u = shared ? moe_gemv_q4_dot<CVT>(wu_row, scales_up_s + srow, biases_up_s + srow, xs, D)
                       : moe_gemv_q4_dot<CVT>(wu_row, scales_up + srow, biases_up + srow, xs, D);
h[long(slot) * I + col] = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);

// @kernel moe_gemv_down_rowwise
// grid (D, n_blocks, 1), threadgroup (TG, 1, 1) with D % TG == 0, I <= MOE_GEMV_MAX_K; template T, CVT.
// params: [I, D, E, Is].
// The rowwise decode form of moe_gemm_down (baseline and oracle of the staged moe_gemv_down).
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
  acc = moe_gemv_q4_dot<CVT>(w_down_s + words, scales_down_s + groups, biases_down_s + groups, xs, I);
} else {
  const long row = long(e) * D + col;
  acc = moe_gemv_q4_dot<CVT>(w_down + row * (I / 8), scales_down + row * (I / 64), biases_down + row * (I / 64), xs, I);
}
y[long(slot) * D + col] = static_cast<T>(acc);
