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

// @kernel attention_decode
// q: [B, Hq, 1, D] InT; k, v: [B, Hkv, S_cap, D] InT (rows < S read); scale: [1] fp32.
// out: [B, Hq, 1, D] InT.
// params: named in the launcher's KernelSpec (a generated prologue declares them).
{
  constexpr int EPL = D / 32;
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * D];
  const int Hq = Hkv * G;

  const int lane = static_cast<int>(thread_index_in_simdgroup);
  const int sg = static_cast<int>(thread_position_in_threadgroup.y);
  const int blocks = G / GT;  // threadgroups per KV head
  const int n = static_cast<int>(thread_position_in_grid.z);
  const int bh = n / blocks;  // b * Hkv + hkv
  const int b_idx = bh / Hkv;
  const int h0 = (bh % Hkv) * G + (n % blocks) * GT;  // first query head of this threadgroup
  const float qk_scale = scale[0];

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
  for (int row = sg; row < S; row += SG) {  // uniform over the simdgroup
    float kr[EPL];
    float vr[EPL];
    for (int i = 0; i < EPL; ++i) {
      const int e = attention_element<D, COALESCED>(lane, i);
      kr[i] = static_cast<float>(k_rows[static_cast<size_t>(row) * D + e]);
      vr[i] = static_cast<float>(v_rows[static_cast<size_t>(row) * D + e]);
    }
    for (int g = 0; g < GT; ++g) {  // the row, loaded once, serves every head of the threadgroup
      float part = 0.0f;
      for (int i = 0; i < EPL; ++i) {
        part += qr[g][i] * kr[i];
      }
      const float s = simd_sum(part);
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
    device InT* out_h = out + (static_cast<size_t>(b_idx) * Hq + h0 + g) * D;
    for (int d = tid; d < D; d += 32 * SG) {
      float o = 0.0f;
      for (int s = 0; s < SG; ++s) {
        o += sg_acc[s * D + d];
      }
      out_h[d] = static_cast<InT>(o / total);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // sg_acc is rewritten for the next head
  }
}
