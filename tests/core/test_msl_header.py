"""lily_mlx.core.msl_header: each kernel gets only the header items it uses, without comments."""

import re

import pytest

from lily_mlx.core import kernel_registry as kr
from lily_mlx.core.msl_header import defined_names, header_for, strip_comments, top_level_items

HEADER = """\
// helpers
#define WIDTH 64  // a macro used by a helper
#define UNUSED_MACRO 3
typedef uint4 words4;
constant float kSpare[2] = {1.0f, 2.0f};
constexpr int kUsed = WIDTH / 2;

template <typename T, int N>
struct Shape {
  static constexpr int W = N * kUsed;
};

inline float leaf(float x) { return x * 2.0f; }  // "{" in a comment: } no effect

// an overload pair: kept together
inline float twice(float x) { return leaf(x) + leaf(x); }
inline half twice(half x) { return x + x; }

template <typename T>
inline T unused_helper(T x) {
  static_assert(sizeof(T) > 0, "a message with // and (parentheses) {braces}");
  return x;
}

inline float4 operator*(float4 a, Shape<float, 1> s) { return a; }
"""

BODY = """\
  // a comment naming unused_helper does not keep it
  const float y = twice(x[0]) * Shape<float, 2>::W;  // trailing comment
  out[0] = y;
"""


def test_strip_comments_keeps_code_and_literals():
    text = 'a = 1; // c\n  // whole line\n\nb = "x // y"; // z\nc = \'/\';\n'
    assert strip_comments(text) == 'a = 1;\nb = "x // y";\nc = \'/\';\n'


def test_items_split_the_header_losslessly_at_top_level():
    code = strip_comments(HEADER)
    items = top_level_items(code)
    assert "".join(items) == code
    assert [sorted(defined_names(i)) for i in items] == [
        ["WIDTH"], ["UNUSED_MACRO"], [], ["kSpare"], ["kUsed"], ["Shape"], ["leaf"], ["twice"], ["twice"],
        ["unused_helper"], []]  # an operator: no recognised name, so always kept


def test_header_for_keeps_what_the_body_reaches():
    got = header_for(HEADER, BODY)
    for kept in ("#define WIDTH", "typedef uint4 words4", "kUsed =", "struct Shape", "inline float leaf",
                 "inline float twice", "inline half twice", "operator*"):
        assert kept in got, kept
    for dropped in ("UNUSED_MACRO", "kSpare", "unused_helper", "//"):
        assert dropped not in got, dropped


def _all_specs():
    from lily_mlx.ops.attention import kernels as ak
    from lily_mlx.ops.deltanet import kernels as dk
    from lily_mlx.ops.linear import kernels as lk
    from lily_mlx.ops.moe import kernels as mk

    return [s for m in (ak, dk, lk, mk) for s in m.KERNELS.values()]


@pytest.mark.parametrize("spec", _all_specs(), ids=lambda s: s.name)
def test_every_kernel_gets_a_pruned_comment_free_header(spec):
    """Each kernel's header is a subsequence of its file's comment-free header items and holds every item whose
    name its body uses; no comment reaches a backend. (That each kernel still compiles and computes the same
    values is every kernel test's business: they build kernels from this source.)"""
    header, body = kr.kernel_source(spec)
    whole, _ = kr.load_kernel_file(spec.file)
    items = top_level_items(strip_comments(whole))
    kept = top_level_items(header)
    it = iter(items)
    assert all(any(k == i for i in it) for k in kept), "not in the file's order"
    used = set(re.findall(r"[A-Za-z_]\w*", body))
    for item in items:
        if defined_names(item) & used:
            assert item in kept, (spec.name, sorted(defined_names(item)))
    assert "//" not in header and not any(line.lstrip().startswith("//") for line in body.splitlines())
    assert len(header) + len(body) <= len(whole) + len(kr.load_kernel_file(spec.file)[1][spec.name]) + 4096
