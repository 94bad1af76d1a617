"""docs/switches.md is generated from the switch registry and must stay in sync with it."""

import importlib.util
from pathlib import Path

from lily_mlx.core.backend import CHOICES
from lily_mlx.core.switches import SWITCHES

_GEN = Path(__file__).with_name("gen_switches_doc.py")


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_switches_doc", _GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_switches_doc_in_sync():
    gen = load_generator()
    assert gen.DOC.exists(), "docs/switches.md missing: run python tests/core/gen_switches_doc.py"
    assert gen.DOC.read_text() == gen.render(), (
        "docs/switches.md is out of date: run python tests/core/gen_switches_doc.py")


def test_doc_rows_cover_every_switch():
    gen = load_generator()
    rows = [l for l in gen.switch_table().splitlines() if l.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == list(SWITCHES)
    for row, s in zip(rows, SWITCHES.values()):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[1:4] == [s.family, s.phase, "on" if s.default else "off"]
    assert "|".join(CHOICES) in gen.render()


def test_hand_written_switch_tables_name_every_switch():
    """README.md and docs/usage.md keep short hand-written switch tables: none may miss a switch."""
    root = Path(__file__).resolve().parents[2]
    for doc in ("README.md", "docs/usage.md"):
        text = (root / doc).read_text()
        missing = [name for name in SWITCHES if f"`{name}`" not in text]
        assert not missing, f"{doc} does not mention {missing}"
