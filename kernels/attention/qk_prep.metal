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
constexpr int PER_LANE = D / 32;

// 1. RMSNorm: the lane's sum of squares, then the simdgroup's.
float values[PER_LANE];
float squares = 0.0f;
for (int i = 0; i < PER_LANE; ++i) {
  values[i] = static_cast<float>(x[int(lane) + 32 * i]);
  squares += values[i] * values[i];
}
const float inv_rms = metal::precise::rsqrt(simd_sum(squares) / float(D) + eps[0]);
for (int i = 0; i < PER_LANE; ++i) {
  const int d = int(lane) + 32 * i;
  const T normalised = static_cast<T>(values[i] * inv_rms);
  values[i] = static_cast<float>(static_cast<T>(static_cast<float>(w[d]) * static_cast<float>(normalised)));
  row_values[d] = values[i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 2. RoPE over the first DIMS elements; the rest pass through.
const float position = rope_scale[0] * float(positions[b] + l);
device T* out = is_query ? q_out + ((long(b) * H + head) * L + l) * D
                         : k_out + ((long(b) * Hkv + head) * L + l) * D;
for (int i = 0; i < PER_LANE; ++i) {
  const int d = int(lane) + 32 * i;
  float result = values[i];
  if (d < DIMS) {
    const int half_dims = DIMS / 2;
    const int pair = d < half_dims ? d : d - half_dims;  // frequency index
    const float theta = position * metal::exp2(-(float(pair) / float(half_dims)) * log2_base[0]);
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

// 3. The output gate: the second half of the query head's q_proj values, copied.
if (is_query) {
  device T* g = gate + (long(token) * H + head) * D;
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = int(lane) + 32 * i;
    g[d] = x[D + d];
  }
}
