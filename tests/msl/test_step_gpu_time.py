"""``bench.step_gpu_time``'s summary of an Nsight Compute log (``ncu --csv``), on rows in the format
Nsight Compute 2025 writes them (copied from a run on the H200, shortened): the ``==PROF==`` lines are
skipped, names are cut at their template arguments, units are read, and per-step figures divide by the
number of profiled steps."""

from bench import step_gpu_time

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(i, name, unit, value):
    return (f'"{i}","1224","python3.12","127.0.0.1","{name}","1","14","(32, 1, 1)","(1, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"')


def test_summary_of_an_ncu_log(tmp_path):
    rows = []
    for step in range(2):
        base = 3 * step
        rows += [_row(base, "void mlx::qmv_kernel<8, 16, 64, 1, 0, cutlass::bfloat16_t>(const T6 *, T9 *)",
                      "nsecond", "22,656"),
                 _row(base + 1, "mlx::custom_kernel_moe_router_logits_q_768fff423f0837e4", "usecond", "11.5"),
                 _row(base + 2, "std::enable_if<(bool)1, void>::type mlx::copy_gg_nd<float>(const float *)",
                      "msecond", "0.003")]
    log = tmp_path / "step.csv"
    log.write_text("==PROF== Connected to process 1224 (python3.12)\n==PROF== Disconnected\n"
                   + HEADER + "\n" + "\n".join(rows) + "\n")
    total, count = step_gpu_time.kernel_times(str(log))
    assert count == {"void mlx::qmv_kernel": 2, "mlx::custom_kernel_moe_router_logits_q_768fff423f0837e4": 2,
                     "std::enable_if": 2}
    assert abs(total["void mlx::qmv_kernel"] - 2 * 22.656) < 1e-9
    assert abs(total["std::enable_if"] - 6.0) < 1e-9
    text = step_gpu_time.summarise(str(log), steps=2)
    assert text.startswith("GPU time per decode step: 0.037 ms over 3 kernels")  # (22.656 + 11.5 + 3) us
    assert "| void mlx::qmv_kernel | 1 | 22.7 | 61.0 % |" in text


def test_the_ncu_command_names_its_clock_control_and_the_settings():
    """The profiled process runs under the clock control asked for (base: ncu's default, the earlier tables' clocks;
    none: the clocks the e2e runs find) with every module setting passed on."""
    cmd = step_gpu_time.ncu_command("lily", 32768, 2, "log.csv", settings=["m.A=1", "m.B=2"], clock_control="none",
                                    cache_control="none")
    assert cmd[:5] == ["ncu", "--clock-control", "none", "--cache-control", "none"]
    assert cmd[cmd.index("--context") + 1] == "32768" and cmd[-4:] == ["--set", "m.A=1", "--set", "m.B=2"]
    assert step_gpu_time.ncu_command("lily", 4096, 2, "log.csv")[1:5] == ["--clock-control", "base", "--cache-control",
                                                                          "all"]


def test_the_copy_probe_gives_the_ceiling_of_its_median_launch(tmp_path):
    """``--compare`` profiles a 1 GiB copy first, under the same clock control: GB/s (read + write) from its median
    launch; none from a log without launches."""
    log = tmp_path / "copy.csv"
    rows = [_row(i, "void binary_ss<float>(const float *)", "usecond", us) for i, us in enumerate(("700", "720", "1000"))]
    log.write_text(HEADER + "\n" + "\n".join(rows) + "\n")
    gbs = step_gpu_time.copy_ceiling(str(log))
    assert abs(gbs - 2 * 4 * step_gpu_time.COPY_PROBE_ELEMENTS / 720.0 / 1e3) < 1e-6  # 2 GiB moved in 720 us
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== Disconnected\n")
    assert step_gpu_time.copy_ceiling(str(empty)) is None
    cmd = step_gpu_time.ncu_command(None, 0, 0, "copy.csv", clock_control="none")
    assert cmd[1:3] == ["--clock-control", "none"] and cmd[-1] == "--copy-probe" and "--engine" not in cmd
