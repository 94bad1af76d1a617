"""The part of a kernel file's header that one kernel uses, without comments.

A kernel file's header holds the helpers all its kernels share (the MoE file's is ~57 KB with its comments), and MLX
takes a custom kernel's whole source at every launch: on Apple GPUs ``CustomKernel::eval_gpu`` compares it with the
copy it cached for the kernel's name (a full comparison of two equal strings), and each call of a kernel outside a
trace writes the whole source out again; the Metal compiler, our simulator's C++ compiler and NVRTC parse all of it.
So each kernel gets only the header items its body needs, directly or through other kept items, with the comments
dropped: the same code, 4-5x less text (the MoE decode kernels 13-15 KB instead of 60).

Items are the header's top-level declarations: a preprocessor line, or text up to a top-level ``;`` or ``}`` (a
function, a struct, a constant, a typedef). An item is kept when a name it defines occurs in the kernel's body or in a
kept item, and always when it defines no name this module recognises (preprocessor lines, typedefs, static_asserts)
or declares an operator (used without its name). A dropped item that was needed is a compile error, never other
code: overloads and specialisations share their name and are kept together.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import FrozenSet, List, Set, Tuple

_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_TYPE_NAME = re.compile(r"\b(?:struct|class|union|enum(?:\s+class)?)\s+([A-Za-z_]\w*)")
_TEMPLATE_PREFIX = re.compile(r"^template\s*<[^;{]*?>\s*")
_CALLED_NAME = re.compile(r"([A-Za-z_]\w*)\s*\(")
_ASSIGNED_NAME = re.compile(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\])?\s*=")


def _scan(line: str) -> Tuple[int, int]:
    """(where the line's ``//`` comment starts, or its length; opening minus closing braces and parentheses before
    it), outside string and character literals."""
    depth, quote, i = 0, None, 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif line.startswith("//", i):
            return i, depth
        elif c in "{(":
            depth += 1
        elif c in "})":
            depth -= 1
        i += 1
    return len(line), depth


def strip_comments(text: str) -> str:
    """``text`` without ``//`` comments (outside string and character literals) and without blank lines."""
    lines = [line[:_scan(line)[0]].rstrip() for line in text.splitlines()]
    lines = [line for line in lines if line.strip()]
    return "\n".join(lines) + "\n" if lines else ""


def top_level_items(code: str) -> List[str]:
    """The top-level items of comment-free ``code``, in order; joined they give ``code`` back."""
    items, current, depth = [], [], 0
    for line in code.splitlines(keepends=True):
        if depth == 0 and not current and line.lstrip().startswith("#"):
            items.append(line)
            continue
        current.append(line)
        depth += _scan(line)[1]
        tail = line.rstrip()
        if depth == 0 and (tail.endswith(";") or tail.endswith("}")):
            items.append("".join(current))
            current = []
    if current:
        items.append("".join(current))
    return items


def defined_names(item: str) -> Set[str]:
    """The names a top-level item defines (a macro, type, function, constant); empty where none is recognised."""
    text = item.strip()
    if text.startswith("#define"):
        return {re.split(r"[\s(]", text[len("#define"):].strip(), maxsplit=1)[0]}
    if text.startswith("#") or text.startswith("typedef") or text.startswith("static_assert"):
        return set()
    head = _TEMPLATE_PREFIX.sub("", text.split("{", 1)[0])
    typed = _TYPE_NAME.search(head)
    if typed and "(" not in head[:typed.start()]:
        return {typed.group(1)}
    called = _CALLED_NAME.search(head)
    if called and "=" not in head[:called.start()]:
        return {called.group(1)}
    assigned = _ASSIGNED_NAME.search(head)
    return {assigned.group(1)} if assigned else set()


@lru_cache(maxsize=64)
def _parsed(header: str) -> Tuple[Tuple[str, ...], Tuple[FrozenSet[str], ...], Tuple[FrozenSet[str], ...]]:
    """(items, the names each defines, the identifiers each uses) of a header (one parse per kernel file)."""
    items = tuple(top_level_items(strip_comments(header)))
    return (items, tuple(frozenset(defined_names(item)) for item in items),
            tuple(frozenset(_IDENTIFIER.findall(item)) for item in items))


def header_for(header: str, body: str) -> str:
    """The items of ``header`` that ``body`` needs (directly or through other kept items), comment-free, in their
    order."""
    items, names, uses = _parsed(header)
    keep = [not defines or "operator" in item for item, defines in zip(items, names)]
    used = set(_IDENTIFIER.findall(strip_comments(body)))
    for i, kept in enumerate(keep):
        if kept:
            used |= uses[i]
    grew = True
    while grew:
        grew = False
        for i, defines in enumerate(names):
            if not keep[i] and defines & used:
                keep[i] = grew = True
                used |= uses[i]
    return "".join(item for item, kept in zip(items, keep) if kept)
