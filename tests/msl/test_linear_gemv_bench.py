"""``bench.linear_gemv --from-ncu``: the runs of consecutive launches in an ``ncu --csv`` log (the first
lines of the H200 run of 2026-12-01, docs/results/2026-12-01-h200-decode-checks/)."""

from bench import linear_gemv

NCU_LOG = """==PROF== Connected to process 717 (python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","717","python3.12","127.0.0.1","void qmv_kernel<8, 16, 64, 1, 0, cutlass::bfloat16_t, cutlass::integer_subbyte<4, 0>, cutlass::bfloat16_t>(const T6 *, const T7 *, const T8 *, const T6 *, const float *, T6 *, int, int, bool)","1","14","(32, 8, 1)","(1544, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","1,706,240"
"1","717","python3.12","127.0.0.1","custom_kernel_linear_gemv_q4_25f2ffa3cacdc8aa(const __nv_bfloat16 *, const unsigned int *, const __nv_bfloat16 *, const __nv_bfloat16 *, const int *, const int *, __nv_bfloat16 *)","1","14","(64, 1, 1)","(1544, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","1,967,456"
"2","717","python3.12","127.0.0.1","void qmv_kernel<8, 16, 64, 1, 0, cutlass::bfloat16_t, cutlass::integer_subbyte<4, 0>, cutlass::bfloat16_t>(const T6 *, const T7 *, const T8 *, const T6 *, const float *, T6 *, int, int, bool)","1","14","(32, 8, 1)","(1544, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","22,688"
"3","717","python3.12","127.0.0.1","void qmv_kernel<8, 16, 64, 1, 0, cutlass::bfloat16_t, cutlass::integer_subbyte<4, 0>, cutlass::bfloat16_t>(const T6 *, const T7 *, const T8 *, const T6 *, const float *, T6 *, int, int, bool)","1","24","(32, 8, 1)","(1544, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","22,720"
"""


def test_ncu_runs_group_consecutive_launches_of_one_kernel_and_grid(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text(NCU_LOG)
    runs = linear_gemv.ncu_runs(str(path))
    assert [(engine, grid, len(times)) for engine, grid, times in runs] == [
        ("stock", "(1544, 1, 1)", 1), ("lily", "(1544, 1, 1)", 1), ("stock", "(1544, 1, 1)", 2)]
    assert runs[0][2] == [1706.24] and runs[2][2] == [22.688, 22.72]  # "1,706,240" ns -> us
