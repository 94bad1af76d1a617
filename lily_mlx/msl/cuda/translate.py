"""Metal Shading Language text -> CUDA text for the bridge (pure text, no MLX calls).

The bridge keeps the kernel text as written and defines Metal's names in a CUDA prelude
(``cuda/prelude.cuh``). What cannot be a definition is rewritten here, on code only (comments and
string literals are left alone):

- address-space qualifiers: ``device``/``thread``/``constant`` are dropped (``constant`` at namespace
  scope of the header becomes ``__constant__``); a ``threadgroup`` variable declaration becomes
  ``__shared__``, ``threadgroup`` in pointer/reference types is dropped;
- header functions (and struct member functions) get ``__device__`` (CUDA has no "device by default");
- ``#include <metal_*>`` and ``#pragma METAL`` lines are dropped.

Constructs CUDA cannot express the same way raise :class:`UnbridgeableError` with the reason.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple


class UnbridgeableError(ValueError):
    """A Metal construct the CUDA bridge cannot reproduce."""


# (pattern on code, reason). Checked on comment-free text.
_UNBRIDGEABLE = (
    (r"\[\[\s*(?!maybe_unused|likely|unlikely)\w+", "Metal attributes ([[...]]) such as [[kernel]] or "
     "[[thread_position_in_grid]] in kernel text: write helpers as plain functions and use the "
     "thread attribute variables MLX provides"),
    (r"\b(texture[123]d\w*|texturecube\w*|sampler|depth2d\w*)\b", "textures and samplers"),
    (r"\b(imageblock|raytracing|intersection_function_table|visible_function_table|mesh_grid_properties)\b",
     "imageblocks, ray tracing, function tables and mesh shaders"),
    (r"MetalPerformancePrimitives|\bmpp::", "Metal 4 tensor ops (MetalPerformancePrimitives)"),
    (r"\bsimdgroup_async_copy\b|\bsimdgroup_event\b", "simdgroup async copies"),
    (r"\bsimd_shuffle_and_fill_(up|down)\b", "simd_shuffle_and_fill_up/down"),
    (r"\bsimdgroup_matrix_storage\b", "simdgroup_matrix_storage"),
)


def _segments(text: str) -> List[Tuple[bool, str]]:
    """Split ``text`` into (is_code, chunk) pieces; comments, string and char literals are not code.
    Preprocessor lines count as code."""
    out: List[Tuple[bool, str]] = []
    i, n, start = 0, len(text), 0
    while i < n:
        c = text[i]
        if c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif c == "/" and text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        if i > start:
            out.append((True, text[start:i]))
        out.append((False, text[i:j]))
        i = start = j
    if start < n:
        out.append((True, text[start:]))
    return out


def code_only(text: str) -> str:
    """``text`` with comments and literals blanked (same length, newlines kept)."""
    return "".join(s if code else re.sub(r"[^\n]", " ", s) for code, s in _segments(text))


def check_bridgeable(text: str, where: str) -> None:
    code = code_only(text)
    for pattern, reason in _UNBRIDGEABLE:
        m = re.search(pattern, code)
        if m:
            line = code.count("\n", 0, m.start()) + 1
            raise UnbridgeableError(
                f"Metal->CUDA bridge: {reason} cannot be bridged ({where}, line {line}: {m.group(0)!r})"
            )


_DROP_LINES = re.compile(r"^[ \t]*(#\s*include\s*<metal_\w+>|#\s*pragma\s+METAL\b).*$", re.MULTILINE)


def _address_space_edits(code: str, namespace_scope_mask: List[bool]) -> List[Tuple[int, int, str]]:
    """(start, end, replacement) edits of qualifier words in a code-only string (the mask is True
    where a position is at namespace scope)."""
    out = []
    for m in re.finditer(r"\b(device|constant|thread|threadgroup)\b", code):
        word = m.group(1)
        after = code[m.end():]
        nxt = re.match(r"\s*([A-Za-z_])", after)
        if not nxt:  # not a qualifier (e.g. an identifier followed by an operator)
            continue
        if word == "threadgroup":
            # A declaration (not pointer/reference) -> shared memory.
            decl = re.match(r"[^;=\[\(\{\)]*", after).group(0)
            before = code[:m.start()].rstrip()
            at_statement = not before or before[-1] in ";{}" or before.endswith(("const", "static"))
            shared = at_statement and "*" not in decl and "&" not in decl
            out.append((m.start(), m.end(), "__shared__" if shared else ""))
        elif word == "constant" and namespace_scope_mask[m.start()]:
            stmt_end = code.find(";", m.end())
            stmt_start = max(code.rfind(";", 0, m.start()), code.rfind("}", 0, m.start()))
            stmt = code[stmt_start + 1:stmt_end]
            out.append((m.start(), m.end(), "" if "constexpr" in stmt else "__constant__"))
        else:
            out.append((m.start(), m.end(), ""))
    return out


def _scope_info(code: str) -> Tuple[List[bool], List[Tuple[int, int]]]:
    """For a code-only header: a per-position mask 'at namespace scope', and the (start, insert_at)
    positions of function declarations at namespace or class scope (insert ``__device__`` there)."""
    n = len(code)
    mask = [False] * n
    inserts: List[Tuple[int, int]] = []
    # Stack of scope kinds: 'ns' (namespace/global), 'class', 'block' (function body, initializer).
    stack = ["ns"]
    stmt_start = 0
    paren = 0
    i = 0
    while i < n:
        c = code[i]
        kind = stack[-1]
        mask[i] = kind == "ns"
        if c == "#" and code[stmt_start:i].strip() == "":
            j = code.find("\n", i)
            j = n if j < 0 else j
            while j < n and code[j - 1] == "\\":
                k = code.find("\n", j + 1)
                j = n if k < 0 else k
            for k in range(i, j):
                mask[k] = kind == "ns"
            i = stmt_start = j
            continue
        if c == "(":
            paren += 1
        elif c == ")":
            paren -= 1
        elif paren == 0 and c in "{;}":
            if c == "{":
                stmt = code[stmt_start:i]
                if kind in ("ns", "class"):
                    new = _classify_scope(stmt)
                    if new == "function":
                        inserts.append(_insert_point(code, stmt_start, i))
                        new = "block"
                    stack.append(new)
                else:
                    stack.append("block")
            elif c == ";":
                if kind in ("ns", "class"):
                    stmt = code[stmt_start:i]
                    if _classify_scope(stmt) == "function":  # prototype
                        inserts.append(_insert_point(code, stmt_start, i))
            else:  # "}"
                if len(stack) > 1:
                    stack.pop()
            stmt_start = i + 1
        i += 1
    return mask, inserts


_NOT_FUNCTION = re.compile(r"^\s*(template\s*<.*?>\s*)?(struct|class|union|enum|namespace|typedef|using|static_assert|extern\s+\"C\")\b", re.S)


def _classify_scope(stmt: str) -> str:
    """What a '{' (or ';') at namespace/class scope opens: 'ns', 'class', 'function' or 'block'."""
    s = stmt.strip()
    if re.match(r"^(inline\s+)?namespace\b", s):
        return "ns"
    m = _NOT_FUNCTION.match(s)
    if m:
        return "class" if m.group(2) in ("struct", "class", "union") else "block"
    # A function: a parameter list before any '=' (operator= aside), not a variable initializer. A leading
    # template<...> is skipped first: its default arguments (`int SK = 1`) are no initializer.
    s = s[_template_prefix_end(s):]
    head = re.sub(r"operator\s*(==|!=|<=|>=|\+=|-=|\*=|/=|=)", "operator__", s)
    lp = head.find("(")
    eq = head.find("=")
    if lp > 0 and (eq < 0 or lp < eq) and re.search(r"[\w>\]~]\s*$", head[:lp]):
        return "function"
    return "block"


def _template_prefix_end(text: str, start: int = 0, end: Optional[int] = None) -> int:
    """The position after a leading ``template<...>`` of text[start:end] (its brackets matched; a ``<`` or ``>``
    inside parentheses, as in a default argument ``int B = (A > 2)``, is a comparison), else the first non-space
    position."""
    end = len(text) if end is None else end
    i = start
    while i < end and text[i].isspace():
        i += 1
    m = re.match(r"template\s*<", text[i:end])
    if m:
        depth, parens, j = 0, 0, i + m.end() - 1
        while j < end:
            c = text[j]
            if c == "(":
                parens += 1
            elif c == ")":
                parens -= 1
            elif c == "<" and parens == 0:
                depth += 1
            elif c == ">" and parens == 0:
                depth -= 1
                if depth == 0:
                    break
            j += 1
        i = j + 1
    return i


def _insert_point(code: str, start: int, end: int) -> Tuple[int, int]:
    """Where ``__device__`` goes in the declaration code[start:end]: after a leading template<...>."""
    return start, _template_prefix_end(code, start, end)


def translate(text: str, where: str = "body") -> str:
    """CUDA text for a Metal kernel ``body`` or ``header``."""
    check_bridgeable(text, where)
    text = _DROP_LINES.sub("", text)
    code = code_only(text)
    if where == "header":
        mask, inserts = _scope_info(code)
    else:
        mask, inserts = [False] * len(code), []
    edits = _address_space_edits(code, mask)
    for _, at in inserts:
        if "__device__" not in code[at:at + 40].split("(")[0]:
            edits.append((at, at, "__device__ "))
    # Apply back to front; the code view has the same positions as the text.
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        text = text[:start] + new + text[end:]
    return text
