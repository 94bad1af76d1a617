// Gated DeltaNet kernels (Qwen3.5/3.6 linear-attention layers).
//
// Recurrence per value head (b, hv), token t, with its key head hk = hv / (Hv / Hk):
//   S     = g_t * S                      S: [Dv, Dk] fp32 (row dv = S[dv, :])
//   kv    = S k_t                        [Dv]
//   S     = S + k_t^T ((v_t - kv) beta_t)
//   y_t   = S q_t                        [Dv]
// with g_t = exp(-exp(A_log) softplus(a_t + dt_bias)) and beta_t = sigmoid(b_t).
//
// Thread layout shared by the scan and decode kernels ("row groups"): every lane holds
// EPL = 32 state elements in registers. LANES = Dk / 32 consecutive lanes own one state row dv
// in chunks of 4 consecutive columns: lane j of the group holds chunks j, j + LANES, j + 2 LANES, ...
// (deltanet_col: adjacent lanes read adjacent 16 bytes of q/k/state; a chunk of q or k staged in
// threadgroup memory is one 16-byte load), so one simdgroup owns ROWS = 32 / LANES rows. Row dot products are reduced
// inside the group with simd_shuffle_xor (no threadgroup memory); every lane of the simdgroup runs
// every shuffle. Grid: (32, Dv / ROWS, B * Hv); threadgroup.y divides Dv / ROWS.
//
// Conventions: dynamic sizes in an int32 `params` array; Dk, Dv and dtypes as template arguments;
// state and gates fp32; activations InT (bf16 in the model).

// @header
// @include linear/gemv.metal
#define DELTANET_EPL 32

// Sum over the LANES consecutive lanes owning one state row (called by all 32 lanes).
template <int LANES>
inline float deltanet_row_sum(float x) {
  for (int offset = 1; offset < LANES; offset <<= 1) {
    x += simd_shuffle_xor(x, static_cast<ushort>(offset));
  }
  return x;
}

// log(1 + x) without the cancellation of log(1.0f + x) for small x.
inline float deltanet_log1p(float x) {
  const float xp1 = 1.0f + x;
  return xp1 == 1.0f ? x : x * (log(xp1) / (xp1 - 1.0f));
}

// Decay g = exp(-exp(A_log) * softplus(a + dt_bias)) and beta = sigmoid(b), both in fp32 (stock
// rounds a + dt_bias, the softplus and beta to the activation dtype; fp32 is the exact function).
inline float deltanet_decay(float a, float A_log, float dt_bias) {
  const float x = a + dt_bias;
  const float softplus = fmax(x, 0.0f) + deltanet_log1p(exp(-fabs(x)));
  return exp(-exp(A_log) * softplus);
}

inline float deltanet_beta(float b) {
  return 1.0f / (1.0f + exp(-b));
}

// Row i of the conv input [conv_state; masked tokens] of batch row b, channel c, in fp32: rows
// i < K-1 are the conv state (zeros without one), row K-1 + t is token t (zero where masked).
// Pointer types are template parameters as a whole: MLX passes inputs of fewer than 8 elements (a
// 1-element stand-in, a small mask) in the constant address space, larger ones in device. qkv's element of channel
// c is qkv[bt * ld + c - c0] (c0: the channel qkv's first element holds; 0 for a whole row).
template <typename QKV, typename CS, typename M>
inline float deltanet_conv_input(
    QKV qkv, CS conv_state, M mask, int b, int i, int c, int T, int C, int K, bool has_state, bool has_mask,
    int ld, int c0 = 0) {
  if (i < K - 1) {
    return has_state ? static_cast<float>(conv_state[(static_cast<size_t>(b) * (K - 1) + i) * C + c]) : 0.0f;
  }
  const size_t bt = static_cast<size_t>(b) * T + (i - (K - 1));
  return (!has_mask || mask[bt]) ? static_cast<float>(qkv[bt * ld + c - c0]) : 0.0f;  // ld: qkv's row stride
}

// Conv row r (the Dk channels r * Dk + lane + 32 i, i < Dk / 32) of token t of batch row b_idx, as
// every kernel computes it (one definition: deltanet_conv_qk_norm_decode and
// deltanet_decode_conv_fused cannot drift apart): the depthwise conv over the K taps in order, fp32
// accumulation, SiLU (kept fp32 into the norm: stock rounds the conv output and the SiLU to the model
// dtype first; emulating that does not reproduce stock's bits anyway, its CPU exp is approximate),
// and for a q or k row (r < 2 Hk) the L2 normalisation with the read-out scale: rms_norm(x, eps / Dk)
// = x * rsqrt(sum(x^2) / Dk + eps / Dk), then q * Dk^-1, k * Dk^-0.5. vals[i]: channel
// r * Dk + lane + 32 i in fp32; the caller rounds it to InT. All 32 lanes call it (one simd_sum).
template <int Dk, int K, typename QKV, typename CS, typename W, typename M>
inline void deltanet_conv_row(
    thread float* vals, QKV qkv, CS conv_state, W weight, M mask, int b_idx, int t, int r, int lane,
    int T, int C, int Hk, bool has_state, bool has_mask, float eps, int ld, int c0 = 0) {
  constexpr int PER_LANE = Dk / 32;
  float ss = 0.0f;
  for (int i = 0; i < PER_LANE; ++i) {
    const int c = r * Dk + lane + 32 * i;
    // Window of token t: conv-input rows t .. t + K - 1 (the token itself last).
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) {
      const float x = deltanet_conv_input(qkv, conv_state, mask, b_idx, t + j, c, T, C, K, has_state, has_mask, ld,
                                          c0);
      acc += x * static_cast<float>(weight[c * K + j]);
    }
    vals[i] = acc / (1.0f + exp(-acc));
    ss += vals[i] * vals[i];
  }
  ss = simd_sum(ss);  // all lanes; used by the q and k rows only
  if (r < 2 * Hk) {
    const float inv = rsqrt(ss / Dk + eps / Dk);
    const float scale = r < Hk ? 1.0f / Dk : rsqrt(static_cast<float>(Dk));
    for (int i = 0; i < PER_LANE; ++i) {
      vals[i] = vals[i] * inv * scale;
    }
  }
}

// The new conv state of conv row r's channels (batch row b_idx of a chunk of T tokens): the K-1
// conv-input rows before the row's end, i.e. the last K-1 valid inputs (state rows where fewer tokens
// are valid; the end is lengths[b_idx] clamped to [0, T] with has_lengths, else T). The rows are
// moved, not computed, so they equal stock's bit for bit. All lanes of one simdgroup per row.
template <typename InT, int Dk, int K, typename O, typename QKV, typename CS, typename M, typename L>
inline void deltanet_conv_state_row(
    O conv_state_out, QKV qkv, CS conv_state, M mask, L lengths, int b_idx, int r, int lane, int T, int C,
    bool has_state, bool has_mask, bool has_lengths, int ld, int c0 = 0) {
  constexpr int PER_LANE = Dk / 32;
  const int end = has_lengths ? min(max(static_cast<int>(lengths[b_idx]), 0), T) : T;
  const size_t state_row0 = static_cast<size_t>(b_idx) * (K - 1) * C;
  for (int i = 0; i < PER_LANE; ++i) {
    const int c = r * Dk + lane + 32 * i;
    for (int j = 0; j < K - 1; ++j) {
      const float x = deltanet_conv_input(qkv, conv_state, mask, b_idx, end + j, c, T, C, K, has_state, has_mask, ld,
                                          c0);
      conv_state_out[state_row0 + static_cast<size_t>(j) * C + c] = static_cast<InT>(x);
    }
  }
}

// Column of lane j's state element i (j: the lane's index in its row group): element i is column
// i % 4 of the lane's chunk i / 4, and chunk c of lane j is chunk c LANES + j of the row.
template <int LANES>
inline int deltanet_col(int j, int i) {
  return ((i / 4) * LANES + j) * 4 + i % 4;
}

// A lane's DELTANET_EPL elements of one fp32 state row (s: the row's start, 16-byte aligned as Dk is a
// multiple of 32; j: the lane's index in its row group) as 16-byte loads and stores, one per chunk of
// deltanet_col. Scalar accesses made each simdgroup load touch 16 sectors for 128 useful bytes, and the
// decode kernels (one threadgroup per head, 32 at Qwen3.6) waited on that traffic (Nsight Compute, H200).
// The launchers pass the state as a device array even when absent (an 8-element stand-in: MLX hands
// inputs of fewer elements over in the constant address space).
template <int LANES>
inline void deltanet_load_state(thread float (&state)[DELTANET_EPL], const device float* s, int j, bool has) {
  for (int c = 0; c < DELTANET_EPL / 4; ++c) {
    const float4 v = has ? reinterpret_cast<const device float4*>(s)[c * LANES + j] : float4(0.0f);
    state[4 * c] = v.x;
    state[4 * c + 1] = v.y;
    state[4 * c + 2] = v.z;
    state[4 * c + 3] = v.w;
  }
}

template <int LANES>
inline void deltanet_store_state(device float* s, const thread float (&state)[DELTANET_EPL], int j) {
  for (int c = 0; c < DELTANET_EPL / 4; ++c) {
    reinterpret_cast<device float4*>(s)[c * LANES + j] =
        float4(state[4 * c], state[4 * c + 1], state[4 * c + 2], state[4 * c + 3]);
  }
}

// Four consecutive elements x[col .. col + 3] as floats: element by element from any pointer, or
// (VEC4) one 16-byte load from fp32 threadgroup memory (16-byte aligned, col a multiple of 4).
template <bool VEC4> struct DeltanetLoad4 {
  template <typename P>
  static inline float4 load(P x, int col) {
    return float4(static_cast<float>(x[col]), static_cast<float>(x[col + 1]), static_cast<float>(x[col + 2]),
                  static_cast<float>(x[col + 3]));
  }
};
template <> struct DeltanetLoad4<true> {
  static inline float4 load(const threadgroup float* x, int col) {
    return *reinterpret_cast<const threadgroup float4*>(x + col);
  }
};

// This lane's part of a state row's dot product with x (row start x, lane j of the row group):
// element i goes into partial sum i % PARTIALS (each partial in i order), then the partials are
// added pairwise (p + w into p, w = PARTIALS / 2, ..., 1). PARTIALS = 1 is one sequential chain of
// DELTANET_EPL FMAs; 4 gives chains of 8 plus 2 adds. DECAY: state[i] *= scale first (the kv sum);
// else state[i] += k[i] scale first (the read-out), in the same pass.
template <int LANES, int PARTIALS, bool VEC4, bool DECAY, typename QK>
inline float deltanet_lane_dot(thread float (&state)[DELTANET_EPL], QK x, QK k_row, int j, float scale) {
  static_assert(DELTANET_EPL % PARTIALS == 0, "PARTIALS divides the elements per lane");
  float part[PARTIALS];
  for (int p = 0; p < PARTIALS; ++p) {
    part[p] = 0.0f;
  }
  for (int c = 0; c < DELTANET_EPL / 4; ++c) {
    const int col = deltanet_col<LANES>(j, 4 * c);
    const float4 xc = DeltanetLoad4<VEC4>::load(x, col);
    const float4 kc = DECAY ? xc : DeltanetLoad4<VEC4>::load(k_row, col);
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * c + e;
      if (DECAY) {
        state[i] *= scale;
      } else {
        state[i] += kc[e] * scale;
      }
      part[i % PARTIALS] += state[i] * xc[e];
    }
  }
  for (int w = PARTIALS / 2; w > 0; w /= 2) {
    for (int p = 0; p < w; ++p) {
      part[p] += part[p + w];
    }
  }
  return part[0];
}

// One token's delta-rule update of state row dv, held in registers (this lane's DELTANET_EPL elements,
// columns deltanet_col(j, i)), and the row's read-out y[dv] = S[dv, :] q (returned to every lane of the
// row group). q_row, k_row: the token's q and k rows (device or threadgroup memory; VEC4: fp32
// threadgroup memory, 16-byte aligned); j = lane % LANES; v is v[dv]. All 32 lanes call it (row sums
// by shuffles). Every scan and decode kernel steps through this function with the same PARTIALS, so
// a token gets the same bits in a prompt chunk and in a decode step (batch invariance).
template <int LANES, int PARTIALS, bool VEC4, typename QK>
inline float deltanet_decode_row(thread float (&state)[DELTANET_EPL], QK q_row, QK k_row, int j, float v,
                                 float g_t, float beta_t) {
  const float kv = deltanet_row_sum<LANES>(deltanet_lane_dot<LANES, PARTIALS, VEC4, true>(state, k_row, k_row, j, g_t));
  const float delta = (v - kv) * beta_t;
  return deltanet_row_sum<LANES>(deltanet_lane_dot<LANES, PARTIALS, VEC4, false>(state, q_row, k_row, j, delta));
}

// 1 / rms of a decode head's Dv fp32 read-outs, for the gated RMSNorm. Every simdgroup sums the squares
// exactly as deltanet_gated_norm sums a row (lane l: elements l, l + 32, ... in turn, then simd_sum),
// so the decode kernels, the unfused decode and the prefill path (scan, then gated norm) give a token
// the same bits (batch invariance: a 1-token prompt chunk alone takes a decode kernel, padded in a
// batch the prefill path). Every thread of the threadgroup calls it (one barrier); y_head: [Dv].
template <int Dv>
inline float deltanet_head_inv_rms(threadgroup float* y_head, float y_dv, int dv, bool leader, int lane,
                                   float eps) {
  if (leader) {
    y_head[dv] = y_dv;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float ss = 0.0f;
  for (int i = 0; i < Dv / 32; ++i) {
    const float x = y_head[lane + i * 32];
    ss += x * x;
  }
  ss = simd_sum(ss);
  return rsqrt(ss / Dv + eps);
}

// silu(z) * y * inv_rms * weight (fp32; the caller rounds once).
inline float deltanet_gated_out(float y, float inv_rms, float w, float zc) {
  const float normed = y * inv_rms * w;
  const float silu_z = zc / (1.0f + exp(-zc));
  return silu_z * normed;
}

// deltanet_decode_conv_fused's work for value head n = (b_idx, hv) once the gates (g_t, beta_t) and this thread's z
// element (zc) are known: the conv rows of q (head hk), k (head hk) and v (head hv), the step, the gated norm.
// Threadgroup memory (declared by the kernel): qkv_head [3 Dk] (16-byte aligned: the conv rows of q, k, v as fp32 of
// their InT values), y_head [Dv] (the head's fp32 read-outs, for the norm). The
// token's q|k|v values come from qkv (row stride qkv_ld; qkv_c0[j]: the channel that qkv's first element holds for row
// j = q, k, v, deltanet_conv_input's c0), so the kernel that computes them in threadgroup memory
// (deltanet_decode_from_hidden) shares this code and its bits.
template <typename InT, int Dk, int Dv, int K, int PARTIALS, typename QKV, typename CS, typename CW, typename M,
          typename L, typename S, typename W, typename O, typename SO, typename CSO>
inline void deltanet_decode_conv_step(
    QKV qkv, int qkv_ld, int q_c0, int k_c0, int v_c0, CS conv_state, CW conv_weight, M mask, L lengths, S state_in,
    float g_t, float beta_t, float zc, W weight, O out, SO state_out, CSO conv_state_out, int Hk, int Hv, int C,
    bool has_conv_state, bool has_state, bool has_mask, bool has_lengths, float qk_eps, float norm_eps, int n,
    int lane, int sg, threadgroup float* qkv_head, threadgroup float* y_head) {
  constexpr int LANES = Dk / DELTANET_EPL;
  constexpr int ROWS = 32 / LANES;
  constexpr int PER_LANE = Dk / 32;
  constexpr int SIMDGROUPS = Dv / ROWS;
  const int b_idx = n / Hv;
  const int hv = n % Hv;
  const int rep = Hv / Hk;
  const int hk = hv / rep;
  const int col0 = lane % LANES;
  const int dv = sg * ROWS + lane / LANES;
  const bool live = !has_mask || mask[b_idx];  // uniform over the threadgroup

  // This lane's state elements, loaded first: the loads are in flight while the conv rows are computed.
  const size_t row = (static_cast<size_t>(n) * Dv + dv) * Dk;
  float state[DELTANET_EPL];
  deltanet_load_state<LANES>(state, state_in + row, col0, has_state);
  const float w_dv = static_cast<float>(weight[dv]);

  // The conv rows (uniform per simdgroup: each simd_sum inside is reached by all 32 lanes).
  for (int j = sg; j < 3; j += SIMDGROUPS) {
    const int r = j == 0 ? hk : (j == 1 ? Hk + hk : 2 * Hk + hv);
    const int c0 = j == 0 ? q_c0 : (j == 1 ? k_c0 : v_c0);
    float vals[PER_LANE];
    deltanet_conv_row<Dk, K>(vals, qkv, conv_state, conv_weight, mask, b_idx, 0, r, lane, 1, C, Hk,
                             has_conv_state, has_mask, qk_eps, qkv_ld, c0);
    for (int i = 0; i < PER_LANE; ++i) {
      qkv_head[j * Dk + lane + 32 * i] = static_cast<float>(static_cast<InT>(vals[i]));
    }
    if (j == 2 || hv % rep == 0) {
      deltanet_conv_state_row<InT, Dk, K>(conv_state_out, qkv, conv_state, mask, lengths, b_idx, r, lane, 1, C,
                                          has_conv_state, has_mask, has_lengths, qkv_ld, c0);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float y_dv = 0.0f;  // the read-out stays fp32 into the norm
  if (live) {
    const threadgroup float* q_t = qkv_head;
    const threadgroup float* k_t = qkv_head + Dk;
    y_dv = deltanet_decode_row<LANES, PARTIALS, true>(state, q_t, k_t, col0, qkv_head[2 * Dk + dv], g_t, beta_t);
  }

  deltanet_store_state<LANES>(state_out + row, state, col0);

  const float inv_rms = deltanet_head_inv_rms<Dv>(y_head, y_dv, dv, col0 == 0, lane, norm_eps);
  if (col0 == 0) {
    out[static_cast<size_t>(n) * Dv + dv] = static_cast<InT>(deltanet_gated_out(y_dv, inv_rms, w_dv, zc));
  }
}

// @kernel deltanet_gates
// Elementwise gates for [B, T, Hv]: g and beta, fp32.
// params: named in the launcher's KernelSpec (a generated prologue declares them). Grid: n rounded up to the threadgroup; tail guarded.
{
  const int i = static_cast<int>(thread_position_in_grid.x);
  if (i < n) {
    const int hv = i % Hv;
    g[i] = deltanet_decay(static_cast<float>(a[i]), static_cast<float>(A_log[hv]), static_cast<float>(dt_bias[hv]));
    beta[i] = deltanet_beta(static_cast<float>(b[i]));
  }
}

// @kernel deltanet_scan_register
// Prefill scan with the state in registers for the whole chunk (switch register_scan).
// q, k: [B, T, Hk, Dk] InT; v: [B, T, Hv, Dv] InT; g: [B, T, Hv] fp32; beta: [B, T, Hv] (fp32 or InT);
// state_in: [B, Hv, Dv, Dk] fp32 (read if has_state); mask: [B, T] bool (read if has_mask).
// y: [B, T, Hv, Dv] OutT (InT in prefill; fp32 between the unfused decode kernels), 0 where masked;
// state_out: [B, Hv, Dv, Dk] fp32.
// params: named in the launcher's KernelSpec (a generated prologue declares them).
{
  constexpr int LANES = Dk / DELTANET_EPL;
  constexpr int ROWS = 32 / LANES;
  const int n = static_cast<int>(thread_position_in_grid.z);  // b * Hv + hv
  const int b_idx = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int lane = static_cast<int>(thread_index_in_simdgroup);
  const int col0 = lane % LANES;
  const int dv = static_cast<int>(thread_position_in_grid.y) * ROWS + lane / LANES;

  const size_t row = (static_cast<size_t>(n) * Dv + dv) * Dk;
  float state[DELTANET_EPL];
  deltanet_load_state<LANES>(state, state_in + row, col0, has_state);

  for (int t = 0; t < T; ++t) {
    const size_t bt = static_cast<size_t>(b_idx) * T + t;
    const size_t y_at = (bt * Hv + hv) * Dv + dv;
    // Uniform over the simdgroup (one b, one t): the shuffles below are reached by all lanes.
    if (has_mask && !mask[bt]) {
      if (col0 == 0) {
        y[y_at] = static_cast<OutT>(0);
      }
      continue;
    }
    const device InT* k_t = k + (bt * Hk + hk) * Dk;
    const device InT* q_t = q + (bt * Hk + hk) * Dk;
    const float out = deltanet_decode_row<LANES, PARTIALS, false>(
        state, q_t, k_t, col0, static_cast<float>(v[(bt * Hv + hv) * Dv + dv]), g[bt * Hv + hv],
        static_cast<float>(beta[bt * Hv + hv]));
    if (col0 == 0) {
      y[y_at] = static_cast<OutT>(out);
    }
  }

  deltanet_store_state<LANES>(state_out + row, state, col0);
}

// @kernel deltanet_scan_staged
// deltanet_scan_register's scan with its inputs staged through threadgroup memory, a chunk of CHUNK
// tokens at a time, the next chunk prefetched into registers while this one computes (issue 14: the
// register scan waits on q/k/v/g/beta loads from device memory inside every step's dependency
// chain, with 1 simdgroup per SIMD scheduler to hide nothing). Same bits as deltanet_scan_register
// and as the decode kernels: each token goes through deltanet_decode_row (same lanes per row, same
// columns per lane, same accumulation order, same shuffles), and the staged values are the same fp32
// values (InT -> float is exact; g, beta are the same loads). Same inputs, outputs and grid as
// deltanet_scan_register; TGY (template) = threadgroup.y, so the chunk's loads split evenly over the
// 32 TGY threads of the threadgroup (all of one head (b, hv): q, k, g, beta, mask are shared, v per
// row). Per chunk: each thread loads CHUNK Dk / (32 TGY) elements of q and of k, CHUNK TG_ROWS /
// (32 TGY) of v (coalesced, independent: one memory latency per chunk instead of one per token),
// threads tid < CHUNK one token's g, beta, mask; two barriers per chunk (uniform: t0 is).
// params: named in the launcher's KernelSpec (a generated prologue declares them).
{
  constexpr int LANES = Dk / DELTANET_EPL;
  constexpr int ROWS = 32 / LANES;
  constexpr int CHUNK = Dk <= 128 ? 16 : 8;  // q_s + k_s: 16 KiB at Dk = 128 and 256
  constexpr int NTHREADS = 32 * TGY;
  constexpr int TG_ROWS = ROWS * TGY;
  constexpr int QK_PER = (CHUNK * Dk + NTHREADS - 1) / NTHREADS;
  constexpr int V_PER = (CHUNK * TG_ROWS + NTHREADS - 1) / NTHREADS;
  threadgroup float4 q_s4[CHUNK * Dk / 4];  // float4: 16-byte aligned, read a chunk at a time
  threadgroup float4 k_s4[CHUNK * Dk / 4];
  threadgroup float* q_s = reinterpret_cast<threadgroup float*>(q_s4);
  threadgroup float* k_s = reinterpret_cast<threadgroup float*>(k_s4);
  threadgroup float v_s[CHUNK * TG_ROWS];
  threadgroup float gbl_s[3 * CHUNK];  // g, beta, live (1 or 0) of each staged token

  const int n = static_cast<int>(thread_position_in_grid.z);  // b * Hv + hv
  const int b_idx = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int lane = static_cast<int>(thread_index_in_simdgroup);
  const int col0 = lane % LANES;
  const int local_row = static_cast<int>(thread_position_in_threadgroup.y) * ROWS + lane / LANES;
  const int dv = static_cast<int>(thread_position_in_grid.y) * ROWS + lane / LANES;
  const int row0 = dv - local_row;  // the threadgroup's first state row
  const int tid = static_cast<int>(thread_index_in_threadgroup);

  const size_t row = (static_cast<size_t>(n) * Dv + dv) * Dk;
  float state[DELTANET_EPL];
  deltanet_load_state<LANES>(state, state_in + row, col0, has_state);

  float q_pf[QK_PER];
  float k_pf[QK_PER];
  float v_pf[V_PER];
  float g_pf = 0.0f;
  float beta_pf = 0.0f;
  float live_pf = 0.0f;

  // t0 = -CHUNK only prefetches chunk 0; every later pass stages the prefetched chunk t0, prefetches
  // chunk t0 + CHUNK (its loads in flight while chunk t0 computes) and computes chunk t0.
  for (int t0 = -CHUNK; t0 < T; t0 += CHUNK) {
    if (t0 >= 0) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // chunk t0 - CHUNK fully read
      for (int j = 0; j < QK_PER; ++j) {
        const int e = tid + j * NTHREADS;
        if (e < CHUNK * Dk) {
          q_s[e] = q_pf[j];
          k_s[e] = k_pf[j];
        }
      }
      for (int j = 0; j < V_PER; ++j) {
        const int e = tid + j * NTHREADS;
        if (e < CHUNK * TG_ROWS) {
          v_s[e] = v_pf[j];
        }
      }
      if (tid < CHUNK) {
        gbl_s[tid] = g_pf;
        gbl_s[CHUNK + tid] = beta_pf;
        gbl_s[2 * CHUNK + tid] = live_pf;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    const int tn = t0 + CHUNK;  // prefetch chunk tn (tokens past T: zeros, not live)
    if (tn < T) {
      for (int j = 0; j < QK_PER; ++j) {
        const int e = tid + j * NTHREADS;
        const int t = tn + e / Dk;
        const bool in = e < CHUNK * Dk && t < T;
        const size_t at = ((static_cast<size_t>(b_idx) * T + t) * Hk + hk) * Dk + e % Dk;
        q_pf[j] = in ? static_cast<float>(q[at]) : 0.0f;
        k_pf[j] = in ? static_cast<float>(k[at]) : 0.0f;
      }
      for (int j = 0; j < V_PER; ++j) {
        const int e = tid + j * NTHREADS;
        const int t = tn + e / TG_ROWS;
        const bool in = e < CHUNK * TG_ROWS && t < T;
        const size_t at = ((static_cast<size_t>(b_idx) * T + t) * Hv + hv) * Dv + row0 + e % TG_ROWS;
        v_pf[j] = in ? static_cast<float>(v[at]) : 0.0f;
      }
      if (tid < CHUNK) {
        const int t = tn + tid;
        const size_t bt = static_cast<size_t>(b_idx) * T + t;
        const bool in = t < T;
        g_pf = in ? static_cast<float>(g[bt * Hv + hv]) : 0.0f;
        beta_pf = in ? static_cast<float>(beta[bt * Hv + hv]) : 0.0f;
        live_pf = (in && (!has_mask || mask[bt])) ? 1.0f : 0.0f;
      }
    }

    if (t0 >= 0) {
      const int steps = min(CHUNK, T - t0);
      for (int s = 0; s < steps; ++s) {
        const size_t bt = static_cast<size_t>(b_idx) * T + t0 + s;
        const size_t y_at = (bt * Hv + hv) * Dv + dv;
        // Uniform over the threadgroup (one b, one t): the shuffles are reached by all lanes.
        if (gbl_s[2 * CHUNK + s] == 0.0f) {
          if (col0 == 0) {
            y[y_at] = static_cast<OutT>(0);
          }
          continue;
        }
        const threadgroup float* q_t = q_s + s * Dk;
        const threadgroup float* k_t = k_s + s * Dk;
        const float out = deltanet_decode_row<LANES, PARTIALS, true>(state, q_t, k_t, col0, v_s[s * TG_ROWS + local_row], gbl_s[s],
                                                     gbl_s[CHUNK + s]);
        if (col0 == 0) {
          y[y_at] = static_cast<OutT>(out);
        }
      }
    }
  }

  deltanet_store_state<LANES>(state_out + row, state, col0);
}

// @kernel deltanet_scan_blockwise
// The register_scan=off ablation: same thread layout, but the state is materialised in device
// memory after every block of `block` tokens (block_states[n, blk] = state after block blk) and
// read back from there to start the next block. Same inputs as deltanet_scan_register.
// block_states: [B * Hv, n_blocks, Dv, Dk] fp32; state_out: [B, Hv, Dv, Dk] fp32.
// params: named in the launcher's KernelSpec (a generated prologue declares them).
{
  constexpr int LANES = Dk / DELTANET_EPL;
  constexpr int ROWS = 32 / LANES;
  const int n = static_cast<int>(thread_position_in_grid.z);
  const int b_idx = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int lane = static_cast<int>(thread_index_in_simdgroup);
  const int col0 = lane % LANES;
  const int dv = static_cast<int>(thread_position_in_grid.y) * ROWS + lane / LANES;

  const size_t row = (static_cast<size_t>(n) * Dv + dv) * Dk;
  const size_t state_size = static_cast<size_t>(Dv) * Dk;
  const size_t blocks_row = static_cast<size_t>(n) * n_blocks * state_size + static_cast<size_t>(dv) * Dk;
  float state[DELTANET_EPL];

  for (int blk = 0; blk < n_blocks; ++blk) {
    // Block start: the state comes from memory (the previous block's slot, or the input).
    if (blk == 0) {
      deltanet_load_state<LANES>(state, state_in + row, col0, has_state);
    } else {
      deltanet_load_state<LANES>(state, block_states + blocks_row + (blk - 1) * state_size, col0, true);
    }
    const int t_end = min(T, (blk + 1) * block);
    for (int t = blk * block; t < t_end; ++t) {
      const size_t bt = static_cast<size_t>(b_idx) * T + t;
      const size_t y_at = (bt * Hv + hv) * Dv + dv;
      if (has_mask && !mask[bt]) {
        if (col0 == 0) {
          y[y_at] = static_cast<OutT>(0);
        }
        continue;
      }
      const device InT* k_t = k + (bt * Hk + hk) * Dk;
      const device InT* q_t = q + (bt * Hk + hk) * Dk;
      const float out = deltanet_decode_row<LANES, PARTIALS, false>(
          state, q_t, k_t, col0, static_cast<float>(v[(bt * Hv + hv) * Dv + dv]), g[bt * Hv + hv],
          static_cast<float>(beta[bt * Hv + hv]));
      if (col0 == 0) {
        y[y_at] = static_cast<OutT>(out);
      }
    }
    // Block end: materialise the state.
    deltanet_store_state<LANES>(block_states + blocks_row + blk * state_size, state, col0);
  }

  deltanet_store_state<LANES>(state_out + row, state, col0);
}

// @kernel deltanet_gated_norm
// out = OutT(silu(z) * rms_norm(x) * weight) over rows of Dv, fp32 inside (one simdgroup per row).
// x, z: [rows, Dv] (x InT or fp32); weight: [Dv] (any float type); eps: [1] fp32. params: [rows].
// Grid: (32, rows rounded up to threadgroup.y); rows past the end do nothing (uniform per simdgroup).
{
  constexpr int PER_LANE = Dv / 32;
  const int r = static_cast<int>(thread_position_in_grid.y);
  const int lane = static_cast<int>(thread_index_in_simdgroup);
  if (r < rows) {
    const size_t base = static_cast<size_t>(r) * Dv;
    float xs[PER_LANE];
    float ss = 0.0f;
    for (int i = 0; i < PER_LANE; ++i) {
      xs[i] = static_cast<float>(x[base + lane + i * 32]);
      ss += xs[i] * xs[i];
    }
    ss = simd_sum(ss);
    const float inv_rms = rsqrt(ss / Dv + eps[0]);
    for (int i = 0; i < PER_LANE; ++i) {
      const int c = lane + i * 32;
      const float normed = xs[i] * inv_rms * static_cast<float>(weight[c]);
      const float zc = static_cast<float>(z[base + c]);
      const float silu_z = zc / (1.0f + exp(-zc));
      out[base + c] = static_cast<OutT>(silu_z * normed);
    }
  }
}

// @kernel deltanet_decode_fused
// One decode token, everything in one kernel (switch fused_recurrent_norm): gates from a, b,
// A_log, dt_bias; the delta-rule update of the register-held state; the read-out y; and the gated
// RMSNorm of y over Dv. One threadgroup per value head (b, hv): Dv / ROWS simdgroups.
// q, k: [B, Hk, Dk] InT; v, z: [B, Hv, Dv] InT; a, b: [B, Hv]; A_log, dt_bias: [Hv] (any float type);
// state_in: [B, Hv, Dv, Dk] fp32; mask: [B] bool (if has_mask); weight: [Dv]; eps: [1] fp32.
// out: [B, Hv, Dv] InT (normalised, gated); state_out: [B, Hv, Dv, Dk] fp32.
// params: named in the launcher's KernelSpec (a generated prologue declares them).
{
  constexpr int LANES = Dk / DELTANET_EPL;
  constexpr int ROWS = 32 / LANES;
  threadgroup float y_head[Dv];  // the head's fp32 read-outs, for the norm
  const int n = static_cast<int>(thread_position_in_grid.z);
  const int b_idx = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int lane = static_cast<int>(thread_index_in_simdgroup);
  const int sg = static_cast<int>(thread_position_in_grid.y);
  const int col0 = lane % LANES;
  const int dv = sg * ROWS + lane / LANES;
  const bool live = !has_mask || mask[b_idx];  // uniform over the threadgroup

  const size_t row = (static_cast<size_t>(n) * Dv + dv) * Dk;
  float state[DELTANET_EPL];
  deltanet_load_state<LANES>(state, state_in + row, col0, has_state);

  float y_dv = 0.0f;  // the read-out stays fp32 into the norm (stock rounds it to InT first)
  if (live) {
    const float g_t = deltanet_decay(static_cast<float>(a[n]), static_cast<float>(A_log[hv]),
                                     static_cast<float>(dt_bias[hv]));
    const float beta_t = deltanet_beta(static_cast<float>(b[n]));
    const device InT* k_t = k + (static_cast<size_t>(b_idx) * Hk + hk) * Dk;
    const device InT* q_t = q + (static_cast<size_t>(b_idx) * Hk + hk) * Dk;
    y_dv = deltanet_decode_row<LANES, PARTIALS, false>(state, q_t, k_t, col0, static_cast<float>(v[static_cast<size_t>(n) * Dv + dv]),
                                      g_t, beta_t);
  }

  deltanet_store_state<LANES>(state_out + row, state, col0);

  const float inv_rms = deltanet_head_inv_rms<Dv>(y_head, y_dv, dv, col0 == 0, lane, eps[0]);
  if (col0 == 0) {
    const float zc = static_cast<float>(z[static_cast<size_t>(n) * Dv + dv]);
    out[static_cast<size_t>(n) * Dv + dv] = static_cast<InT>(deltanet_gated_out(y_dv, inv_rms,
                                                                                 static_cast<float>(weight[dv]), zc));
  }
}

// @kernel deltanet_conv_qk_norm_decode
// Each token of a chunk in front of the recurrence (named for decode, T = 1, where it began; it runs
// every chunk so that a token's q, k, v never depend on the chunk it came in or on its batch): the
// depthwise causal conv1d over [conv_state; qkv] + SiLU, the L2 normalisation of the q and k heads
// with the read-out scale folded into q (q * Dk^-1 after rms_norm, k * Dk^-0.5), and the new conv
// state, as stock's conv1d / silu / split / normalize_qk / state update, in one kernel.
// qkv: [B, T, C] InT (C = conv_dim = 2 Hk Dk + Hv Dv); conv_state: [B, K-1, C] InT (if has_state,
// else zeros); weight: [C, K, 1]; mask: [B, T] bool (if has_mask: a masked token feeds zeros, as
// stock); lengths: [B] int32 (if has_lengths: valid tokens of each row of a right-padded chunk; the
// new state ends there, clamped to [0, T], as stock's); eps: [1] fp32, the l2norm eps (added to
// sum(x^2)).
// q, k: [B, T, Hk, Dk] InT; v: [B, T, C - 2 Hk Dk] InT; conv_state_out: [B, K-1, C] InT.
// params: named in the launcher's KernelSpec (a generated prologue declares them). Rows of Dk channels: row r < Hk is q head
// r, Hk <= r < 2 Hk is k head r - Hk, the rest are value channels. Grid (32, C / Dk, B * T): one
// simdgroup per (row, token), Dk / 32 channels per lane (lane + 32 i: adjacent lanes, adjacent
// channels). A token's arithmetic is the same whatever T, B and the other tokens are.
{
  constexpr int PER_LANE = Dk / 32;
  const int bt = static_cast<int>(thread_position_in_grid.z);
  const int b_idx = bt / T;
  const int t = bt % T;
  const int r = static_cast<int>(thread_position_in_grid.y);
  const int lane = static_cast<int>(thread_index_in_simdgroup);

  float vals[PER_LANE];
  deltanet_conv_row<Dk, K>(vals, qkv, conv_state, weight, mask, b_idx, t, r, lane, T, C, Hk, has_state, has_mask,
                           eps[0], C);

  const size_t tok = static_cast<size_t>(bt);
  if (r < 2 * Hk) {
    device InT* dst = r < Hk ? q + (tok * Hk + r) * Dk : k + (tok * Hk + (r - Hk)) * Dk;
    for (int i = 0; i < PER_LANE; ++i) {
      dst[lane + 32 * i] = static_cast<InT>(vals[i]);
    }
  } else {
    const int value_dim = C - 2 * Hk * Dk;
    for (int i = 0; i < PER_LANE; ++i) {
      v[tok * value_dim + (r - 2 * Hk) * Dk + lane + 32 * i] = static_cast<InT>(vals[i]);
    }
  }

  // The new conv state (one simdgroup per row of channels writes it).
  if (t == 0) {
    deltanet_conv_state_row<InT, Dk, K>(conv_state_out, qkv, conv_state, mask, lengths, b_idx, r, lane, T, C,
                                        has_state, has_mask, has_lengths, C);
  }
}

// @kernel deltanet_decode_conv_fused
// One decode token from the in_proj output, everything in one kernel (switch fused_conv_step, with
// fused_recurrent_norm): deltanet_conv_qk_norm_decode's work for the rows the head needs, then
// deltanet_decode_fused's. Same bits as those two kernels in turn (out, new conv state, new recurrent
// state): the conv rows go through the same header function (deltanet_conv_row) and are rounded to
// InT where that kernel stores q, k, v; the step and the norm are deltanet_decode_fused's helpers.
// Geometry as deltanet_decode_fused: one threadgroup per value head (b, hv), Dv / ROWS simdgroups.
// Before the step, simdgroups 0, 1, 2 (one simdgroup in turn where there are fewer) compute the conv
// rows of the q and k heads hk = hv / (Hv / Hk) and of value head hv (Dv == Dk: one row) into
// threadgroup memory; a barrier; the step reads q, k, v from there.
// Conv state: the value channels of head hv are written by its threadgroup, the q and k channels of
// head hk by the one of its Hv / Hk threadgroups with hv % (Hv / Hk) == 0 (needs C = 2 Hk Dk + Hv Dv).
// qkv: [B, 1, C] InT, row stride qkv_ld; conv_state: [B, K-1, C] InT (if has_conv_state); conv_weight:
// [C, K, 1]; mask: [B, 1] bool (if has_mask); lengths: [B] int32 (if has_lengths); a, b: batch row b_idx's
// Hv values at b_idx * ab_ld + a_off (b_off); A_log, dt_bias: [Hv]; state_in: [B, Hv, Dv, Dk] fp32 (if
// has_state); z: batch row b_idx's Hv * Dv values at b_idx * z_ld + z_off, InT; weight: [Dv]; qk_eps: [1] fp32
// (the l2norm eps); norm_eps: [1] fp32. Strides and offsets let qkv, z, b and a be one array, the fused
// in-projection's output [B, 1, C + Hv Dv + 2 Hv] (switch fused_in_proj: no split primitive before the
// launch), or four arrays (strides C, Hv Dv, Hv; offsets 0).
// out: [B, Hv, Dv] InT; state_out: [B, Hv, Dv, Dk] fp32; conv_state_out: [B, K-1, C] InT.
// params: named in the launcher's KernelSpec (a generated prologue declares them).
{
  threadgroup float4 qkv_head4[3 * Dk / 4];  // q (head hk), k (head hk), v (head hv); float4: 16-byte aligned
  threadgroup float y_head[Dv];
  const int n = static_cast<int>(thread_position_in_grid.z);
  const int b_idx = n / Hv;
  const int hv = n % Hv;
  const int lane = static_cast<int>(thread_index_in_simdgroup);
  const int sg = static_cast<int>(thread_position_in_grid.y);
  const int dv = sg * (32 / (Dk / DELTANET_EPL)) + lane / (Dk / DELTANET_EPL);
  // The gates and the norm's inputs, loaded before the conv rows (they depend on nothing the kernel writes).
  const size_t ab_row = static_cast<size_t>(b_idx) * ab_ld + hv;
  const float g_t = deltanet_decay(static_cast<float>(a[ab_row + a_off]), static_cast<float>(A_log[hv]),
                                   static_cast<float>(dt_bias[hv]));
  const float beta_t = deltanet_beta(static_cast<float>(b[ab_row + b_off]));
  const float zc = static_cast<float>(z[static_cast<size_t>(b_idx) * z_ld + z_off + hv * Dv + dv]);
  deltanet_decode_conv_step<InT, Dk, Dv, K, PARTIALS>(
      qkv, qkv_ld, 0, 0, 0, conv_state, conv_weight, mask, lengths, state_in, g_t, beta_t, zc, weight, out,
      state_out, conv_state_out, Hk, Hv, C, has_conv_state, has_state, has_mask, has_lengths, qk_eps[0], norm_eps[0],
      n, lane, sg, reinterpret_cast<threadgroup float*>(qkv_head4), y_head);
}

// @kernel deltanet_decode_from_hidden
// One decode token of a Qwen3.5/3.6 DeltaNet layer from the layer's input (switch fused_in_proj_step, with the dense
// row GEMV): the rows of the fused in-projection this value head needs, by the row GEMV's arithmetic
// (linear_gemv_q4_accumulate; NORM = 1: the layer's input RMSNorm inside it, as linear_gemv_q4_rms_norm), rounded to
// InT into threadgroup memory, then deltanet_decode_conv_fused's work from there (deltanet_decode_conv_step). So the
// same bits as linear_gemv_q4[_rms_norm] over the whole in-projection followed by deltanet_decode_conv_fused, in one
// launch: the in-projection's output never goes to memory, and the layer's input norm needs no launch.
// Rows of the fused in-projection W [P, Hd] (q | k | v (C = 2 Hk Dk + Hv Dv), z (Hv Dv), b (Hv), a (Hv)) this head
// reads: q and k of head hk (Dk each, from hk Dk and Hk Dk + hk Dk), v and z of head hv (Dv each, from 2 Hk Dk + hv Dv
// and C + hv Dv), b and a of head hv (C + Hv Dv + hv, C + Hv Dv + Hv + hv): 4 Dk + 2 rows (Dv == Dk) in groups of
// LINEAR_GEMV_ROWS, group g taken by simdgroup g % SIMDGROUPS; the q and k rows are read by each of the Hv / Hk heads
// sharing them.
// Geometry as deltanet_decode_conv_fused: grid (32, Dv / ROWS, B * Hv), one threadgroup per value head. Template U:
// weight pieces a row and lane in flight in the GEMV (the host's FROM_HIDDEN_UNROLL).
// x [B, 1, Hd] InT (the layer's input: the norm's input with NORM); in_norm_weight [Hd] InT, in_norm_eps [1] fp32 (NORM
// only); w [P, Hd / 8] uint32, scales, biases [P, Hd / GS] InT; the rest as deltanet_decode_conv_fused's (conv_state
// [B, K-1, C], conv_weight, mask, lengths, A_log, dt_bias, state_in, weight, qk_eps, norm_eps).
// out: [B, Hv, Dv] InT; state_out: [B, Hv, Dv, Dk] fp32; conv_state_out: [B, K-1, C] InT.
{
  constexpr int ROWS = 32 / (Dk / DELTANET_EPL);
  constexpr int SIMDGROUPS = Dv / ROWS;
  constexpr int SEGMENT_GROUPS = Dk / LINEAR_GEMV_ROWS;   // groups of one segment (q, k, v or z)
  constexpr int GROUPS = 4 * SEGMENT_GROUPS + 1;           // and one for b and a
  threadgroup float4 proj4[Dk + 1];                        // q | k | v | z | b, a (fp32 of InT values; 16-byte aligned)
  threadgroup vec<InT, 4> x4[Hd / 4];                      // the GEMV's input row (normalised with NORM)
  threadgroup float4 qkv_head4[3 * Dk / 4];
  threadgroup float y_head[Dv];
  threadgroup float* proj = reinterpret_cast<threadgroup float*>(proj4);
  const int n = static_cast<int>(thread_position_in_grid.z);
  const int b_idx = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int lane = static_cast<int>(thread_index_in_simdgroup);
  const int sg = static_cast<int>(thread_position_in_grid.y);
  const int P = C + Hv * Dv + 2 * Hv;
  const uint32_t exponent = q4_exponent_unfolded(P);

  // The GEMV's input row into threadgroup memory once: x, or with NORM the layer's input norm of it, each value as
  // linear_gemv_q4_accumulate normalises it (every simdgroup computes the same inv_rms, the norm GEMV's way).
  linear_gemv_stage_input<InT, NORM != 0>(x, in_norm_weight, in_norm_eps, Hd, B, b_idx, lane, sg * 32 + lane,
                                           SIMDGROUPS * 32, x4);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int g = sg; g < GROUPS; g += SIMDGROUPS) {  // uniform per simdgroup (simd_sums inside)
    long wrow[LINEAR_GEMV_ROWS];
    long srow[LINEAR_GEMV_ROWS];
    int slot[LINEAR_GEMV_ROWS];  // where row r's value goes in proj (-1: a padding row, not stored)
    const int segment = g / SEGMENT_GROUPS;
    const int first = (g % SEGMENT_GROUPS) * LINEAR_GEMV_ROWS;
    const int base = segment == 0 ? hk * Dk : (segment == 1 ? (Hk + hk) * Dk : (segment == 2 ? 2 * Hk * Dk + hv * Dv
                                                                                               : C + hv * Dv));
    #pragma unroll
    for (int r = 0; r < LINEAR_GEMV_ROWS; ++r) {
      long row = base + first + r;
      slot[r] = segment * Dk + first + r;
      if (segment == 4) {  // b, then a; the padding rows read a again
        row = C + Hv * Dv + (r == 0 ? hv : Hv + hv);
        slot[r] = r < 2 ? 4 * Dk + r : -1;
      }
      wrow[r] = row * (Hd / 32);
      srow[r] = row * (Hd / GS);
    }
    linear_gemv_q4_staged_rows<InT, GS, U>(x4, w, scales, biases, wrow, srow, Hd, lane, exponent, slot, proj);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int dv = sg * ROWS + lane / (Dk / DELTANET_EPL);
  const float g_t = deltanet_decay(proj[4 * Dk + 1], static_cast<float>(A_log[hv]), static_cast<float>(dt_bias[hv]));
  const float beta_t = deltanet_beta(proj[4 * Dk]);
  const float zc = proj[3 * Dk + dv];
  // q, k, v of this head sit at proj[0 ..], proj[Dk ..], proj[2 Dk ..]: row j's channel c is proj[c - c0_j].
  deltanet_decode_conv_step<InT, Dk, Dv, K, PARTIALS>(
      proj, 0, hk * Dk, (Hk + hk) * Dk - Dk, (2 * Hk + hv) * Dk - 2 * Dk, conv_state, conv_weight, mask, lengths,
      state_in, g_t, beta_t, zc, weight, out, state_out, conv_state_out, Hk, Hv, C, has_conv_state, has_state,
      has_mask, has_lengths, qk_eps[0], norm_eps[0], n, lane, sg, reinterpret_cast<threadgroup float*>(qkv_head4),
      y_head);
}
