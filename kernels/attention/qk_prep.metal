// q/k preparation of the Qwen3.5/3.6 full-attention layers (switch fused_qk_prep): what stock MLX-LM
// does with five primitives (split of the output gate off q_proj, q_norm, k_norm, RoPE of q, RoPE of k)
// in one kernel, with stock's rounding points:
//   n      = T(x * rsqrt(mean(x^2) + eps))          (RMSNorm, fp32 inside, rounded to T)
//   y      = T(w * n)                               (the norm's weight, rounded to T)
//   rotated (non-traditional RoPE over the first DIMS elements, pairs (i, i + DIMS / 2)):
//     theta = scale * position * 2^(-(i / (DIMS / 2)) * log2(base))
//     out_i = T(y_i cos theta - y_j sin theta), out_j = T(y_i sin theta + y_j cos theta), j = i + DIMS / 2
//   elements DIMS.. pass through (y). The gate half of each q_proj head is copied out unchanged.
//
// Thread layout: one simdgroup (one threadgroup of 32 lanes) per (token, head row): rows 0..H-1 are
// the query heads, rows H..H+Hkv-1 the key heads. Lane l owns elements l + 32 i (D / 32 of them). The
// normalised row goes through threadgroup memory so each lane can read its RoPE partner.
//
// Inputs: q_proj [B, L, H, 2D] (per head: D query values, then D gate values; token rows q_ld apart),
// k_proj [B, L, Hkv, D] (token rows k_ld apart, from k_off: q_proj and k_proj may be one array, the fused
// q/k/v projection's output, read in place; or two arrays with q_ld = 2 H D, k_ld = Hkv D, k_off = 0),
// q_weight / k_weight [D], positions [B] int32 (the cache offset of each row: the token at l has
// position positions[b] + l), eps, log2_base, rope_scale ([1] fp32 each), params.
// Outputs: q_out [B, H, L, D], k_out [B, Hkv, L, D], gate [B, L, H * D].
// Template: T (activation dtype), D (head dim, a multiple of 32), DIMS (rotated elements, even, <= D).
// Grid (32, H + Hkv, B * L), threadgroup (32, 1, 1).
//
// attention_qk_prep_from_hidden (switch fused_qkv_prep, with the trial row GEMV) computes the q/k/v projection's rows
// itself, from the layer's input, and then this kernel's work (attention_qk_prep_head): the same bits as the GEMV and
// attention_qk_prep in turn.

// @header
// @include linear/gemv.metal
#define QK_PREP_SIMDGROUPS 16  // simdgroups a threadgroup of attention_qk_prep_from_hidden

// One head row's q/k preparation by one simdgroup (all 32 lanes): x the head's D projected values (device or
// threadgroup memory), w the norm's weight; RMSNorm with stock's rounding points, then RoPE over the first DIMS
// elements (the partner read through row_values, D floats of threadgroup memory), written to out [D]. Lane l owns
// elements l + 32 i (the loops unrolled: NVRTC kept the values in a 32-byte stack frame otherwise).
template <typename T, int D, int DIMS, typename PX, typename PW, typename PO>
inline void attention_qk_prep_head(PX x, PW w, PO out, threadgroup float* row_values, uint lane, float position,
                                   float eps, float log2_base) {
  constexpr int PER_LANE = D / 32;
  // 1. RMSNorm: the lane's sum of squares, then the simdgroup's.
  float values[PER_LANE];
  float squares = 0.0f;
  #pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    values[i] = static_cast<float>(x[int(lane) + 32 * i]);
    squares += values[i] * values[i];
  }
  const float inv_rms = metal::precise::rsqrt(simd_sum(squares) / float(D) + eps);
  #pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = int(lane) + 32 * i;
    const T normalised = static_cast<T>(values[i] * inv_rms);
    values[i] = static_cast<float>(static_cast<T>(static_cast<float>(w[d]) * static_cast<float>(normalised)));
    row_values[d] = values[i];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // the row is this simdgroup's alone

  // 2. RoPE over the first DIMS elements; the rest pass through.
  #pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = int(lane) + 32 * i;
    float result = values[i];
    if (d < DIMS) {
      const int half_dims = DIMS / 2;
      const int pair = d < half_dims ? d : d - half_dims;  // frequency index
      const float theta = position * metal::exp2(-(float(pair) / float(half_dims)) * log2_base);
      const float c = metal::cos(theta);
      const float s = metal::sin(theta);
      if (d < half_dims) {
        result = values[i] * c - row_values[d + half_dims] * s;
      } else {
        result = row_values[d - half_dims] * s + values[i] * c;
      }
    }
    out[d] = static_cast<T>(result);
  }
}


// @kernel attention_qk_prep
threadgroup float row_values[D];
const uint lane = thread_index_in_simdgroup;
const int head_row = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z);  // b * L + l
const int b = token / L;
const int l = token - b * L;
const bool is_query = head_row < H;
const int head = is_query ? head_row : head_row - H;
const device T* x = is_query ? q_proj + long(token) * q_ld + long(head) * (2 * D)
                             : k_proj + long(token) * k_ld + k_off + long(head) * D;
const device T* w = is_query ? q_weight : k_weight;
device T* out = is_query ? q_out + ((long(b) * H + head) * L + l) * D
                         : k_out + ((long(b) * Hkv + head) * L + l) * D;
attention_qk_prep_head<T, D, DIMS>(x, w, out, row_values, lane, rope_scale[0] * float(positions[b] + l), eps[0],
                                   log2_base[0]);

// 3. The output gate: the second half of the query head's q_proj values, copied.
if (is_query) {
  device T* g = gate + (long(token) * H + head) * D;
  for (int i = 0; i < D / 32; ++i) {
    const int d = int(lane) + 32 * i;
    g[d] = x[D + d];
  }
}

// @kernel attention_qk_prep_from_hidden
// One decode token (L = 1) of an attention layer from the layer's input x [B, 1, Hd] (the input norm's input with NORM:
// in_norm_weight [Hd], in_norm_eps [1] fp32): the fused q/k/v projection W [(2 H + 2 Hkv) D, Hd] (4-bit, groups of
// GS; q_proj's rows per head q then gate, then k_proj's, then v_proj's) by the row GEMV's arithmetic, threadgroup t
// computing its block of D rows (t D ..): blocks 2h and 2h + 1 are query head h's q and gate, 2H + j key head j,
// 2H + Hkv + j value head j. The rows are rounded to T into threadgroup memory (the GEMV's output), then simdgroup 0
// prepares a q or k head (attention_qk_prep_head) or copies the gate or the values out. So the same bits as the GEMV
// over W followed by attention_qk_prep (the values: the GEMV's).
// Grid (32, QK_PREP_SIMDGROUPS * (2 H + 2 Hkv), B), threadgroup (32, QK_PREP_SIMDGROUPS, 1). Template T, D, DIMS, GS,
// NORM, Hd, U (weight pieces a row and lane in flight: the host's QKV_PREP_UNROLL). Outputs: q_out [B, H, 1, D], k_out, v_out [B, Hkv, 1, D], gate [B, 1, H * D].
{
  threadgroup vec<T, 4> x4[Hd / 4];  // the GEMV's input row (normalised with NORM)
  threadgroup float proj[D];         // this block's projected rows (fp32 of T values)
  threadgroup float row_values[D];
  const int lane = int(thread_index_in_simdgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int block = int(threadgroup_position_in_grid.y);
  const int b = int(threadgroup_position_in_grid.z);
  const int P = (2 * H + 2 * Hkv) * D;

  linear_gemv_stage_input<T, NORM != 0>(x, in_norm_weight, in_norm_eps, Hd, B, b, lane, sg * 32 + lane,
                                         QK_PREP_SIMDGROUPS * 32, x4);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint32_t exponent = q4_exponent_unfolded(P);
  for (int g = sg; g < D / LINEAR_GEMV_ROWS; g += QK_PREP_SIMDGROUPS) {  // uniform per simdgroup
    long wrow[LINEAR_GEMV_ROWS];
    long srow[LINEAR_GEMV_ROWS];
    int slot[LINEAR_GEMV_ROWS];  // where row r's value goes in proj
    #pragma unroll
    for (int r = 0; r < LINEAR_GEMV_ROWS; ++r) {
      const long row = long(block) * D + g * LINEAR_GEMV_ROWS + r;
      wrow[r] = row * (Hd / 32);
      srow[r] = row * (Hd / GS);
      slot[r] = g * LINEAR_GEMV_ROWS + r;
    }
    linear_gemv_q4_staged_rows<T, GS, U>(x4, w, scales, biases, wrow, srow, Hd, lane, exponent, slot, proj);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  if (sg == 0) {
    const threadgroup float* values = proj;
    const bool is_query = block < 2 * H && block % 2 == 0;
    if (is_query || (block >= 2 * H && block < 2 * H + Hkv)) {  // (one call: NVRTC inlines it)
      const device T* w_norm = is_query ? q_weight : k_weight;
      device T* out = is_query ? q_out + (long(b) * H + block / 2) * D : k_out + (long(b) * Hkv + block - 2 * H) * D;
      attention_qk_prep_head<T, D, DIMS>(values, w_norm, out, row_values, uint(lane),
                                         rope_scale[0] * float(positions[b]), eps[0], log2_base[0]);
    } else {
      device T* dst = block < 2 * H ? gate + (long(b) * H + block / 2) * D
                                    : v_out + (long(b) * Hkv + block - 2 * H - Hkv) * D;
      for (int i = 0; i < D / 32; ++i) {
        dst[lane + 32 * i] = static_cast<T>(values[lane + 32 * i]);
      }
    }
  }
}
