"""Kernels covering every rule of MLX's signature generator (shared by the test and the subprocess
that records MLX's own generated text)."""

import mlx.core as mx

BODY_ALL_ATTRS = """
    // every attribute, mentioned once each (MLX only searches the text):
    // dispatch_quadgroups_per_threadgroup dispatch_simdgroups_per_threadgroup
    // dispatch_threads_per_threadgroup grid_origin grid_size quadgroup_index_in_threadgroup
    // quadgroups_per_threadgroup simdgroup_index_in_threadgroup simdgroups_per_threadgroup
    // thread_execution_width thread_index_in_quadgroup thread_index_in_simdgroup
    // thread_index_in_threadgroup thread_position_in_grid thread_position_in_threadgroup
    // threadgroup_position_in_grid threadgroups_per_grid threads_per_grid threads_per_simdgroup
    // threads_per_threadgroup
    out[0] = a[0];
"""


def cases():
    """[(kwargs for metal_kernel, kwargs for the call)]."""
    big = mx.zeros((4, 8), dtype=mx.float32)
    small = mx.zeros((3,), dtype=mx.float16)
    seven = mx.zeros((7,), dtype=mx.int32)
    eight = mx.zeros((8,), dtype=mx.int32)
    scalar = mx.array(2, dtype=mx.uint32)
    flags = mx.zeros((2, 5), dtype=mx.bool_)
    bf = mx.zeros((16,), dtype=mx.bfloat16)
    out = dict(output_shapes=[(4,)], output_dtypes=[mx.float32])
    grid = dict(grid=(4, 1, 1), threadgroup=(4, 1, 1))
    return [
        # template of every kind, Python int and float inputs, header
        (dict(name="tmpl", input_names=["a", "n", "f"], output_names=["out"], header="#define K 3\n",
              source="uint i = thread_position_in_grid.x; out[i] = T(a[i]) * f + n + N + (B ? 1 : 0);"),
         dict(inputs=[big, 5, 0.5], template=[("T", mx.float32), ("N", 4), ("B", True), ("U", mx.bfloat16)],
              **out, **grid)),
        # constant (< 8 elements) vs device (>= 8), 0-d array, bool and bfloat16 inputs, no template
        (dict(name="spaces", input_names=["s7", "s8", "sc", "fl", "b"], output_names=["out"],
              source="uint i = thread_position_in_grid.x; out[i] = s7[i] + s8[i] + sc + fl[i] + b[i];"),
         dict(inputs=[seven, eight, scalar, flags, bf], **out, **grid)),
        # _shape/_strides/_ndim only for the inputs whose names are followed by them in the body
        (dict(name="shapes", input_names=["a", "s", "c"], output_names=["out"],
              source="uint i = thread_index_in_threadgroup; out[i] = a_shape[0] + a_strides[1] + a_ndim + s_ndim + c_strides[0];"),
         dict(inputs=[big, scalar, small], **out, **grid)),
        # all attributes, by substring (comments count); several outputs
        (dict(name="attrs", input_names=["a"], output_names=["out", "out2"], source=BODY_ALL_ATTRS),
         dict(inputs=[big], output_shapes=[(4,), (2, 2)], output_dtypes=[mx.float32, mx.float16], **grid)),
        # atomic outputs with a template
        (dict(name="atom", input_names=["a"], output_names=["acc", "cnt"], atomic_outputs=True,
              source="atomic_fetch_add_explicit(&acc[0], a[thread_position_in_grid.x], memory_order_relaxed);"),
         dict(inputs=[big], template=[("T", mx.float16)], output_shapes=[(1,), (1,)],
              output_dtypes=[mx.float32, mx.int32], init_value=0, **grid)),
        # no attribute at all, one output (MLX's separator rule)
        (dict(name="noattr", input_names=["a"], output_names=["out"], source="out[0] = a[0];"),
         dict(inputs=[big], **out, **grid)),
        # no attribute, shape buffer and two outputs: MLX's separator quirk, reproduced verbatim
        (dict(name="quirk", input_names=["a"], output_names=["o1", "o2"], source="o1[0] = a_shape[0];"),
         dict(inputs=[big], output_shapes=[(1,), (1,)], output_dtypes=[mx.int32, mx.int32], **grid)),
    ]


def record_mlx_sources():
    """Print MLX's generated text for every case (run in a subprocess: C++ writes it to fd 1)."""
    import os
    import tempfile

    for make_kw, call_kw in cases():
        k = mx.fast.metal_kernel(**make_kw)
        inputs = call_kw.pop("inputs")
        arrays = [x for x in inputs if isinstance(x, mx.array)]

        def fn(*arrs, _k=k, _inputs=inputs, _call=call_kw):
            it = iter(arrs)
            ins = [next(it) if isinstance(x, mx.array) else x for x in _inputs]
            return _k(inputs=ins, verbose=True, **_call)

        with tempfile.TemporaryDirectory() as d:
            mx.export_function(os.path.join(d, "k.mlxfn"), fn, *arrays)


if __name__ == "__main__":
    record_mlx_sources()
