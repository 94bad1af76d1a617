// Decode attention (one query row per sequence) of the Qwen3.5/3.6 full-attention layers.
//
// For query head h of sequence b, with its KV head hkv = h / G (G = Hq / Hkv query heads per KV head):
//   out[b, h] = sum_s softmax_s(scale * q[b, h] . k[b, hkv, s]) v[b, hkv, s]
// over the S live rows of a contiguous KV cache [B, Hkv, S_cap, D] (rows S.. are unused capacity).
// Softmax in fp32 with a running max and sum (online softmax); inputs and output in InT.
//
// Thread layout. One threadgroup = SG simdgroups of 32 lanes handles GT query heads of one KV head
// (switch gqa_packing: GT = G, every K/V row is read once for all G heads; off: GT = 1, one
// threadgroup per query head, rows read once per head). Simdgroup sg owns the KV rows
// sg, sg + SG, sg + 2 SG, ...; its 32 lanes split a row's D elements, EPL = D / 32 per lane:
//   coalesced_kv on:  lane owns elements lane, lane + 32, lane + 64, ... (adjacent lanes read
//                     adjacent elements of the row on every load);
//   coalesced_kv off: lane owns the contiguous run lane * EPL .. lane * EPL + EPL - 1 (each lane
//                     walks its own run; lanes' loads are EPL elements apart, "strided").
// The same lane owns the same elements of q, K, V and the output, so both states compute the same
// function (only the order of the lane partial sums in a dot product differs).
// Each simdgroup keeps a partial (max m, sum l, unnormalised acc) per head; at the end they are
// merged through threadgroup memory by rescaling to the threadgroup's max.
//
// Fixed blocks (switch fixed_block_attention): attention_decode_block_partials runs the same per-
// threadgroup computation over blocks of BR KV rows, one threadgroup per (block, heads), writing fp32
// partials (max, sum, unnormalised output); attention_decode_merge_blocks rescales them to the
// global max and divides once. Many more threadgroups at long context, one extra launch.
//
// Conventions: sizes in an int32 `params` array; InT, D, GT, SG, COALESCED as template arguments;
// grid (32, SG, B * Hkv * G / GT), threadgroup (32, SG, 1); every lane reaches every simd_sum and
// every thread every barrier (loop bounds are uniform per simdgroup / threadgroup).

// @header
// Running max before any row: finite, so exp(m - m_new) is a plain underflow to 0 (no inf arithmetic).
#define ATTENTION_NO_MAX (-3.0e38f)

// Element of a D-wide row that lane `lane` holds in its slot i (see the layout above).
template <int D, int COALESCED>
inline int attention_element(int lane, int i) {
  return COALESCED ? i * 32 + lane : lane * (D / 32) + i;
}

// The decode attention of one threadgroup over KV rows [row_begin, row_end): GT query heads of KV
// head `bh` (= b * Hkv + hkv), first query head h0. Simdgroup sg takes rows row_begin + sg,
// row_begin + sg + SG, ...; the simdgroups' partials are merged through threadgroup memory (sg_max,
// sg_sum: GT * SG floats; sg_acc: SG * D floats). PARTIAL == 0: writes the normalised output rows of
// `out` ([B * Hq, D], InT). PARTIAL == 1: writes this block's fp32 partial of each head instead, its
// max, sum of exp(score - max) and unnormalised sum of exp(score - max) * v, at index `part` of
// part_max / part_sum ([B * Hq, NB]) and part_acc ([B * Hq, NB, D]); the merge kernel combines them.
template <typename InT, int D, int GT, int SG, int COALESCED, int PARTIAL>
inline void attention_decode_rows(
    const device InT* q, const device InT* k, const device InT* v, float qk_scale,
    device InT* out, device float* part_max, device float* part_sum, device float* part_acc,
    int Hq, int S_cap, int bh, int b_idx, int h0, int row_begin, int row_end, int part, int NB,
    threadgroup float* sg_max, threadgroup float* sg_sum, threadgroup float* sg_acc, int lane, int sg) {
  constexpr int EPL = D / 32;
  float qr[GT][EPL];   // scaled query elements of this lane
  float acc[GT][EPL];  // unnormalised output elements of this lane
  float m[GT];         // running max of this simdgroup's scores (uniform over its lanes)
  float l[GT];         // running sum of exp(score - m)
  for (int g = 0; g < GT; ++g) {
    const device InT* q_h = q + (static_cast<size_t>(b_idx) * Hq + h0 + g) * D;
    for (int i = 0; i < EPL; ++i) {
      qr[g][i] = static_cast<float>(q_h[attention_element<D, COALESCED>(lane, i)]) * qk_scale;
      acc[g][i] = 0.0f;
    }
    m[g] = ATTENTION_NO_MAX;
    l[g] = 0.0f;
  }

  const device InT* k_rows = k + static_cast<size_t>(bh) * S_cap * D;
  const device InT* v_rows = v + static_cast<size_t>(bh) * S_cap * D;
  for (int row = row_begin + sg; row < row_end; row += SG) {  // uniform over the simdgroup
    float kr[EPL];
    float vr[EPL];
    for (int i = 0; i < EPL; ++i) {
      const int e = attention_element<D, COALESCED>(lane, i);
      kr[i] = static_cast<float>(k_rows[static_cast<size_t>(row) * D + e]);
      vr[i] = static_cast<float>(v_rows[static_cast<size_t>(row) * D + e]);
    }
    for (int g = 0; g < GT; ++g) {  // the row, loaded once, serves every head of the threadgroup
      float partial_dot = 0.0f;
      for (int i = 0; i < EPL; ++i) {
        partial_dot += qr[g][i] * kr[i];
      }
      const float s = simd_sum(partial_dot);
      const float m_new = fmax(m[g], s);
      const float correction = exp(m[g] - m_new);
      const float p = exp(s - m_new);
      l[g] = l[g] * correction + p;
      for (int i = 0; i < EPL; ++i) {
        acc[g][i] = acc[g][i] * correction + p * vr[i];
      }
      m[g] = m_new;
    }
  }

  // Merge the simdgroups' partials: maxes and sums first, then one head's accumulators at a time.
  if (lane == 0) {
    for (int g = 0; g < GT; ++g) {
      sg_max[g * SG + sg] = m[g];
      sg_sum[g * SG + sg] = l[g];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int tid = sg * 32 + lane;
  for (int g = 0; g < GT; ++g) {
    float m_all = ATTENTION_NO_MAX;
    for (int s = 0; s < SG; ++s) {
      m_all = fmax(m_all, sg_max[g * SG + s]);
    }
    float total = 0.0f;
    for (int s = 0; s < SG; ++s) {
      total += sg_sum[g * SG + s] * exp(sg_max[g * SG + s] - m_all);  // a simdgroup without rows adds 0
    }
    const float weight = exp(m[g] - m_all);
    for (int i = 0; i < EPL; ++i) {
      sg_acc[sg * D + attention_element<D, COALESCED>(lane, i)] = acc[g][i] * weight;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const size_t head = static_cast<size_t>(b_idx) * Hq + h0 + g;
    for (int d = tid; d < D; d += 32 * SG) {
      float o = 0.0f;
      for (int s = 0; s < SG; ++s) {
        o += sg_acc[s * D + d];
      }
      if (PARTIAL) {
        part_acc[(head * NB + part) * D + d] = o;
      } else {
        out[head * D + d] = static_cast<InT>(o / total);
      }
    }
    if (PARTIAL && tid == 0) {
      part_max[head * NB + part] = m_all;
      part_sum[head * NB + part] = total;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // sg_acc is rewritten for the next head
  }
}

// @kernel attention_decode
// q: [B, Hq, 1, D] InT; k, v: [B, Hkv, S_cap, D] InT (rows < S read); scale: [1] fp32.
// out: [B, Hq, 1, D] InT. Grid (32, SG, B * Hkv * G / GT), threadgroup (32, SG, 1).
// params: named in the launcher's KernelSpec (a generated prologue declares them).
{
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * D];
  const int blocks = G / GT;  // threadgroups per KV head
  const int n = static_cast<int>(thread_position_in_grid.z);
  const int bh = n / blocks;  // b * Hkv + hkv
  attention_decode_rows<InT, D, GT, SG, COALESCED, 0>(
      q, k, v, scale[0], out, nullptr, nullptr, nullptr, Hkv * G, S_cap, bh, bh / Hkv,
      (bh % Hkv) * G + (n % blocks) * GT, 0, S, 0, 1, sg_max, sg_sum, sg_acc,
      static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_block_partials
// The fixed-block split (fixed_block_attention): KV rows cut into NB = ceil(S / BR) blocks of BR
// rows, one threadgroup per (block, GT heads): grid (32, SG, B * Hkv * G / GT * NB), threadgroup
// (32, SG, 1). Same inputs as attention_decode; outputs the blocks' fp32 partials part_max, part_sum
// [B * Hq, NB] and part_acc [B * Hq, NB, D] (attention_decode_rows), merged by the next kernel.
// A row's blocks depend only on its own S and BR, never on the batch.
{
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * D];
  const int blocks = G / GT;
  const int z = static_cast<int>(thread_position_in_grid.z);
  const int part = z % NB;
  const int n = z / NB;
  const int bh = n / blocks;
  const int row_begin = part * BR;
  attention_decode_rows<InT, D, GT, SG, COALESCED, 1>(
      q, k, v, scale[0], nullptr, part_max, part_sum, part_acc, Hkv * G, S_cap, bh, bh / Hkv,
      (bh % Hkv) * G + (n % blocks) * GT, row_begin, min(S, row_begin + BR), part, NB, sg_max, sg_sum,
      sg_acc, static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_merge_blocks
// out[head, d] = sum_b exp(max_b - M) acc_b[d] / sum_b exp(max_b - M) sum_b, M = max_b max_b, over
// the NB block partials of each head: grid (D, B * Hq, 1), threadgroup (min(D, 256), 1, 1). fp32,
// blocks in order; out: [B, Hq, 1, D] InT.
{
  const int d = static_cast<int>(thread_position_in_grid.x);
  const size_t head = thread_position_in_grid.y;
  float m_all = ATTENTION_NO_MAX;
  for (int b = 0; b < NB; ++b) {
    m_all = fmax(m_all, part_max[head * NB + b]);
  }
  float total = 0.0f;
  float o = 0.0f;
  for (int b = 0; b < NB; ++b) {
    const float w = exp(part_max[head * NB + b] - m_all);
    total += part_sum[head * NB + b] * w;
    o += part_acc[(head * NB + b) * D + d] * w;
  }
  out[head * D + d] = static_cast<InT>(o / total);
}
