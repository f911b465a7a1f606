"""SM clock and board power while one op runs back to back: is a W4A16 call power-limited where bf16 is not?

    python bench/power_probe.py [--shapes 18432x7168,7168x7168] [--m 16,64,256] [--seconds 1.5]

For each shape and row count, a CUDA graph of one call per weight copy (the L2 rotation of bench/common.py: every
call reads its weights from DRAM) is replayed for `--seconds`, for bf16 F.linear and for awq_mma_linear as dispatched,
while `nvidia-smi -lms 20` samples the SM clock and the board power. Prints the medians over the replay, the time
per call, and the power limit. The thirty-fourth session's question: the Hopper kernel's copies alone and its compute
alone each take about 60% of its time at 64 rows (BENCHMARKS.md, twenty-fifth session), yet together they barely
overlap; a clock that drops when both run would be one reason.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import L2Rotation, device_line, markdown_table  # noqa: E402
from w4a16_linear import G, rotated_mma_case  # noqa: E402


def _graph_over_copies(fn) -> torch.cuda.CUDAGraph:
    """One graph calling fn once per copy of the active rotation (each launch keeps the copy it was captured with)."""
    rot = L2Rotation.active
    copies = rot.copies if rot is not None and rot.entries else 1
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(copies):
            if rot is not None:
                rot.advance()
            fn()
    if rot is not None:
        rot.restore()
    g.calls = copies
    return g


def _sampled(g: torch.cuda.CUDAGraph, seconds: float) -> tuple[float, float, float, float]:
    """(us per call, median SM MHz, median W, power limit W) over `seconds` of back-to-back replays of g."""
    g.replay()
    torch.cuda.synchronize()
    reps = 1
    while True:  # replays per timed burst: about 0.1 s
        t0 = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 > 0.1:
            break
        reps *= 2
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,power.limit", "--format=csv,noheader,nounits",
             "-i", str(torch.cuda.current_device()), "-lms", "20"]
    smi = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)  # let the sampler start before the load
    start, ev0, ev1 = time.perf_counter(), torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    n = 0
    while time.perf_counter() - start < seconds:
        for _ in range(reps):
            g.replay()
        n += reps
        torch.cuda.synchronize()
    ev1.record()
    torch.cuda.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    rows = [list(map(float, line.split(","))) for line in out.strip().splitlines() if line.count(",") == 2]
    rows = rows[len(rows) // 5:]  # skip the ramp
    us = ev0.elapsed_time(ev1) * 1e3 / (n * g.calls)
    return (us, statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows),
            statistics.median(r[2] for r in rows))


def main() -> None:
    from torchforge.ops.awq_mma import awq_mma_linear

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="18432x7168,7168x7168")
    ap.add_argument("--m", default="16,64,256")
    ap.add_argument("--seconds", type=float, default=1.5)
    args = ap.parse_args()
    print(device_line())
    rows = []
    for shape in args.shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes, mma, tickets = rotated_mma_case(shape)
        for M in map(int, args.m.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            for name, fn in (("bf16", lambda: torch.nn.functional.linear(x, w)),
                             ("w4a16", lambda: awq_mma_linear(x, mma, sc, qz, G, tickets=tickets))):
                us, mhz, watts, limit = _sampled(_graph_over_copies(fn), args.seconds)
                rows.append([shape, M, name, us, mhz, watts, limit])
    L2Rotation.stop()
    print(markdown_table(["W", "M", "op", "us per call", "SM MHz (median)", "board W (median)", "power limit W"], rows))


if __name__ == "__main__":
    main()
