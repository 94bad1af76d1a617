"""bench.host_speed: the host's graph-build speed recorded beside decode measurements."""

from bench import host_speed
from bench.run import environment


def test_graph_build_speed_is_measured_and_recorded_in_the_environment():
    """A positive, finite figure per 1,000 ops (the same scale at another chain length), and every bench.run
    results file's environment carries it."""
    us = host_speed.graph_build_us(ops=200, repeats=3)
    assert 0 < us < 1e6
    assert environment()["host_build_us_per_1000_ops"] > 0


def test_trace_call_cost_grid_is_measured():
    """A trace call's cost is positive and grows with the arrays its owner captures (200 vs none)."""
    assert 0 < host_speed.trace_call_us(0, 2, calls=200) < host_speed.trace_call_us(200, 2, calls=200)
    table = host_speed.trace_cost_table(arrays=(0, 3), ops=(2,))
    assert table.count("\n") == 3 and "captured arrays" in table


def test_node_kind_table_times_each_kind_it_can_build_here():
    """Per-node replay costs are finite numbers for the kinds the CPU has; a custom kernel is n/a there."""
    table = host_speed.node_kind_table(kinds=("matmul", "reshape (view)", "custom kernel"))
    rows = table.splitlines()[2:]
    assert len(rows) == 3 and "n/a" in rows[2] and "n/a" not in rows[0] + rows[1]
