"""``lily_dev.sass``: loops and their instruction mix in a SASS listing (both disassemblers' branch forms), and on a
real kernel compiled for the H200 where nvcc and nvdisasm are installed."""

import pytest

from lily_dev import compile_check, sass

# Two nested loops as nvdisasm prints them (branches to labels): an outer K loop around an inner FMA loop.
NVDISASM = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   STS.128 [R0], R4 ;
.L_x_1:
        /*0030*/                   LDS.128 R8, [R0] ;
        /*0040*/                   FFMA R12, R8, R9, R12 ;
        /*0050*/                   FFMA R13, R10, R11, R13 ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
        /*0070*/               @!P1 BRA `(.L_x_0) ;
        /*0080*/                   STL.64 [R1], R12 ;
        /*0090*/                   EXIT ;
"""


def test_loops_of_a_listing_with_labels_and_with_addresses():
    for listing in (NVDISASM, NVDISASM.replace("`(.L_x_1)", "0x30").replace("`(.L_x_0)", "0x10")):
        found = sass.loops(listing)
        assert [(lp.start, lp.end, lp.inner) for lp in found] == [(0x10, 0x70, False), (0x30, 0x60, True)]
        outer, inner = found
        assert inner.ops == {"LDS": 1, "FFMA": 2, "BRA": 1} and inner.share("FFMA") == 0.5
        assert outer.count == 7 and outer.ops["STS"] == 1 and "STL" not in outer.ops
    assert sass.opcode("@!P0 LDS.128 R4, [R2]") == "LDS" and sass.opcode("FFMA R1, R2, R3, R4") == "FFMA"
    table = sass.loop_table(sass.loops(NVDISASM), top=1)
    assert table.splitlines()[2].startswith("| 0x30-0x60 | yes | 4 | 2 | 50 % | 1 / 0 |")


@pytest.mark.skipif(compile_check.nvcc_path() is None or sass.nvdisasm_path() is None, reason="needs nvcc and nvdisasm")
def test_the_register_tiles_inner_loop_is_mostly_ffma():
    """The 64-thread down register tile at Qwen3.6's widths: its hottest inner loop (8 rows x 4 columns a thread,
    one K value per iteration pair) is FMAs fed by threadgroup loads, no local memory."""
    from lily_dev import resource_usage

    unit = next(u for name, u in resource_usage.moe_gemm_units().items() if "down_regtile" in name and "NT=64" in name)
    ptxas, listing = sass.kernel_sass(unit)
    assert "registers" in ptxas
    hottest = max((lp for lp in sass.loops(listing) if lp.inner), key=lambda lp: lp.ops.get("FFMA", 0))
    assert hottest.ops["FFMA"] >= 32 and hottest.share("FFMA") > 0.7 and hottest.ops.get("LDS", 0) > 0
    assert "LDL" not in hottest.ops and "STL" not in hottest.ops


def test_the_attention_family_has_the_three_decode_kernels():
    """``--family attention``: the one-pass decode kernel, the fixed blocks' partials (and the 4-heads candidate) and
    their merge, and the three forms over a 4- and an 8-bit quantized cache (one pass, fixed blocks, live length with
    the live merge), each as the CUDA translation unit MLX would compile (their launches captured, nothing run)."""
    units = sass.units("attention")
    assert set(units) == {"attention_decode", "attention_decode_block_partials", "attention_decode_merge_blocks",
                          "attention_decode_block_partials[GT=4]", "attention_decode_merge_live_blocks"} | {
                              f"attention_decode{form}_quantized[{bits}-bit]"
                              for form in ("", "_block_partials", "_block_partials_live") for bits in (4, 8)}
    assert all(f"custom_kernel_{name.split('[')[0]}" in unit for name, unit in units.items())
