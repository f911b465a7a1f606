"""bench/ncu_source_top.py on a small source page in Nsight Compute's CSV form (CPU): the hottest instruction, its
reasons, and the shares by opcode and reason."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import ncu_source_top  # noqa: E402

PAGE = '''"Kernel Name","void k(int)"
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x10","      LDG.E.128 R4, desc[UR4][R2.64]","2","1","0","2","0"
"0x20","      HADD2.F32 R6, -RZ, R4.H0_H0","6","5","5","1","4"
"0x30","@!P0  BRA 0x10","2","0","0","2","0"
'''


def test_hottest_instruction_and_shares():
    instructions = ncu_source_top.read_source_page(PAGE)
    assert [i["address"] for i in instructions] == ["0x10", "0x20", "0x30"]
    hot, by_op, by_reason = ncu_source_top.summary(instructions, top=1)
    assert hot[0]["source"] == "HADD2.F32 R6, -RZ, R4.H0_H0"
    assert hot[0]["reasons"] == {"long_sb": 5.0, "wait": 1.0}  # the "(Not Issued)" subset is left out
    assert by_op == pytest.approx({"HADD2": 0.6, "LDG": 0.2, "BRA": 0.2})  # a predicate is not the opcode
    assert by_reason == pytest.approx({"wait": 0.5, "long_sb": 0.5})


def test_a_page_without_its_header_names_the_file():
    with pytest.raises(ValueError, match=r"stalls\.csv: no header line with 'Address' and 'Source'"):
        ncu_source_top.read_source_page('"Kernel Name","void k(int)"\n==ERROR== no kernels profiled\n', "stalls.csv")
