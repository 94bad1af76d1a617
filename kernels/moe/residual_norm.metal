// The decoder layer's residual add after its mixer and the post-attention RMSNorm that feeds the MoE
// block, in one launch (switch fused_add_norm; lily_mlx/ops/moe/kernels.py dispatches it):
//   h = T(x + y)                                  (MLX's add of two T arrays: fp32 sum, rounded to T)
//   n = T(w * T(h * rsqrt(mean(h^2) + eps)))      (stock's RMSNorm rounding points, fp32 inside)
// The mean's sum of squares is this kernel's own (each thread's elements in order, then simd_sum,
// then the simdgroups' sums in order), not MLX's: n may differ from MLX's rms_norm in the last bit
// where the sum rounds differently. h has the bits of MLX's add.
//
// Batch invariance: one threadgroup per row; a row's arithmetic never depends on the other rows.

// With switch fused_norm_router, moe_residual_norm_router_logits_q also computes the router's logits of n
// (moe_router_logits_q's work): the same h, n and logits, bit for bit, one launch fewer per layer.
//
// @header
// @include moe/router.metal
#define MOE_NORM_THREADS 256  // threads per row (the host's NORM_THREADS)
#define MOE_COMBINE_NORM_LOADS 8  // routed rows whose loads moe_combine_residual_norm issues together

// n of a row whose h this threadgroup holds in registers (hs, ws: thread t's elements t, t + MOE_NORM_THREADS,
// ... of h and of the norm's weight, as floats of their T values, 0 past D): the sum of squares in this file's
// order (each thread's elements in order, simd_sum, the simdgroups' sums in order), stock's rounding points.
template <typename T, int PER_THREAD>
inline void moe_rms_norm_held_row(const thread float* hs, const thread float* ws, int D, float eps, uint sg,
                                  uint lane, threadgroup float* partial, thread float* ns) {
  float squares = 0.0f;
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    squares = metal::fma(hs[j], hs[j], squares);  // elements past D hold 0 and add nothing
  }
  squares = simd_sum(squares);
  if (lane == 0) {
    partial[sg] = squares;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (int s = 0; s < MOE_NORM_THREADS / 32; ++s) {
    total += partial[s];
  }
  const float inv_rms = metal::precise::rsqrt(total / float(D) + eps);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const float normalised = float(static_cast<T>(hs[j] * inv_rms));
    ns[j] = float(static_cast<T>(ws[j] * normalised));
  }
}

// h and n of one row, by the threadgroup's MOE_NORM_THREADS threads: thread t gets elements t,
// t + MOE_NORM_THREADS, ... (PER_THREAD of them) of h (hs) and n (ns), each as the float of its T value.
// Every load is issued before any arithmetic, and the caller stores after: the stores of one row never
// wait for its loads (Nsight Compute: 12 us a launch when loads and stores were interleaved, for 8 KB
// of traffic). partial: MOE_NORM_THREADS / 32 floats of threadgroup memory (one barrier inside).
template <typename T, int PER_THREAD, typename PX, typename PY, typename PW>
inline void moe_residual_norm_row(PX x, PY y, PW weight, int D, float eps, uint tid, uint sg, uint lane,
                                  threadgroup float* partial, thread float* hs, thread float* ns) {
  float ys[PER_THREAD];
  float ws[PER_THREAD];
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int i = int(tid) + j * MOE_NORM_THREADS;
    hs[j] = i < D ? float(x[i]) : 0.0f;
    ys[j] = i < D ? float(y[i]) : 0.0f;
    ws[j] = i < D ? float(weight[i]) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    hs[j] = float(static_cast<T>(hs[j] + ys[j]));  // h, rounded to T as MLX's add rounds it
  }
  moe_rms_norm_held_row<T, PER_THREAD>(hs, ws, D, eps, sg, lane, partial, ns);
}

// @kernel moe_residual_rms_norm
// grid (MOE_NORM_THREADS, N, 1), threadgroup (MOE_NORM_THREADS, 1, 1); template T (activation dtype),
// PER_THREAD = ceil(D / MOE_NORM_THREADS) (the host's norm_per_thread).
// params: [D]. x, y [N, D] T; weight [D] T; eps [1] float32. h, n [N, D] T.
// Thread t owns elements t, t + MOE_NORM_THREADS, ... (adjacent lanes, adjacent elements).
{
  threadgroup float partial[MOE_NORM_THREADS / 32];
  const uint tid = thread_index_in_threadgroup;
  const long row = long(threadgroup_position_in_grid.y) * D;
  float hs[PER_THREAD];
  float ns[PER_THREAD];
  moe_residual_norm_row<T, PER_THREAD>(x + row, y + row, weight, D, eps[0], tid, simdgroup_index_in_threadgroup,
                                       thread_index_in_simdgroup, partial, hs, ns);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int i = int(tid) + j * MOE_NORM_THREADS;
    if (i < D) {
      h[row + i] = static_cast<T>(hs[j]);
      n[row + i] = static_cast<T>(ns[j]);
    }
  }
}

// @kernel moe_residual_norm_router_logits_q
// moe_residual_rms_norm and moe_router_logits_q in one launch (switch fused_norm_router): each of a
// token's threadgroups computes the token's h and n (moe_residual_norm_row: the same bits in each), keeps n
// in threadgroup memory as the router's staged row and computes MOE_ROUTER_LOGIT_SIMDGROUPS logits from it
// (moe_router_logit, as moe_router_logits_q); the token's first threadgroup also writes h and n. The row
// is re-read by every threadgroup of its token (~33 x 12 KB at Qwen3.6's shapes, from L2): cheaper than
// a launch.
// grid (MOE_NORM_THREADS, N, ceil((E + has_gate) / MOE_ROUTER_LOGIT_SIMDGROUPS)), threadgroup
// (MOE_NORM_THREADS, 1, 1); template T, BITS, PER_THREAD. params: [D, E, has_gate]. x, y [N, D] T;
// weight [D] T; eps [1] float32; the router's and shared-expert gate's weights as moe_router_logits_q's.
// h, n [N, D] T; logits [N, E + 1] float32 (each rounded to T; row E unwritten when has_gate == 0).
{
  static_assert(MOE_NORM_THREADS == 32 * MOE_ROUTER_LOGIT_SIMDGROUPS, "one simdgroup per logit row");
  threadgroup float partial[MOE_NORM_THREADS / 32];
  threadgroup float4 xs[MOE_ROUTER_MAX_D / 4];
  const uint tid = thread_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const long n_row = long(threadgroup_position_in_grid.y);
  const long row = n_row * D;
  // The simdgroup's logit row's first words, loaded before the norm (they do not depend on it): their
  // latency overlaps the residual loads' instead of following the norm's barrier.
  const int logit_row = int(threadgroup_position_in_grid.z) * MOE_ROUTER_LOGIT_SIMDGROUPS +
                        int(simdgroup_index_in_threadgroup);
  const long row_words = long(logit_row) * (D * BITS / 32);  // the router row's words and groups (row < E)
  const long row_groups = long(logit_row) * (D / 64);
  uint32_t word[MOE_ROUTER_PREFETCH];
  float wscale[MOE_ROUTER_PREFETCH];
  float wbias[MOE_ROUTER_PREFETCH];
  if (logit_row < E) {
    moe_router_prefetch_words<BITS>(w_router + row_words, scales_router + row_groups, biases_router + row_groups, D,
                                    lane, word, wscale, wbias);
  } else if (logit_row < E + has_gate) {
    moe_router_prefetch_words<BITS>(w_gate, scales_gate, biases_gate, D, lane, word, wscale, wbias);
  }
  float hs[PER_THREAD];
  float ns[PER_THREAD];
  moe_residual_norm_row<T, PER_THREAD>(x + row, y + row, weight, D, eps[0], tid, simdgroup_index_in_threadgroup,
                                       lane, partial, hs, ns);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int i = int(tid) + j * MOE_NORM_THREADS;
    if (i < D) {
      xs[i / 4][i % 4] = ns[j];  // the router's staged row: the float of n's T value, as its staging reads it
    }
  }
  if (threadgroup_position_in_grid.z == 0) {
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int i = int(tid) + j * MOE_NORM_THREADS;
      if (i < D) {
        h[row + i] = static_cast<T>(hs[j]);
        n[row + i] = static_cast<T>(ns[j]);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (logit_row < E + has_gate) {  // uniform over the simdgroup: every lane reaches the simd_sum
    const float logit = logit_row < E
        ? moe_router_row_dot_prefetched<BITS>(word, wscale, wbias, w_router + row_words, scales_router + row_groups,
                                              biases_router + row_groups, xs, D, lane)
        : moe_router_row_dot_prefetched<BITS>(word, wscale, wbias, w_gate, scales_gate, biases_gate, xs, D, lane);
    if (lane == 0) {
      logits[n_row * (E + 1) + logit_row] = float(static_cast<T>(logit));
    }
  }
}

// @kernel moe_combine_residual_norm
// moe_combine_weighted_rows with its residual add and the next decoder layer's input RMSNorm of the result in
// one launch (switch fused_next_norm; decode calls): out has the combine's bits (each element's k weighted rows
// added in j order in fp32, then the gated shared chunks, rounded once, then T(residual + that)); n = the next
// layer's norm of out with moe_residual_norm_row's arithmetic (this file's sum order, stock's rounding points).
// One threadgroup per token (the norm needs the whole row); thread t owns elements t, t + MOE_NORM_THREADS, ...
// grid (MOE_NORM_THREADS, N, 1), threadgroup (MOE_NORM_THREADS, 1, 1); template T, PER_THREAD.
// params: [k, D, A, shared_chunks]. y [A + m N, D] T the down GEMV's rows in slot order; slot_of_row [A] int32;
// scores [N, k]; gate [N] fp32 (read when m > 0); residual [N, D] T; weight [D] T; eps [1] fp32. out, n [N, D] T.
{
  threadgroup float partial[MOE_NORM_THREADS / 32];
  const uint tid = thread_index_in_threadgroup;
  const long tok = long(threadgroup_position_in_grid.y);
  const long num_tokens = long(threads_per_grid.y);
  float acc[PER_THREAD];
  float rs[PER_THREAD];
  float ws[PER_THREAD];
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int i = int(tid) + j * MOE_NORM_THREADS;
    acc[j] = 0.0f;
    rs[j] = i < D ? float(residual[tok * D + i]) : 0.0f;
    ws[j] = i < D ? float(weight[i]) : 0.0f;
  }
  // The k rows MOE_COMBINE_NORM_LOADS at a time: their weights and slots, then all their values, then the adds in
  // j order (one memory round trip per group of rows, not per row: the kernel sits on the decode step's chain).
  for (int j0 = 0; j0 < k; j0 += MOE_COMBINE_NORM_LOADS) {
    float w[MOE_COMBINE_NORM_LOADS];
    long src[MOE_COMBINE_NORM_LOADS];
#pragma unroll
    for (int u = 0; u < MOE_COMBINE_NORM_LOADS; ++u) {
      w[u] = j0 + u < k ? float(scores[tok * k + j0 + u]) : 0.0f;
      src[u] = j0 + u < k ? long(slot_of_row[tok * k + j0 + u]) * D : 0;
    }
    float v[MOE_COMBINE_NORM_LOADS][PER_THREAD];
#pragma unroll
    for (int u = 0; u < MOE_COMBINE_NORM_LOADS; ++u) {
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j) {
        const int i = int(tid) + j * MOE_NORM_THREADS;
        v[u][j] = (j0 + u < k && i < D) ? float(y[src[u] + i]) : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < MOE_COMBINE_NORM_LOADS; ++u) {
      if (j0 + u < k) {
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j) {
          acc[j] += w[u] * v[u][j];
        }
      }
    }
  }
  for (int chunk = 0; chunk < shared_chunks; ++chunk) {
    const float g = gate[tok];
    const long src = (long(A) + chunk * num_tokens + tok) * D;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int i = int(tid) + j * MOE_NORM_THREADS;
      acc[j] += g * (i < D ? float(y[src + i]) : 0.0f);
    }
  }
  float hs[PER_THREAD];
  float ns[PER_THREAD];
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int i = int(tid) + j * MOE_NORM_THREADS;
    // the combine's rounding (T of the sum), then MLX's add of two T arrays; 0 past D (adds nothing to the norm)
    hs[j] = i < D ? float(static_cast<T>(rs[j] + float(static_cast<T>(acc[j])))) : 0.0f;
  }
  moe_rms_norm_held_row<T, PER_THREAD>(hs, ws, D, eps[0], simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
                                       partial, ns);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int i = int(tid) + j * MOE_NORM_THREADS;
    if (i < D) {
      out[tok * D + i] = static_cast<T>(hs[j]);
      n[tok * D + i] = static_cast<T>(ns[j]);
    }
  }
}
