// MoE router (lily_mlx/ops/moe/kernels.py dispatches it; every call size, switch fused_expert_up):
//   moe_router_softmax_topk_q   per token: router logits (quantised GEMV), softmax, top-k, renormalise,
//                               the shared expert's sigmoid gate, and the decode GEMM schedule
//                               (switch split_router off: one threadgroup per token does it all)
//   moe_router_logits_q         the logits alone, one simdgroup per expert row (split_router on)
//   moe_router_topk_from_logits then the rest of the first kernel's work from those logits
//
// It computes what MLX-LM's Qwen3NextSparseMoeBlock does with five to seven MLX ops, with stock's
// roundings: logits rounded to T (the quantised matmul's output type), softmax in fp32 rounded to T,
// the k largest probabilities (ties: the lower expert id), their sum rounded to T, each score divided
// by it and rounded to T; the shared-expert gate is sigmoid(logit rounded to T), rounded to T.
// Quantisation: affine, BITS = 8 (4 values per uint32 word, low byte first) or 4 (8 nibbles), group
// 64: w = scale * q + bias; scales and biases in T.
//
// Batch invariance (keep it): one threadgroup per token, and a token's arithmetic (lane split of D,
// fp32 accumulation order, the simd_sum butterfly, the reductions over experts) never depends on
// the other tokens of the call or their number.

// @header
#define MOE_ROUTER_THREADS 512  // 16 simdgroups (1024 would need <= 64 registers a thread on NVIDIA GPUs)
#define MOE_ROUTER_MAX_E 1024   // experts (threadgroup arrays; the host checks)
#define MOE_ROUTER_MAX_D 4096   // hidden size (the activation row staged as floats; the host checks)
#define MOE_ROUTER_MAX_K 32     // experts per token (lane j keeps round j's pick; the host checks)
#define MOE_ROUTER_LOGIT_SIMDGROUPS 8  // expert rows per threadgroup of moe_router_logits_q
#define MOE_ROUTER_LOADS 4      // 16-byte weight loads a lane issues before it uses them
#define MOE_ROUTER_PREFETCH 16  // words of its row a lane of moe_residual_norm_router_logits_q loads before the norm

// Activation values loaded as raw 32-bit words (vector loads): PER values of type T per word, value h of a word
// as a float (the same value as float(T)). The register tiles (gemm.metal) and the router use them.
template <typename T> struct MoeWords;
template <> struct MoeWords<bfloat16_t> {
  static constant constexpr int PER = 2;
  static inline float get(uint w, int h) { return as_type<float>(h ? (w & 0xffff0000u) : (w << 16)); }
};
template <> struct MoeWords<half> {
  static constant constexpr int PER = 2;
  static inline float get(uint w, int h) { return float(as_type<half>(ushort(h ? (w >> 16) : (w & 0xffffu)))); }
};
template <> struct MoeWords<float> {
  static constant constexpr int PER = 1;
  static inline float get(uint w, int) { return as_type<float>(w); }
};

// NW consecutive words from p (aligned to min(4 * NW, 16) bytes), in 16-byte loads where it can.
template <int NW>
inline void moe_load_words(const device uint* p, thread uint* w) {
  if (NW >= 4) {
    for (int c = 0; c < NW / 4; ++c) {
      const uint4 t = reinterpret_cast<const device uint4*>(p)[c];
      w[4 * c] = t.x;
      w[4 * c + 1] = t.y;
      w[4 * c + 2] = t.z;
      w[4 * c + 3] = t.w;
    }
  } else if (NW == 2) {
    const uint2 t = *reinterpret_cast<const device uint2*>(p);
    w[0] = t.x;
    w[1] = t.y;
  } else {
    w[0] = p[0];
  }
}

// The activation row x[0 .. D) into threadgroup memory as floats (D a multiple of 64), by the
// threadgroup's `threads` threads; the caller puts a barrier after it. Every row's dot product of the
// token then reads x from there instead of device memory.
template <typename PX>
inline void moe_router_stage_x(threadgroup float4* xs, PX x, int D, uint tid, uint threads) {
  for (int i = int(tid); i < D / 4; i += int(threads)) {
    xs[i] = float4(float(x[4 * i]), float(x[4 * i + 1]), float(x[4 * i + 2]), float(x[4 * i + 3]));
  }
}

// A lane's next N words (wi = w0, w0 + 32, ...; those < words) with their scales and biases, all loads
// issued before any is used, so their memory latencies overlap.
template <int BITS, int N, typename PW, typename PS, typename PB>
inline void moe_router_fetch_words(PW w, PS scales, PB biases, int w0, int words, thread uint32_t* word,
                                   thread float* scale, thread float* bias) {
  constexpr int WORDS_PER_GROUP = 64 / (32 / BITS);
  #pragma unroll
  for (int u = 0; u < N; ++u) {
    const int wi = w0 + 32 * u;
    if (wi < words) {
      word[u] = w[wi];
      scale[u] = float(scales[wi / WORDS_PER_GROUP]);
      bias[u] = float(biases[wi / WORDS_PER_GROUP]);
    }
  }
}

// acc plus one word's term, scale * (x . q) + bias * sum(x) over its 32 / BITS values xv: the one expression
// every router form uses for every word, so a logit has the same bits in each.
template <int BITS>
inline float moe_router_word_term(float acc, uint32_t word, float scale, float bias, thread const float* xv) {
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  float xq = 0.0f;
  float xsum = 0.0f;
  #pragma unroll
  for (int j = 0; j < 32 / BITS; ++j) {
    xq = metal::fma(xv[j], float((word >> (BITS * j)) & MASK), xq);
    xsum += xv[j];
  }
  return acc + metal::fma(scale, xq, bias * xsum);  // fused explicitly: one rounding on every target
}

// acc plus the terms of N fetched words (wi = w0, w0 + 32, ...; those < words) against the staged x, in order.
template <int BITS, int N>
inline float moe_router_staged_terms(float acc, thread const uint32_t* word, thread const float* scale,
                                     thread const float* bias, const threadgroup float4* xs, int w0, int words) {
  constexpr int VALUES_PER_WORD = 32 / BITS;
  #pragma unroll
  for (int u = 0; u < N; ++u) {
    const int wi = w0 + 32 * u;
    if (wi < words) {
      float xv[VALUES_PER_WORD];
      for (int j = 0; j < VALUES_PER_WORD; ++j) {
        xv[j] = xs[(wi * VALUES_PER_WORD + j) / 4][j % 4];
      }
      acc = moe_router_word_term<BITS>(acc, word[u], scale[u], bias[u], xv);
    }
  }
  return acc;
}

// Dot product of one quantised row with the staged x over D, reduced over the simdgroup (every lane
// gets it). Adjacent lanes read adjacent words (coalesced); each lane sums its words l, l + 32, ... in
// order, per word scale * (x . q) + bias * sum(x), as MLX's own quantised GEMV factors the affine
// weights. A lane issues MOE_ROUTER_LOADS words' loads (word, scale, bias) before it uses the first, so
// their memory latencies overlap; the arithmetic and its order do not depend on that. Every multiply-add
// is an explicit fma: a compiler free to contract `a * b + c * d` either way (CUDA's default) could
// otherwise round a logit differently in the two router forms.
// Pointer types are template parameters: MLX passes an input of fewer than 8 elements (a small
// shared-expert gate's scales) in the constant address space, which a `const device T*` refuses.
// moe_router_dot_words: acc plus a lane's words from w_begin on; moe_router_row_dot: the whole row.
template <int BITS, typename PW, typename PS, typename PB>
inline float moe_router_dot_words(float acc, PW w, PS scales, PB biases, const threadgroup float4* xs, int w_begin,
                                  int words) {
  for (int w0 = w_begin; w0 < words; w0 += 32 * MOE_ROUTER_LOADS) {
    uint32_t word[MOE_ROUTER_LOADS];
    float scale[MOE_ROUTER_LOADS];
    float bias[MOE_ROUTER_LOADS];
    moe_router_fetch_words<BITS, MOE_ROUTER_LOADS>(w, scales, biases, w0, words, word, scale, bias);
    acc = moe_router_staged_terms<BITS, MOE_ROUTER_LOADS>(acc, word, scale, bias, xs, w0, words);
  }
  return acc;
}

template <int BITS, typename PW, typename PS, typename PB>
inline float moe_router_row_dot(PW w, PS scales, PB biases, const threadgroup float4* xs, int D, uint lane) {
  return simd_sum(moe_router_dot_words<BITS>(0.0f, w, scales, biases, xs, int(lane), D * BITS / 32));
}

// The same dot product in two halves, for a kernel with other work before its row is staged: a lane's first
// MOE_ROUTER_PREFETCH words (with their scales and biases) loaded early (moe_router_prefetch_words), the
// row's dot product later from them and the remaining words (moe_router_row_dot_prefetched): the same
// words in the same order through the same expression as moe_router_row_dot, so the same bits.
template <int BITS, typename PW, typename PS, typename PB>
inline void moe_router_prefetch_words(PW w, PS scales, PB biases, int D, uint lane, thread uint32_t* word,
                                      thread float* scale, thread float* bias) {
  moe_router_fetch_words<BITS, MOE_ROUTER_PREFETCH>(w, scales, biases, int(lane), D * BITS / 32, word, scale, bias);
}

template <int BITS, typename PW, typename PS, typename PB>
inline float moe_router_row_dot_prefetched(thread const uint32_t* word, thread const float* scale,
                                           thread const float* bias, PW w, PS scales, PB biases,
                                           const threadgroup float4* xs, int D, uint lane) {
  const int words = D * BITS / 32;
  const float acc = moe_router_staged_terms<BITS, MOE_ROUTER_PREFETCH>(0.0f, word, scale, bias, xs, int(lane), words);
  return simd_sum(moe_router_dot_words<BITS>(acc, w, scales, biases, xs, int(lane) + 32 * MOE_ROUTER_PREFETCH, words));
}

// The logit of router row `row` (row E: the shared-expert gate), as both router forms compute it.
template <int BITS, typename PW, typename PS, typename PB, typename PGW, typename PGS, typename PGB>
inline float moe_router_logit(int row, int E, PW w_router, PS scales_router, PB biases_router, PGW w_gate,
                              PGS scales_gate, PGB biases_gate, const threadgroup float4* xs, int D, uint lane) {
  if (row < E) {
    const long words = long(row) * (D * BITS / 32);
    return moe_router_row_dot<BITS>(w_router + words, scales_router + long(row) * (D / 64),
                                    biases_router + long(row) * (D / 64), xs, D, lane);
  }
  return moe_router_row_dot<BITS>(w_gate, scales_gate, biases_gate, xs, D, lane);
}

// moe_router_row_dot for TT tokens at once (rows x[0], x[D], ... x[(TT - 1) * D] of the call; `last` the
// index of the last valid one: later slots repeat it, computed and never written): each weight word, scale
// and bias is loaded once for the TT tokens. A token's arithmetic is moe_router_row_dot's, operation for
// operation (the same lane split, order, fmas and simd_sum), so its logits have the same bits whether it
// comes alone or with others. x is read from device memory (VALUES_PER_WORD values of a token per word, one
// vector load).
template <int BITS, int TT, typename T, typename PW, typename PS, typename PB>
inline void moe_router_rows_dot(PW w, PS scales, PB biases, const device T* x, int last, int D, uint lane,
                                thread float* acc) {
  constexpr int VALUES_PER_WORD = 32 / BITS;
  constexpr int XWORDS = VALUES_PER_WORD / MoeWords<T>::PER;  // 32-bit words of x per weight word
  const int words = D / VALUES_PER_WORD;
  for (int t = 0; t < TT; ++t) {
    acc[t] = 0.0f;
  }
  for (int w0 = int(lane); w0 < words; w0 += 32 * MOE_ROUTER_LOADS) {
    uint32_t word[MOE_ROUTER_LOADS];
    float scale[MOE_ROUTER_LOADS];
    float bias[MOE_ROUTER_LOADS];
    moe_router_fetch_words<BITS, MOE_ROUTER_LOADS>(w, scales, biases, w0, words, word, scale, bias);
    #pragma unroll
    for (int u = 0; u < MOE_ROUTER_LOADS; ++u) {
      const int wi = w0 + 32 * u;
      if (wi < words) {
        #pragma unroll
        for (int t = 0; t < TT; ++t) {
          uint xw[XWORDS];
          const int row = t < last ? t : last;
          moe_load_words<XWORDS>(reinterpret_cast<const device uint*>(x + long(row) * D + wi * VALUES_PER_WORD), xw);
          float xv[VALUES_PER_WORD];
          #pragma unroll
          for (int j = 0; j < VALUES_PER_WORD; ++j) {
            xv[j] = MoeWords<T>::get(xw[j / MoeWords<T>::PER], j % MoeWords<T>::PER);
          }
          acc[t] = moe_router_word_term<BITS>(acc[t], word[u], scale[u], bias[u], xv);
        }
      }
    }
  }
  for (int t = 0; t < TT; ++t) {
    acc[t] = simd_sum(acc[t]);
  }
}

// Steps 2-3 of the router for one token, by one simdgroup (no barriers), from its T-rounded logits in
// probs[0 .. E) (threadgroup memory): softmax and top-k. Lane l owns experts l, l + 32, ... (NPL =
// ceil(E / 32) of them, a template parameter so that its keys stay in registers): the softmax's max and
// sum are each lane's in order, then simd_max / simd_sum; top-k is k rounds of a simd_max over keys = the
// probability's fp32 bits with the expert id in the low 10 bits (1023 - e: ties go to the lower id).
// Probabilities are >= 0, so their bits order like their values, and as T-rounded values (bf16 or fp16)
// their low 13 fp32 mantissa bits are zero: a key holds its probability exactly. Returns pick `lane`'s
// key (lanes >= k: 0); picked_sum: the k picks' probabilities summed in pick order (every lane alike).
#define MOE_ROUTER_ID_BITS uint(MOE_ROUTER_MAX_E - 1)
template <typename T, int NPL>
inline uint moe_router_picks(const threadgroup float* probs, uint lane, int E, int top_k, thread float& picked_sum) {
  float top = -INFINITY;
  for (int i = 0; i < NPL; ++i) {
    const int e = int(lane) + 32 * i;
    if (e < E) {
      top = metal::max(top, probs[e]);
    }
  }
  top = simd_max(top);
  float total = 0.0f;
  for (int i = 0; i < NPL; ++i) {
    const int e = int(lane) + 32 * i;
    if (e < E) {
      total += metal::exp(probs[e] - top);
    }
  }
  total = simd_sum(total);
  uint keys[NPL];  // this lane's experts' keys; 0 once chosen (a real key is never 0: e <= 1022 or p > 0)
  for (int i = 0; i < NPL; ++i) {
    const int e = int(lane) + 32 * i;
    const float p = e < E ? float(static_cast<T>(metal::exp(probs[e] - top) / total)) : 0.0f;
    keys[i] = e < E ? (as_type<uint>(p) | (MOE_ROUTER_ID_BITS - uint(e))) : 0u;
  }
  picked_sum = 0.0f;
  uint mine = 0u;  // lane j: round j's key
  for (int j = 0; j < top_k; ++j) {
    uint best = 0u;
    for (int i = 0; i < NPL; ++i) {
      best = metal::max(best, keys[i]);
    }
    best = simd_max(best);
    for (int i = 0; i < NPL; ++i) {  // keys are distinct: only the owner's entry matches
      keys[i] = keys[i] == best ? 0u : keys[i];
    }
    mine = int(lane) == j ? best : mine;
    picked_sum += as_type<float>(best & ~MOE_ROUTER_ID_BITS);
  }
  return mine;
}

// Step 4 for one pick (assignment a): its expert id, its renormalised score (the picks' sum rounded to T
// first) and its one-row decode block (e, a, 1, decode_tile).
template <typename T, typename PI, typename PS, typename PB>
inline void moe_router_write_pick(uint key, float picked_sum, long a, int norm_topk, int decode_tile, PI inds,
                                  PS scores, PB blocks) {
  const int e = int(MOE_ROUTER_ID_BITS - (key & MOE_ROUTER_ID_BITS));
  const float p = as_type<float>(key & ~MOE_ROUTER_ID_BITS);
  const float denom = float(static_cast<T>(picked_sum));
  inds[a] = e;
  scores[a] = static_cast<T>(norm_topk != 0 ? p / denom : p);
  blocks[4 * a + 0] = e;
  blocks[4 * a + 1] = int(a);
  blocks[4 * a + 2] = 1;
  blocks[4 * a + 3] = decode_tile;
}

// The shared expert's sigmoid gate from its logit probs[E] (0 without has_gate), rounded as stock does.
template <typename T>
inline float moe_router_gate(const threadgroup float* probs, int E, int has_gate) {
  return has_gate != 0 ? float(static_cast<T>(1.0f / (1.0f + metal::exp(-probs[E])))) : 0.0f;
}

// The one-row decode block of the shared expert's chunk c at slot `slot` (expert id E + c).
template <typename PB>
inline void moe_router_write_shared_block(long slot, int E, int c, int decode_tile, PB blocks) {
  blocks[4 * slot + 0] = E + c;
  blocks[4 * slot + 1] = int(slot);
  blocks[4 * slot + 2] = 1;
  blocks[4 * slot + 3] = decode_tile;
}

// Steps 2-4 of the router for token n, by one simdgroup (the caller's simdgroup 0; no barriers), from
// its T-rounded logits in probs[0 .. E] (threadgroup memory; row E: the shared-expert gate's, when
// has_gate): softmax, top-k (moe_router_picks), renormalisation, the gate, the decode schedule; lane j
// writes pick j (k <= 32).
template <typename T, int NPL, typename PI, typename PS, typename PG, typename PB>
inline void moe_router_select(threadgroup float* probs, uint lane, long n, int num_tokens, int E, int top_k,
                              int norm_topk, int has_gate, int decode_tile, int shared_chunks, PI inds, PS scores,
                              PG gate, PB blocks) {
  float picked_sum;
  const uint mine = moe_router_picks<T, NPL>(probs, lane, E, top_k, picked_sum);
  if (int(lane) < top_k) {
    moe_router_write_pick<T>(mine, picked_sum, n * top_k + int(lane), norm_topk, decode_tile, inds, scores, blocks);
  }
  if (lane == 0) {
    gate[n] = moe_router_gate<T>(probs, E, has_gate);
  }
  for (int c = int(lane); c < shared_chunks; c += 32) {
    moe_router_write_shared_block(long(num_tokens) * (top_k + c) + n, E, c, decode_tile, blocks);
  }
}

// @kernel moe_router_softmax_topk_q
// grid (512, N, 1), threadgroup (512, 1, 1); template T (activation dtype), BITS (8 or 4), NPL
// (ceil(E / 32): the experts each lane of the selection owns).
// params: [D, E, top_k, norm_topk, has_gate, decode_tile, shared_chunks].
// x [N, D]; w_router [E, D * BITS / 32] uint32 (+ scales/biases [E, D / 64]); w_gate [1, ...] the
// shared-expert gate (same layout; unused when has_gate == 0).
// inds [N, k] int32 (largest probability first); scores [N, k] T; gate [N] float32 (sigmoid gate,
// 0 when has_gate == 0); blocks [N * k + N * m, 4] int32 (m = shared_chunks): the GEMMs' one-row
// decode schedule, assignment a = n * k + j -> (inds[a], a, 1, decode_tile), shared-expert chunk c
// of token n -> (E + c, N * k + c * N + n, 1, decode_tile).
threadgroup float probs[MOE_ROUTER_MAX_E + 1];
threadgroup float4 xs[MOE_ROUTER_MAX_D / 4];
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const long n = long(threadgroup_position_in_grid.y);
const int num_tokens = int(threadgroups_per_grid.y);
moe_router_stage_x(xs, x + n * D, D, thread_index_in_threadgroup, MOE_ROUTER_THREADS);
threadgroup_barrier(mem_flags::mem_threadgroup);

// 1. Logits: simdgroup sg takes rows sg, sg + 16, ...; row E is the shared-expert gate.
for (int row = int(sg); row < E + has_gate; row += MOE_ROUTER_THREADS / 32) {
  const float logit = moe_router_logit<BITS>(row, E, w_router, scales_router, biases_router, w_gate, scales_gate,
                                             biases_gate, xs, D, lane);
  if (lane == 0) {
    probs[row] = float(static_cast<T>(logit));
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

if (sg == 0) {  // the selection is one simdgroup's work (no barriers inside)
  moe_router_select<T, NPL>(probs, lane, n, num_tokens, E, top_k, norm_topk, has_gate, decode_tile, shared_chunks, inds,
                       scores, gate, blocks);
}

// @kernel moe_router_logits_q
// The router's logits alone, spread over the GPU (switch split_router): one simdgroup per expert row
// (row E is the shared-expert gate), MOE_ROUTER_LOGIT_SIMDGROUPS rows per threadgroup, so a token's
// 0.5 MB of 8-bit router weights is read by many threadgroups at once instead of one. A row's dot
// product is moe_router_row_dot, as in moe_router_softmax_topk_q: the same logits, bit for bit.
// grid (32 * MOE_ROUTER_LOGIT_SIMDGROUPS, N, ceil((E + has_gate) / MOE_ROUTER_LOGIT_SIMDGROUPS)),
// threadgroup (32 * MOE_ROUTER_LOGIT_SIMDGROUPS, 1, 1); template T, BITS. params: [D, E, has_gate].
// logits [N, E + 1] float32: each logit rounded to T (row E unwritten when has_gate == 0).
{
  threadgroup float4 xs[MOE_ROUTER_MAX_D / 4];
  const uint lane = thread_index_in_simdgroup;
  const int row = int(threadgroup_position_in_grid.z) * MOE_ROUTER_LOGIT_SIMDGROUPS + int(simdgroup_index_in_threadgroup);
  const long n = long(threadgroup_position_in_grid.y);
  moe_router_stage_x(xs, x + n * D, D, thread_index_in_threadgroup, 32 * MOE_ROUTER_LOGIT_SIMDGROUPS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (row < E + has_gate) {  // uniform over the simdgroup: every lane reaches the simd_sum
    const float logit = moe_router_logit<BITS>(row, E, w_router, scales_router, biases_router, w_gate, scales_gate,
                                               biases_gate, xs, D, lane);
    if (lane == 0) {
      logits[n * (E + 1) + row] = float(static_cast<T>(logit));
    }
  }
}

// @kernel moe_router_logits_tokens_q
// moe_router_logits_q for prompt-sized calls: TT tokens per threadgroup (template), so each expert row's words
// are read once per TT tokens instead of once per token (a prompt chunk's router read the 0.5 MB router once
// per token: a tenth of the chunk's GPU time on the H200, docs/moe.md). Same logits, bit for bit
// (moe_router_rows_dot). grid (32 * MOE_ROUTER_LOGIT_SIMDGROUPS, ceil(N / TT), ceil((E + has_gate) /
// MOE_ROUTER_LOGIT_SIMDGROUPS)), threadgroup (32 * MOE_ROUTER_LOGIT_SIMDGROUPS, 1, 1); template T, BITS, TT.
// params: [D, E, has_gate, N]. logits [N, E + 1] float32 as moe_router_logits_q's.
{
  const uint lane = thread_index_in_simdgroup;
  const int row = int(threadgroup_position_in_grid.z) * MOE_ROUTER_LOGIT_SIMDGROUPS + int(simdgroup_index_in_threadgroup);
  const int n0 = int(threadgroup_position_in_grid.y) * TT;
  const int last = min(TT, N - n0) - 1;  // the group's last valid token
  if (row < E + has_gate) {  // uniform over the simdgroup: every lane reaches the simd_sums
    float acc[TT];
    if (row < E) {
      const long words = long(row) * (D * BITS / 32);
      moe_router_rows_dot<BITS, TT>(w_router + words, scales_router + long(row) * (D / 64),
                                    biases_router + long(row) * (D / 64), x + long(n0) * D, last, D, lane, acc);
    } else {
      moe_router_rows_dot<BITS, TT>(w_gate, scales_gate, biases_gate, x + long(n0) * D, last, D, lane, acc);
    }
    for (int t = 0; t < TT; ++t) {  // constant trip count: acc stays in registers
      if (lane == 0 && t <= last) {
        logits[long(n0 + t) * (E + 1) + row] = float(static_cast<T>(acc[t]));
      }
    }
  }
}

// @kernel moe_router_topk_from_logits
// Steps 2-4 of moe_router_softmax_topk_q from moe_router_logits_q's logits (switch split_router): one
// simdgroup per token runs the same selection code, so the same bits.
// grid (32, N, 1), threadgroup (32, 1, 1); template T, NPL (ceil(E / 32)). params: [E, top_k, norm_topk, has_gate,
// decode_tile, shared_chunks]. logits [N, E + 1] float32; outputs as moe_router_softmax_topk_q's.
{
  threadgroup float probs[MOE_ROUTER_MAX_E + 1];
  const uint lane = thread_index_in_simdgroup;
  const long n = long(threadgroup_position_in_grid.y);
  for (int row = int(lane); row < E + has_gate; row += 32) {
    probs[row] = logits[n * (E + 1) + row];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  moe_router_select<T, NPL>(probs, lane, n, int(threadgroups_per_grid.y), E, top_k, norm_topk, has_gate, decode_tile,
                       shared_chunks, inds, scores, gate, blocks);
}
