// The decoder layer's residual add after its mixer and the post-attention RMSNorm that feeds the MoE
// block, in one launch (switch fused_add_norm; lily_mlx/ops/moe/kernels.py dispatches it):
//   h = T(x + y)                                  (MLX's add of two T arrays: fp32 sum, rounded to T)
//   n = T(w * T(h * rsqrt(mean(h^2) + eps)))      (stock's RMSNorm rounding points, fp32 inside)
// The mean's sum of squares is this kernel's own (each thread's elements in order, then simd_sum,
// then the simdgroups' sums in order), not MLX's: n may differ from MLX's rms_norm in the last bit
// where the sum rounds differently. h has the bits of MLX's add.
//
// Batch invariance: one threadgroup per row; a row's arithmetic never depends on the other rows.

// @header
#define MOE_NORM_THREADS 256  // threads per row (the host's NORM_THREADS)

// @kernel moe_residual_rms_norm
// grid (MOE_NORM_THREADS, N, 1), threadgroup (MOE_NORM_THREADS, 1, 1); template T (activation dtype),
// PER_THREAD = ceil(D / MOE_NORM_THREADS) (the host's norm_per_thread).
// params: [D]. x, y [N, D] T; weight [D] T; eps [1] float32. h, n [N, D] T.
// Thread t owns elements t, t + MOE_NORM_THREADS, ... (adjacent lanes, adjacent elements). Every load is
// issued before the first store: h and n alias no input, but the compiler cannot assume that, and a store
// between two loads makes the second wait for the first (Nsight Compute: 12 us a launch when
// the loads and stores were interleaved, for 8 KB of traffic).
{
  threadgroup float partial[MOE_NORM_THREADS / 32];
  const uint tid = thread_index_in_threadgroup;
  const long row = long(threadgroup_position_in_grid.y) * D;
  float xs[PER_THREAD];
  float ys[PER_THREAD];
  float ws[PER_THREAD];
  for (int j = 0; j < PER_THREAD; ++j) {
    const int i = int(tid) + j * MOE_NORM_THREADS;
    xs[j] = i < D ? float(x[row + i]) : 0.0f;
    ys[j] = i < D ? float(y[row + i]) : 0.0f;
    ws[j] = i < D ? float(weight[i]) : 0.0f;
  }
  float squares = 0.0f;
  for (int j = 0; j < PER_THREAD; ++j) {
    xs[j] = float(static_cast<T>(xs[j] + ys[j]));  // h, rounded to T as MLX's add rounds it
    squares = metal::fma(xs[j], xs[j], squares);     // elements past D hold 0 and add nothing
  }
  squares = simd_sum(squares);
  if (thread_index_in_simdgroup == 0) {
    partial[simdgroup_index_in_threadgroup] = squares;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (int s = 0; s < MOE_NORM_THREADS / 32; ++s) {
    total += partial[s];
  }
  const float inv_rms = metal::precise::rsqrt(total / float(D) + eps[0]);
  for (int j = 0; j < PER_THREAD; ++j) {
    const int i = int(tid) + j * MOE_NORM_THREADS;
    if (i < D) {
      const T normalised = static_cast<T>(xs[j] * inv_rms);
      h[row + i] = static_cast<T>(xs[j]);
      n[row + i] = static_cast<T>(ws[j] * float(normalised));
    }
  }
}
