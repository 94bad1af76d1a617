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
// grid (MOE_NORM_THREADS, N, 1), threadgroup (MOE_NORM_THREADS, 1, 1); template T (activation dtype).
// params: [D]. x, y [N, D] T; weight [D] T; eps [1] float32. h, n [N, D] T.
{
  threadgroup float partial[MOE_NORM_THREADS / 32];
  const uint tid = thread_index_in_threadgroup;
  const long row = long(threadgroup_position_in_grid.y) * D;
  float squares = 0.0f;
  for (int i = int(tid); i < D; i += MOE_NORM_THREADS) {
    const T hv = static_cast<T>(float(x[row + i]) + float(y[row + i]));
    h[row + i] = hv;
    squares = metal::fma(float(hv), float(hv), squares);
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
  for (int i = int(tid); i < D; i += MOE_NORM_THREADS) {
    const T hv = static_cast<T>(float(x[row + i]) + float(y[row + i]));
    const T normalised = static_cast<T>(float(hv) * inv_rms);
    n[row + i] = static_cast<T>(float(weight[i]) * float(normalised));
  }
}
