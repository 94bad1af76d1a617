"""bench.host_speed: the host's graph-build speed recorded beside decode measurements."""

from bench import host_speed
from bench.run import environment


def test_graph_build_speed_is_measured_and_recorded_in_the_environment():
    """A positive, finite figure per 1,000 ops (the same scale at another chain length), and every bench.run
    results file's environment carries it."""
    us = host_speed.graph_build_us(ops=200, repeats=3)
    assert 0 < us < 1e6
    assert environment()["host_build_us_per_1000_ops"] > 0
