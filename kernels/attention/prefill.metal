// Prefill attention (a chunk of L query rows per sequence) of the Qwen3.5/3.6 full-attention layers.
//
// For query head h of sequence b at chunk position i (absolute position t = S - L + i), with its KV
// head hkv = h / G (G = Hq / Hkv, GQA as MLX groups it):
//   out[b, i, h] = sum_{s < n} softmax_s(scale * q[b, h, i] . k[b, hkv, s]) v[b, hkv, s]
// with n = t + 1 (CAUSAL: the chunk's queries see the cache and the chunk up to themselves; MLX's
// mask="causal", aligned to the last key) or n = S (no mask), over the S live rows of a contiguous KV
// buffer [B, Hkv, S_cap, D] (rows S.. are spare capacity, never read). Flash-attention style: tiles
// of query rows x tiles of BK keys, a running max and sum per row in fp32 (online softmax).
//
// Products on simdgroup_matrix 8x8 tiles, 16-bit operands (InT: bf16 or fp16) and fp32 accumulators:
//   scores  S = Q . K^T  (Q fragments in registers, K^T fragments from the staged K tile), fp32;
//   output  O += P . V   (P: exp2(S * scale * log2 e - m) in fp32, then ROUNDED TO InT to be the
//                         left operand of the second product, as flash attention does; the running
//                         sum adds the rounded weights, so O / sum is a weighted mean with the weights
//                         the product used). O stays fp32 until the final division and rounding.
//
// Thread layout. One threadgroup = SG simdgroups (threadgroup (32, SG, 1)) owns ROWS = 8 * SG
// (position, head) rows of one KV head: BQ = ROWS / G consecutive chunk positions x all G query heads
// of that KV head, row r = position-major (p0 + r / G, head r % G); simdgroup sg owns rows
// 8 sg .. 8 sg + 7 (one 8-row fragment). GQA: the G heads of one KV head share every staged K/V tile
// (each K/V row is read from memory once per BQ positions, not once per query head). The threadgroup
// walks key tiles [k0, k0 + BK) from key 0 up to its last row's last visible key: all threads stage
// the K and V tile (16-byte loads, rows past the range zero-filled) into threadgroup memory, a
// barrier, then each simdgroup computes its 8 rows' scores (BK / 8 fragments), masks, online softmax,
// P . V into its D / 8 output fragments (registers), a barrier before the next tile overwrites the
// staged rows. A simdgroup whose rows are all past the chunk, or whose rows see no key of the tile,
// skips the arithmetic of that tile (it still takes part in the staging and the barriers).
//
// Threadgroup memory: K and V tiles of BK rows x (D + PAD) elements (PAD = 8 elements: 16 bytes, keeps
// 16-byte alignment and shifts consecutive rows across banks): 2 * BK * (D + 8) * 2 bytes = 16.5 KiB at
// BK = 16, D = 256 (Apple's limit is 32 KiB; BK = 32 would need 33 KiB at D = 256).
// Registers per lane (D = 256): Q 32 fragments x 2 InT, O 32 x 2 fp32, S and P BK / 8 fragments each.
//
// Fragment layout (Apple's simdgroup_matrix, as thread_elements() exposes it; the simulator and the
// CUDA bridge model the same): lane l holds row fr = 4 * ((l >> 4) & 1) + ((l >> 1) & 3), columns
// fc = 4 * ((l >> 3) & 1) + 2 * (l & 1) and fc + 1 of each 8x8 fragment. The four lanes of one row
// differ in lane bits 0 and 3: row reductions are simd_shuffle_xor 1 and 8.
//
// What a row's result depends on (batch and chunk invariance): key tiles start at key 0 and have the
// fixed size BK, so a query row at absolute position t reduces over the same tiles, in the same
// order, with the same fragment arithmetic, whichever chunk, batch, query tile or slot it is computed
// in; keys it does not see (later keys, rows past the threadgroup's range, zero-filled rows) get weight
// exactly 0 and leave its max, sum and accumulators unchanged (a tile it sees nothing of is skipped,
// or is an exact no-op: correction exp2(0) = 1, weights 0). So its output bits are a function of its
// query, its position t and keys/values 0..t alone (up to the sign of an exactly zero output).
//
// Conventions: sizes in an int32 `params` array; InT, D, G, SG, BK, CAUSAL template arguments; every
// lane reaches every simd op and every thread every barrier (tile loop bounds are uniform per
// threadgroup, the skip conditions uniform per simdgroup). The fragment loops carry `#pragma unroll`:
// the fragment arrays must stay in registers (NVRTC left them in a 384-byte stack frame without it).

// @header
// Score of a key a row does not see: finite, so exp2(score - m) is a plain underflow to 0 and the
// running max of a row that has seen no key yet never meets inf arithmetic.
#define PREFILL_NO_MAX (-3.0e38f)
// Elements of padding after each staged K/V row (16 bytes of a 16-bit type).
#define PREFILL_PAD 8

typedef uint4 prefill_u4;

// Row and first column of this lane's two elements in an 8x8 simdgroup_matrix fragment.
inline int prefill_frag_row(int lane) { return 4 * ((lane >> 4) & 1) + ((lane >> 1) & 3); }
inline int prefill_frag_col(int lane) { return 4 * ((lane >> 3) & 1) + 2 * (lane & 1); }

// Stage keys [k0, k0 + BK) of one KV head (rows at or past kv_end: zeros) into tile ([BK][D + PAD]).
// 16-byte words, consecutive threads on consecutive words of a row.
template <typename InT, int D, int BK, int NT>
inline void prefill_stage_tile(const device InT* rows, int k0, int kv_end, threadgroup InT* tile, int tid) {
  constexpr int PER = 16 / static_cast<int>(sizeof(InT));  // elements per 16-byte word
  constexpr int WPR = D / PER;                               // words per row
  constexpr int KS = D + PREFILL_PAD;
  for (int w = tid; w < BK * WPR; w += NT) {
    const int r = w / WPR;
    const int c = (w % WPR) * PER;
    prefill_u4 word = prefill_u4(0u, 0u, 0u, 0u);
    if (k0 + r < kv_end) {
      word = *reinterpret_cast<const device prefill_u4*>(rows + static_cast<size_t>(k0 + r) * D + c);
    }
    *reinterpret_cast<threadgroup prefill_u4*>(tile + r * KS + c) = word;
  }
}

// @kernel attention_prefill
// q: [B, Hq, L, D] InT; k, v: [B, Hkv, S_cap, D] InT (rows < S read); scale: [1] fp32.
// out: [B, L, Hq, D] InT (the host hands back its [B, Hq, L, D] transposed view: the layer's
// transpose back to [B, L, Hq * D] is then free). Grid (32 * B * Hkv * NQ, SG, 1), threadgroup
// (32, SG, 1), NQ = ceil(L / BQ) query tiles per (sequence, KV head); threadgroup x = n * NQ + j
// takes query tile NQ - 1 - j of KV head n = b * Hkv + hkv (the longest tiles first).
// params: named in the launcher's KernelSpec (a generated prologue declares them).
{
  static_assert(sizeof(InT) == 2, "16-bit operands (bf16 or fp16)");
  constexpr int ROWS = 8 * SG;             // (position, head) rows of the threadgroup
  constexpr int BQ = ROWS / G;             // chunk positions of the threadgroup
  static_assert(BQ * G == ROWS, "G must divide 8 * SG");
  constexpr int KS = D + PREFILL_PAD;      // staged row stride (elements)
  constexpr int DC = D / 8;                // 8-wide slices of D
  constexpr int KC = BK / 8;               // 8-key slices of a tile
  constexpr int NT = 32 * SG;              // threads
  constexpr float LOG2E = 1.4426950408889634f;
  threadgroup prefill_u4 staged[2 * BK * KS * 2 / 16];  // K tile then V tile, [BK][KS] InT each
  threadgroup InT* kt = reinterpret_cast<threadgroup InT*>(staged);
  threadgroup InT* vt = kt + BK * KS;

  const int lane = static_cast<int>(thread_index_in_simdgroup);
  const int sg = static_cast<int>(thread_position_in_threadgroup.y);
  const int tid = sg * 32 + lane;
  const int tgx = static_cast<int>(threadgroup_position_in_grid.x);
  const int bh = tgx / NQ;                           // b * Hkv + hkv
  const int p0 = (NQ - 1 - tgx % NQ) * BQ;           // first chunk position of the tile
  const int b = bh / Hkv;
  const int hkv = bh % Hkv;
  const int Hq = Hkv * G;
  const int past = S - L;                            // absolute position of chunk position 0

  // Keys the threadgroup must stage: up to its last real row's last visible key.
  const int p_last = min(p0 + BQ, L) - 1;
  const int kv_end = CAUSAL ? min(S, past + p_last + 1) : S;

  // This lane's row of the simdgroup's fragment, and that row's (position, head).
  const int fr = prefill_frag_row(lane);
  const int fc = prefill_frag_col(lane);
  const int r = sg * 8 + fr;
  const int pos = p0 + r / G;
  const int head = hkv * G + r % G;
  const bool row_valid = pos < L;
  const int row_end = CAUSAL ? min(S, past + pos + 1) : S;  // keys this row sees: [0, row_end)
  // The simdgroup's rows: all past the chunk (nothing to compute), and the keys its last row sees.
  const int sg_first_pos = p0 + (sg * 8) / G;
  const bool sg_active = sg_first_pos < L;
  const int sg_last_pos = min(p0 + (sg * 8 + 7) / G, L - 1);
  const int sg_end = CAUSAL ? min(S, past + sg_last_pos + 1) : S;

  // Q fragments of the 8 rows (zeros for rows past the chunk), in registers for the whole loop.
  simdgroup_matrix<InT, 8, 8> qf[DC];
  {
    const device InT* q_row = q + (static_cast<size_t>(b * Hq + head) * L + (row_valid ? pos : 0)) * D;
    #pragma unroll
    for (int dc = 0; dc < DC; ++dc) {
      qf[dc].thread_elements()[0] = row_valid ? q_row[dc * 8 + fc] : InT(0);
      qf[dc].thread_elements()[1] = row_valid ? q_row[dc * 8 + fc + 1] : InT(0);
    }
  }
  simdgroup_matrix<float, 8, 8> of[DC];  // unnormalised output of the 8 rows, fp32
  #pragma unroll
  for (int dc = 0; dc < DC; ++dc) {
    of[dc] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float m = PREFILL_NO_MAX;  // running max of this lane's row (scaled by log2 e), the same in its 4 lanes
  float l = 0.0f;            // this lane's share of its row's running sum (its columns)
  const float qk_scale = scale[0] * LOG2E;

  const device InT* k_rows = k + static_cast<size_t>(bh) * S_cap * D;
  const device InT* v_rows = v + static_cast<size_t>(bh) * S_cap * D;
  for (int k0 = 0; k0 < kv_end; k0 += BK) {  // uniform over the threadgroup
    prefill_stage_tile<InT, D, BK, NT>(k_rows, k0, kv_end, kt, tid);
    prefill_stage_tile<InT, D, BK, NT>(v_rows, k0, kv_end, vt, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (sg_active && k0 < sg_end) {  // uniform over the simdgroup
      // Scores of the 8 rows x BK keys: S[kc] = Q . K[k0 + 8 kc .. + 8]^T over D, fp32.
      simdgroup_matrix<float, 8, 8> sc[KC];
      #pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        sc[kc] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
      #pragma unroll
      for (int dc = 0; dc < DC; ++dc) {
        #pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
          simdgroup_matrix<InT, 8, 8> kb;  // (d, key) = K[k0 + 8 kc + key][8 dc + d]
          simdgroup_load(kb, kt + kc * 8 * KS + dc * 8, KS, ulong2(0, 0), true);
          simdgroup_multiply_accumulate(sc[kc], qf[dc], kb, sc[kc]);
        }
      }
      // Mask, then the online softmax of each row over this tile.
      float s[KC][2];
      float tile_max = PREFILL_NO_MAX;
      #pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int key = k0 + kc * 8 + fc + i;
          const float x = sc[kc].thread_elements()[i] * qk_scale;
          s[kc][i] = key < row_end ? x : PREFILL_NO_MAX;
          tile_max = fmax(tile_max, s[kc][i]);
        }
      }
      tile_max = fmax(tile_max, simd_shuffle_xor(tile_max, static_cast<ushort>(1)));
      tile_max = fmax(tile_max, simd_shuffle_xor(tile_max, static_cast<ushort>(8)));
      const float m_new = fmax(m, tile_max);
      const float correction = exp2(m - m_new);  // 1 exactly when the max did not move
      m = m_new;
      // P rounded to InT (the second product's operand); the sum adds the rounded weights.
      simdgroup_matrix<InT, 8, 8> pf[KC];
      float tile_sum = 0.0f;
      #pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
          const InT p = static_cast<InT>(exp2(s[kc][i] - m_new));  // masked: exactly 0
          pf[kc].thread_elements()[i] = p;
          tile_sum += static_cast<float>(p);
        }
      }
      l = l * correction + tile_sum;
      #pragma unroll
      for (int dc = 0; dc < DC; ++dc) {
        of[dc].thread_elements()[0] *= correction;
        of[dc].thread_elements()[1] *= correction;
      }
      // O += P . V over the tile's keys, fp32 accumulation.
      #pragma unroll
      for (int dc = 0; dc < DC; ++dc) {
        #pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
          simdgroup_matrix<InT, 8, 8> vb;  // (key, d) = V[k0 + 8 kc + key][8 dc + d]
          simdgroup_load(vb, vt + kc * 8 * KS + dc * 8, KS);
          simdgroup_multiply_accumulate(of[dc], pf[kc], vb, of[dc]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next tile overwrites the staged rows
  }

  if (sg_active) {  // uniform over the simdgroup
    l += simd_shuffle_xor(l, static_cast<ushort>(1));  // the row's sum over its 4 lanes
    l += simd_shuffle_xor(l, static_cast<ushort>(8));
    if (row_valid) {
      device InT* o_row = out + (static_cast<size_t>(b * L + pos) * Hq + head) * D;
      #pragma unroll
      for (int dc = 0; dc < DC; ++dc) {
        o_row[dc * 8 + fc] = static_cast<InT>(of[dc].thread_elements()[0] / l);
        o_row[dc * 8 + fc + 1] = static_cast<InT>(of[dc].thread_elements()[1] / l);
      }
    }
  }
}
