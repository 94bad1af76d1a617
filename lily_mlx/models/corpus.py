"""Offline training text for the embedded model: docstrings of Python's standard library.

The docstrings are read with ``ast`` from the stdlib's source files (nothing is imported, so no module
side effects), in a fixed order. Every ``HELDOUT_EVERY``-th docstring goes to the held-out split, the
rest to the training split, so held-out text is never trained on but has the same style.

The text depends on the Python version (the stdlib's docstrings change between releases); the
builder records a hash of the corpus it used, so two builds can be compared.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Document separator used in training; the tokenizer has it as a special token.
DOC_SEPARATOR = "<|endoftext|>"
HELDOUT_EVERY = 20
# Modules whose docstrings are mostly tables or generated text, or that are not Python 3 prose.
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    train: list[str]  # docstrings for training, in a fixed order
    heldout: list[str]  # docstrings never trained on
    sha256: str  # hash of both splits, for build records

    @property
    def train_text(self) -> str:
        return DOC_SEPARATOR.join(self.train)

    @property
    def heldout_text(self) -> str:
        return "\n\n".join(self.heldout)


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS.intersection(rel.parts) or rel.name.startswith("test_"):
            continue
        files.append(path)
    return files


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        # Short docstrings ("Return x.") teach little; very long ones are mostly tables.
        if doc and 40 <= len(doc) <= 4000 and doc.isascii():
            out.append(doc.strip())
    return out


def load_corpus(max_chars: int = 2_000_000) -> Corpus:
    """Docstrings of the stdlib, split into train / held-out, at most ``max_chars`` in total."""
    docs: list[str] = []
    total = 0
    for path in _stdlib_sources():
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for doc in _docstrings(source):
            docs.append(doc)
            total += len(doc)
        if total >= max_chars:
            break
    train = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    digest = hashlib.sha256("\x00".join(train + ["\x01"] + heldout).encode()).hexdigest()
    return Corpus(train=train, heldout=heldout, sha256=digest)
