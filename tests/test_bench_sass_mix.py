"""bench/sass_mix.py's SASS parsing on a hand-written listing: the hottest loop is the backward branch with the most
HMMA, its opcode counts ignore predicates and modifiers, and --order run-length codes its MMAs and global loads."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import sass_mix  # noqa: E402

# Two loops: 0x0020-0x0060 (one HMMA, five instructions) and 0x0080-0x0110 (two HMMA), then straight code.
_LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x0000 */
        /*0010*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ; /* 0x0000 */
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;   /* 0x0000 */
        /*0030*/                   LOP3.LUT R9, R4, 0xf000f, RZ, 0xc0, !PT ; /* 0x0000 */
        /*0040*/                   IADD3 R0, R0, 0x1, RZ ;                /* 0x0000 */
        /*0050*/                   ISETP.GE.AND P0, PT, R0, R3, PT ;      /* 0x0000 */
        /*0060*/               @!P0 BRA 0x20 ;                            /* 0x0000 */
        /*0070*/                   MOV R2, RZ ;                           /* 0x0000 */
        /*0080*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;   /* 0x0000 */
        /*0090*/                   HMMA.16816.F32.BF16 R12, R4, R6, R12 ; /* 0x0000 */
        /*00a0*/               @!P1 LDG.E.NA.128.CONSTANT R4, desc[UR4][R2.64] ; /* 0x0000 */
        /*00b0*/                   LOP3.LUT R9, R4, 0xf000f, RZ, 0xc0, !PT ; /* 0x0000 */
        /*00c0*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR4][R2.64] ; /* 0x0000 */
        /*00d0*/                   LDG.E.U16.CONSTANT R7, desc[UR4][R2.64] ; /* 0x0000 */
        /*00e0*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;   /* 0x0000 */
        /*00f0*/                   LDS R3, [R2] ;                         /* 0x0000 */
        /*0100*/                   ISETP.GE.AND P0, PT, R0, R3, PT ;      /* 0x0000 */
        /*0110*/               @!P0 BRA 0x80 ;                            /* 0x0000 */
        /*0120*/                   EXIT ;                                 /* 0x0000 */
"""


def test_hottest_loop_is_the_one_with_most_hmma():
    body = sass_mix.hottest_loop(_LISTING)
    assert len(body) == 10
    assert body[0].startswith("HMMA") and body[-1] == "@!P0 BRA 0x80"


def test_loop_mix_counts_opcodes_without_predicates_or_modifiers():
    n, ops = sass_mix.loop_mix(_LISTING)
    assert n == 10
    assert dict(ops) == {"HMMA": 3, "LDG": 2, "LDGSTS": 1, "LOP3": 1, "LDS": 1, "ISETP": 1, "BRA": 1}


def test_loop_order_run_length_codes_mmas_and_global_loads():
    assert sass_mix.loop_order(_LISTING) == "H2 L3 H1"  # LDS is not a global load


def test_no_loop():
    straight = "\n".join(line for line in _LISTING.splitlines() if "BRA" not in line)
    assert sass_mix.hottest_loop(straight) == []
    assert sass_mix.loop_mix(straight) == (0, {})
    assert sass_mix.loop_order(straight) == ""
