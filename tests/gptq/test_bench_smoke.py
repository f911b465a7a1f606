"""bench/gptq.py --smoke: the benchmark script runs end to end on tiny shapes (CPU without a GPU)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_gptq_smoke(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gptq.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert len(data["timing"]) >= 8 and len(data["quality"]) == 9
    gptq = {row[0]: row[2] for row in data["quality"]}
    assert gptq["GPTQ fast"] < 0.7 and abs(gptq["GPTQ fast"] - gptq["GPTQ reference (per-column loop)"]) < 0.01
