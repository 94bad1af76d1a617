"""Metal kernel text -> C++20 for the simulator.

The translated text keeps MLX's line structure (a ``#line`` directive maps compiler messages and
the simulator's reports back to lines of the MLX-generated kernel text). Rewrites, all line-preserving:

- comments are blanked (line breaks kept), so that no word of a comment is read as code;
- ``[[...]]`` attributes are dropped; ``#include <metal_*>`` lines are commented out;
- ``threadgroup T name[N]...;`` declarations become references to storage shared by the threadgroup
  (one block per declaration site and type, per threadgroup);
- ``device``/``constant`` pointer types become checked pointers (``msl_rt::dptr<T>``, constant ones
  ``msl_rt::dptr<const T, kConstant>``) so that every access to a kernel buffer is bounds-checked,
  including through helper functions, and a pointer never changes address space (Metal refuses it);
- remaining address-space qualifiers (``device``, ``constant``, ``threadgroup``, ``thread``) are dropped;
- ``reinterpret_cast<>`` becomes ``msl_rt::ptr_cast<>`` (keeps the bounds of checked pointers);
  ``auto*`` becomes ``auto``; half literals ``1.0h`` become ``half(1.0f)``.
"""

from __future__ import annotations

import re
from typing import List, Sequence

from .. import signature as sig

_TYPE = r"(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?"

_ATTRIBUTE = re.compile(r"\[\[[^\[\]]*\]\]")
_METAL_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<metal_[^>]*>", re.MULTILINE)
_TG_DECL = re.compile(
    r"\bthreadgroup\s+(?P<type>" + _TYPE + r")\s+(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]*\]\s*)*);"
)
_ADDR_PTR = re.compile(
    r"(?P<c1>\bconst\s+)?\b(?P<space>device|constant)\s+(?P<c2>const\s+)?(?P<type>[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)"
    r"\s*(?P<c3>const\s*)?\*"
)
_QUALIFIER = re.compile(r"\b(?:device|constant|threadgroup|thread)\b(?=\s+(?:const\b|[A-Za-z_]))")
_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_AUTO_PTR = re.compile(r"\b(?:const\s+)?auto\s*\*")


def _keep_lines(match_text: str, replacement: str) -> str:
    return replacement + "\n" * match_text.count("\n")


# Comments and string/character literals, in text order (a "//" inside a string is no comment).
_COMMENT_OR_LITERAL = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL)


def _without_comments(text: str) -> str:
    """Comments blanked (a block comment keeps its line breaks), literals kept: the rewrites below must not read
    words of a comment as code (a comment ending in "threadgroup" made the declaration on the next line a
    threadgroup array)."""
    return _COMMENT_OR_LITERAL.sub(lambda m: m.group(0) if m.group(0)[0] in "\"'" else
                                   _keep_lines(m.group(0), " "), text)


def translate_text(text: str) -> str:
    """Rewrite user Metal text (header or body) into C++ for the prelude (line-preserving)."""
    text = _without_comments(text)
    text = _METAL_INCLUDE.sub(lambda m: "// " + m.group(0).lstrip(), text)
    text = _ATTRIBUTE.sub("", text)

    def tg_decl(m):
        t = " ".join(m.group("type").split())
        dims = "".join(m.group("dims").split())
        full = f"{t}{dims}"
        rep = (
            f"auto& {m.group('name')} = ::msl_rt::tg_shared<{full}>"
            f"(&::msl_rt::site_tag<__COUNTER__, {full}>::tag, \"{m.group('name')}\");"
        )
        return _keep_lines(m.group(0), rep)

    text = _TG_DECL.sub(tg_decl, text)

    def addr_ptr(m):
        constant = m.group("space") == "constant"  # read-only, and its own address space
        const = "const " if (m.group("c1") or m.group("c2") or constant) else ""
        t = " ".join(m.group("type").split())
        tail = " const" if m.group("c3") else ""
        return _keep_lines(m.group(0), f"::msl_rt::dptr<{const}{t}{_SPACE[constant]}>{tail}")

    text = _ADDR_PTR.sub(addr_ptr, text)
    text = _QUALIFIER.sub("", text)
    text = re.sub(r"\breinterpret_cast\s*<", "::msl_rt::ptr_cast<", text)
    text = _AUTO_PTR.sub("auto", text)
    text = _HALF_LITERAL.sub(lambda m: f"half({m.group(1)}f)" if "." in m.group(1) or "e" in m.group(1).lower()
                             else f"half({m.group(1)}.0f)", text)
    return text


# dptr's address-space argument: device (the default) or constant.
_SPACE = {False: "", True: ", ::msl_rt::kConstant"}


def param_cpp(p: sig.Param) -> str:
    """A kernel parameter as the simulator's C++ declares it."""
    t = f"::metal::atomic<{p.ctype}>" if p.atomic else p.ctype
    if p.kind == "attribute":
        return f"  {p.ctype} {p.name}"
    if p.kind == "output":
        return f"  ::msl_rt::dptr<{t}> {p.name}"
    if p.ref == "&":
        return f"  const {t}& {p.name}"
    return f"  ::msl_rt::dptr<const {t}{_SPACE[p.space == 'constant']}> {p.name}"


def kernel_cpp(
    kname: str,
    header: str,
    source: str,
    template_header: str,
    template_inst: str,
    params: Sequence[sig.Param],
) -> str:
    """The translated kernel (function definition plus an extern "C" launcher), line-aligned with
    MLX's text of the same kernel."""
    lines: List[str] = ['#include "prelude.h"', f'#line 1 "{kname}.metal"']
    body = translate_text(header) + template_header
    body += f"void {kname}(\n"
    for i, p in enumerate(params):
        body += param_cpp(p) + (",\n" if i < len(params) - 1 else ") {\n")
    if not params:
        body = body[:-2] + ") {\n"
    body += translate_text(source) + "\n}\n"
    lines.append(body)
    lines.append('#line 1 "<launcher>"')
    lines.append(_launcher(kname, template_inst, params))
    return "\n".join(lines)


def _launcher(kname: str, template_inst: str, params: Sequence[sig.Param]) -> str:
    args = []
    for p in params:
        if p.kind == "attribute":
            args.append(f"t.{p.name}")
            continue
        b = p.index
        t = f"::metal::atomic<{p.ctype}>" if p.atomic else p.ctype
        if p.kind == "output":
            args.append(f"::msl_rt::dptr<{t}>(({t}*)L->ptrs[{b}], L->bases[{b}], L->nbytes[{b}], {b})")
        elif p.ref == "&":
            args.append(f"*(const {t}*)L->ptrs[{b}]")
        else:
            args.append(f"::msl_rt::dptr<const {t}{_SPACE[p.space == 'constant']}>((const {t}*)L->ptrs[{b}], "
                        f"L->bases[{b}], L->nbytes[{b}], {b})")
    call = f"{kname}{template_inst}(" + ", ".join(args) + ");"
    return (
        "static void lily_body(::msl_rt::Launch* L, const ::msl_rt::ThreadAttrs& t) {\n"
        "  (void)L; (void)t;\n"
        f"  {call}\n"
        "}\n"
        'extern "C" int lily_sim_launch(::msl_rt::Launch* L) { return ::msl_rt::run(L, &lily_body); }\n'
    )
