"""``bench.kernel_sections``' summaries of Nsight Compute's prints, on the prints of one live partials launch that the
H200 run of 2026-12-04 committed (docs/results/2026-12-04-h200-long-context-decode/3_ncu_sections/)."""

from pathlib import Path

from bench import kernel_sections as ks

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "2026-12-04-h200-long-context-decode" / "3_ncu_sections"


def test_the_details_print_gives_the_launch_and_its_issue_rate():
    found = ks.parse_details(ks._read(str(RUN / "full_4096.txt")))
    assert found["Duration"] == ("ns", "37,024")
    assert found["Registers Per Thread"] == ("register/thread", "250")
    assert found["Active Warps Per Scheduler"] == ("warp", "1.23")
    assert found["Grid Size"] == ("", "160") and found["Block Size"] == ("", "128")
    assert found["DRAM Throughput"] == ("%", "4.74")  # the first print of a name (the %, not the bytes a second)
    table = ks.details_table(ks._read(str(RUN / "full_32768.txt")))
    assert "| warps a scheduler | 0.98 |" in table and "| cycles between a warp's instructions | 2.68 cycle |" in table


def test_the_source_print_gives_the_instructions_the_samples_sit_on():
    rows = ks.parse_source(ks._read(str(RUN / "source_4096.csv.gz")))
    assert len(rows) == 2104
    text = ks.source_summary(rows, top=2)
    assert text.startswith("2104 instructions, 2461 stall samples; by reason: long_sb 65 %")
    lines = [line for line in text.splitlines() if line.startswith("| 56 ") or line.startswith("| 267 ")]
    assert lines[0] == "| 56 | `VIADDMNMX R156, R3, 0x1, R10, PT` | 1023 | 41.6 % | long_sb | 640 |"
    assert lines[1].startswith("| 267 | `SHF.L.U32 R0, R0, 0x10, RZ` | 521 | 21.2 % | long_sb")
    assert ks.source_summary([]) == "(no source rows)"


def test_the_two_ncu_commands_profile_one_launch_of_one_step():
    details, source = ks.commands("block_partials_live", 32768, "lily", clock_control="none", settings=["m.A=1"])
    for cmd in (details, source):
        assert cmd[:3] == ["ncu", "--clock-control", "none"]
        assert cmd[cmd.index("-k") + 1] == "regex:block_partials_live" and cmd[cmd.index("-c") + 1] == "1"
        assert cmd[cmd.index("--context") + 1] == "32768" and cmd[-2:] == ["--set", "m.A=1"]
    assert details[details.index("--page") + 1] == "details"
    assert source[source.index("--page") + 1] == "source" and "--csv" in source
