"""The pipeline example on the trained fixture runs end to end: streamed calibration, prune + GPTQ, export, reload."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prune_and_quantize_example():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "prune_and_quantize.py")],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "routed experts per MoE layer: 32 -> 16" in r.stdout
    assert "reloaded logits identical: True" in r.stdout
    before, after = map(float, re.search(r"perplexity \(per byte\): ([\d.]+) -> ([\d.]+)", r.stdout).groups())
    assert before < 1.3 and before < after < 2.5  # half the experts gone and 4 bits: worse, not broken
