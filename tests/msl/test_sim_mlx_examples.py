"""MLX's documented custom-kernel examples (docs/src/dev/custom_metal_kernels.rst) run through the
simulator agree with their MLX-ops equivalents."""

import warnings

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx.msl import sim

EXP_STRIDED = """
    uint elem = thread_position_in_grid.x;
    // Utils from `mlx/backend/metal/kernels/utils.h` are automatically included
    uint loc = elem_to_loc(elem, inp_shape, inp_strides, inp_ndim);
    T tmp = inp[loc];
    // Output arrays are always row contiguous
    out[elem] = metal::exp(tmp);
"""

GRID_SAMPLE = """
    uint elem = thread_position_in_grid.x;
    int H = x_shape[1];
    int W = x_shape[2];
    int C = x_shape[3];
    int gH = grid_shape[1];
    int gW = grid_shape[2];

    int w_stride = C;
    int h_stride = W * w_stride;
    int b_stride = H * h_stride;

    uint grid_idx = elem / C * 2;
    float ix = ((grid[grid_idx] + 1) * W - 1) / 2;
    float iy = ((grid[grid_idx + 1] + 1) * H - 1) / 2;

    int ix_nw = floor(ix);
    int iy_nw = floor(iy);

    int ix_ne = ix_nw + 1;
    int iy_ne = iy_nw;

    int ix_sw = ix_nw;
    int iy_sw = iy_nw + 1;

    int ix_se = ix_nw + 1;
    int iy_se = iy_nw + 1;

    T nw = (ix_se - ix)    * (iy_se - iy);
    T ne = (ix    - ix_sw) * (iy_sw - iy);
    T sw = (ix_ne - ix)    * (iy    - iy_ne);
    T se = (ix    - ix_nw) * (iy    - iy_nw);

    int batch_idx = elem / C / gH / gW * b_stride;
    int channel_idx = elem % C;
    int base_idx = batch_idx + channel_idx;

    T I_nw = x[base_idx + iy_nw * h_stride + ix_nw * w_stride];
    T I_ne = x[base_idx + iy_ne * h_stride + ix_ne * w_stride];
    T I_sw = x[base_idx + iy_sw * h_stride + ix_sw * w_stride];
    T I_se = x[base_idx + iy_se * h_stride + ix_se * w_stride];

    I_nw = iy_nw >= 0 && iy_nw <= H - 1 && ix_nw >= 0 && ix_nw <= W - 1 ? I_nw : 0;
    I_ne = iy_ne >= 0 && iy_ne <= H - 1 && ix_ne >= 0 && ix_ne <= W - 1 ? I_ne : 0;
    I_sw = iy_sw >= 0 && iy_sw <= H - 1 && ix_sw >= 0 && ix_sw <= W - 1 ? I_sw : 0;
    I_se = iy_se >= 0 && iy_se <= H - 1 && ix_se >= 0 && ix_se <= W - 1 ? I_se : 0;

    out[elem] = nw * I_nw + ne * I_ne + sw * I_sw + se * I_se;
"""

GRID_SAMPLE_GRAD = """
    uint elem = thread_position_in_grid.x;
    int H = x_shape[1];
    int W = x_shape[2];
    int C = x_shape[3];
    // Pad C to the nearest larger simdgroup size multiple
    int C_padded = ceildiv(C, threads_per_simdgroup) * threads_per_simdgroup;

    int gH = grid_shape[1];
    int gW = grid_shape[2];

    int w_stride = C;
    int h_stride = W * w_stride;
    int b_stride = H * h_stride;

    uint grid_idx = elem / C_padded * 2;
    float ix = ((grid[grid_idx] + 1) * W - 1) / 2;
    float iy = ((grid[grid_idx + 1] + 1) * H - 1) / 2;

    int ix_nw = floor(ix);
    int iy_nw = floor(iy);

    int ix_ne = ix_nw + 1;
    int iy_ne = iy_nw;

    int ix_sw = ix_nw;
    int iy_sw = iy_nw + 1;

    int ix_se = ix_nw + 1;
    int iy_se = iy_nw + 1;

    T nw = (ix_se - ix)    * (iy_se - iy);
    T ne = (ix    - ix_sw) * (iy_sw - iy);
    T sw = (ix_ne - ix)    * (iy    - iy_ne);
    T se = (ix    - ix_nw) * (iy    - iy_nw);

    int batch_idx = elem / C_padded / gH / gW * b_stride;
    int channel_idx = elem % C_padded;
    int base_idx = batch_idx + channel_idx;

    T gix = T(0);
    T giy = T(0);
    if (channel_idx < C) {
        int cot_index = elem / C_padded * C + channel_idx;
        T cot = cotangent[cot_index];
        if (iy_nw >= 0 && iy_nw <= H - 1 && ix_nw >= 0 && ix_nw <= W - 1) {
            int offset = base_idx + iy_nw * h_stride + ix_nw * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], nw * cot, memory_order_relaxed);

            T I_nw = x[offset];
            gix -= I_nw * (iy_se - iy) * cot;
            giy -= I_nw * (ix_se - ix) * cot;
        }
        if (iy_ne >= 0 && iy_ne <= H - 1 && ix_ne >= 0 && ix_ne <= W - 1) {
            int offset = base_idx + iy_ne * h_stride + ix_ne * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], ne * cot, memory_order_relaxed);

            T I_ne = x[offset];
            gix += I_ne * (iy_sw - iy) * cot;
            giy -= I_ne * (ix - ix_sw) * cot;
        }
        if (iy_sw >= 0 && iy_sw <= H - 1 && ix_sw >= 0 && ix_sw <= W - 1) {
            int offset = base_idx + iy_sw * h_stride + ix_sw * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], sw * cot, memory_order_relaxed);

            T I_sw = x[offset];
            gix -= I_sw * (iy - iy_ne) * cot;
            giy += I_sw * (ix_ne - ix) * cot;
        }
        if (iy_se >= 0 && iy_se <= H - 1 && ix_se >= 0 && ix_se <= W - 1) {
            int offset = base_idx + iy_se * h_stride + ix_se * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], se * cot, memory_order_relaxed);

            T I_se = x[offset];
            gix += I_se * (iy - iy_nw) * cot;
            giy += I_se * (ix - ix_nw) * cot;
        }
    }

    T gix_mult = W / 2;
    T giy_mult = H / 2;

    // Reduce across each simdgroup first.
    // This is much faster than relying purely on atomics.
    gix = simd_sum(gix);
    giy = simd_sum(giy);

    if (thread_index_in_simdgroup == 0) {
        atomic_fetch_add_explicit(&grid_grad[grid_idx], gix * gix_mult, memory_order_relaxed);
        atomic_fetch_add_explicit(&grid_grad[grid_idx + 1], giy * giy_mult, memory_order_relaxed);
    }
"""


def grid_sample_ref(x, grid):
    # The documentation's MLX-ops reference.
    N, H_in, W_in, _ = x.shape
    ix = ((grid[..., 0] + 1) * W_in - 1) / 2
    iy = ((grid[..., 1] + 1) * H_in - 1) / 2
    ix_nw = mx.stop_gradient(mx.floor(ix)).astype(mx.int32)
    iy_nw = mx.stop_gradient(mx.floor(iy)).astype(mx.int32)
    ix_ne, iy_ne = ix_nw + 1, iy_nw
    ix_sw, iy_sw = ix_nw, iy_nw + 1
    ix_se, iy_se = ix_nw + 1, iy_nw + 1
    nw = (ix_se - ix) * (iy_se - iy)
    ne = (ix - ix_sw) * (iy_sw - iy)
    sw = (ix_ne - ix) * (iy - iy_ne)
    se = (ix - ix_nw) * (iy - iy_nw)
    b = mx.arange(N)[:, None, None]

    def tap(iy_, ix_):
        m = (iy_ >= 0) & (iy_ <= H_in - 1) & (ix_ >= 0) & (ix_ <= W_in - 1)
        return x[b, mx.clip(iy_, 0, H_in - 1), mx.clip(ix_, 0, W_in - 1), :] * m[..., None]

    return (nw[..., None] * tap(iy_nw, ix_nw) + ne[..., None] * tap(iy_ne, ix_ne)
            + sw[..., None] * tap(iy_sw, ix_sw) + se[..., None] * tap(iy_se, ix_se))


def _grid_sample_fns(**kernel_opts):
    fwd = sim.metal_kernel(name="grid_sample", input_names=["x", "grid"], output_names=["out"], source=GRID_SAMPLE,
                           **kernel_opts)
    bwd = sim.metal_kernel(name="grid_sample_grad", input_names=["x", "grid", "cotangent"],
                           output_names=["x_grad", "grid_grad"], source=GRID_SAMPLE_GRAD, atomic_outputs=True)

    @mx.custom_function
    def grid_sample(x, grid):
        B, _, _, C = x.shape
        _, gN, gM, D = grid.shape
        out_shape = (B, gN, gM, C)
        return fwd(inputs=[x, grid], template=[("T", x.dtype)], output_shapes=[out_shape], output_dtypes=[x.dtype],
                   grid=(int(np.prod(out_shape)), 1, 1), threadgroup=(256, 1, 1))[0]

    @grid_sample.vjp
    def grid_sample_vjp(primals, cotangent, _):
        x, grid = primals
        B, _, _, C = x.shape
        _, gN, gM, D = grid.shape
        C_padded = (C + 31) // 32 * 32
        outs = bwd(inputs=[x, grid, cotangent], template=[("T", x.dtype)], output_shapes=[x.shape, grid.shape],
                   output_dtypes=[x.dtype, x.dtype], grid=(B * gN * gM * C_padded, 1, 1), threadgroup=(256, 1, 1),
                   init_value=0)
        return outs[0], outs[1]

    return grid_sample, fwd


def test_exp_strided_example_with_ensure_row_contiguous_false():
    k = sim.metal_kernel(name="myexp_strided", input_names=["inp"], output_names=["out"], source=EXP_STRIDED,
                         ensure_row_contiguous=False)
    a = mx.random.normal(shape=(4, 16)).astype(mx.float16)[::2]
    b = k(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
          output_shapes=[a.shape], output_dtypes=[a.dtype])[0]
    assert mx.allclose(b, mx.exp(a)).item()


def _grid_inputs(seed):
    mx.random.seed(seed)
    x = mx.random.normal(shape=(2, 6, 7, 5))
    grid = mx.random.uniform(low=-1, high=1, shape=(2, 4, 3, 2))
    return x, grid


def test_grid_sample_forward_reads_out_of_bounds_at_the_border():
    # The documented forward kernel loads all four taps before masking them: at the image border of
    # the first/last batch those loads leave the buffer. The simulator reports it...
    x, grid = _grid_inputs(0)
    grid = mx.concatenate([mx.full((2, 1, 3, 2), -1.0), grid[:, 1:]], axis=1)  # samples on the border
    grid_sample, _ = _grid_sample_fns()
    with pytest.raises(sim.OutOfBoundsError, match=r"read of buffer 0 \(`x`.*\n.*T I_nw = x\["):
        mx.eval(grid_sample(x, grid))


@pytest.mark.parametrize("seed", [0, 1])
def test_grid_sample_forward_and_atomic_vjp_match_ops(seed):
    # ...and with allow_oob_reads (loads outside the buffer give 0; the kernel masks them anyway)
    # it matches the MLX-ops reference, forward and through its atomic-output VJP.
    x, grid = _grid_inputs(seed)
    grid_sample, fwd = _grid_sample_fns(allow_oob_reads=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = grid_sample(x, grid)
        mx.eval(out)
    assert mx.allclose(out, grid_sample_ref(x, grid), atol=1e-5).item()

    cot = mx.random.normal(shape=out.shape)
    loss = lambda f: (lambda x, g: (f(x, g) * cot).sum())
    gx, gg = mx.grad(loss(grid_sample), argnums=(0, 1))(x, grid)
    rx, rg = mx.grad(loss(grid_sample_ref), argnums=(0, 1))(x, grid)
    assert mx.allclose(gx, rx, atol=1e-4).item()
    # The documented VJP scales the grid gradient by W / 2 and H / 2 in integer arithmetic
    # (`T gix_mult = W / 2;`), so it equals the true gradient only for even W, H; compare with that.
    W, H = x.shape[2], x.shape[1]
    scale = mx.array([(W // 2) / (W / 2), (H // 2) / (H / 2)])
    assert mx.allclose(gg, rg * scale, atol=1e-4).item()

