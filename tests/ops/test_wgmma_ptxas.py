"""ptxas's own verdict on the Hopper kernel's wgmma pipeline: it serializes every wgmma of a function (C7510-C7519
"Potential Performance Loss") when it cannot keep the warpgroup's A and accumulator registers apart. The kernel still
gives the same bits, so no test of values sees it: from the twenty-first session to the twenty-third, the stream-K
loop made (128, 2) 10-20% slower that way (csrc/awq_wgmma.cu, "Units are pairs"). Needs nvcc; slow (about 45 s)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_no_serialized_wgmma_in_dispatched_kernels(tmp_path):
    proc = subprocess.run(
        ["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v",
         "-o", str(tmp_path / "awq_wgmma.cubin"), str(CSRC / "awq_wgmma.cu")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    warned = re.findall(r"\(C751\d\) Potential Performance Loss.*?function '(\w+)'", proc.stderr)
    # awq_wgmma_kernel<T, S, BM, TW, WS, GROUPED, SK>: (64, 4) keeps 128 accumulators and two 64-register A buffers,
    # more than a thread has, and is only ever swept, never dispatched (awq_wgmma_cost.WGMMA_US_PER_CHUNK)
    dispatched = [f for f in warned if "Li64ELi4E" not in f]
    assert not dispatched, "ptxas serialized the wgmmas of:\n" + "\n".join(dispatched)
    assert len(re.findall(r"Compiling entry function '\w*awq_wgmma_kernel", proc.stderr)) >= 20  # all were built
