"""Where one call of the Hopper W4A16 kernel spends its time, block by block (a TORCHFORGE_WGMMA_TIMELINE=1 build only).

    ABLATIONS="TORCHFORGE_WGMMA_TIMELINE=1" BENCH=bench/wgmma_timeline.py \
        SWEEP_ARGS="--cases 18432x7168:64,18432x7168:64:64x2x1" bash bench/wgmma_ablation.sh

Each case "OCxIC:M[:BMxTWxSPLITS]" (the dispatched configuration without the third part) runs once eagerly in a child
process, after a warm-up, on a weight copy that is not in L2 (the rotation of bench/common.py). Thread 0 of every block
prints its start, its PDL wait, its main loops' and epilogues' cycles and its end (csrc/awq_wgmma.cu, "TL" lines); this
script summarizes them: the kernel's span from the first start to the last end, and per block (median and slowest)
the cycles before the wait ends (the x image kernel and the launch), in the main loops, per 64-k stage, and after them
(partials, their reduction, the output). Without the build flag it prints that there is no timeline.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))


def child(case: str) -> None:
    import torch

    from common import L2Rotation
    from w4a16_linear import G, rotated_mma_case
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, wgmma_cuda_config

    shape, m, *cfg = case.split(":")
    OC, IC, w, qw, sc, qz, wbytes, mma, tickets = rotated_mma_case(shape)
    M = int(m)
    x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if cfg:
        bm, tw, splits = map(int, cfg[0].split("x"))
        config = (bm, tw, splits, 8, True)
    else:
        config = wgmma_cuda_config(M, IC, OC, sms, 0)
    run = lambda: launch_awq_wgmma_cuda(x, mma, sc, qz, G, config=config, tickets=tickets)  # noqa: E731
    run()
    torch.cuda.synchronize()
    sys.stdout.flush()
    print("CONFIG", config, flush=True)
    print("MEASURED", flush=True)
    L2Rotation.active.advance()  # a copy of the weights not read since its own warm-up call
    run()
    torch.cuda.synchronize()


def summarize(case: str, out: str) -> list:
    lines = out.split("MEASURED", 1)[-1].splitlines()
    config = next((ln.split(" ", 1)[1] for ln in out.splitlines() if ln.startswith("CONFIG")), "?")
    rows = []
    for ln in lines:
        if ln.startswith("TL "):
            _, bid, t0, t1, wait, loops, epi, total, segs, chunks = ln.split()
            rows.append(dict(bid=int(bid), t0=int(t0), t1=int(t1), wait=int(wait), loops=int(loops), epi=int(epi),
                             total=int(total), segs=int(segs), chunks=int(chunks)))
    if not rows:
        return [[case, config, "no timeline (build without TORCHFORGE_WGMMA_TIMELINE)"] + [""] * 8]
    span_us = (max(r["t1"] for r in rows) - min(r["t0"] for r in rows)) / 1e3
    ghz = statistics.median(r["total"] / max(1, r["t1"] - r["t0"]) for r in rows)

    def med_max(key, per_chunk=False):
        vals = [r[key] / max(1, r["chunks"]) if per_chunk else r[key] for r in rows]
        return f"{statistics.median(vals):.0f} / {max(vals):.0f}"

    return [[case, config, len(rows), f"{span_us:.1f}", f"{ghz:.2f}", med_max("wait"), med_max("loops"),
             med_max("loops", per_chunk=True), med_max("epi"), med_max("total"),
             f"{statistics.median(r['chunks'] for r in rows):.0f}, {statistics.median(r['segs'] for r in rows):.0f}"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="18432x7168:64")
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    from common import markdown_table

    table = []
    for case in args.cases.split(","):
        proc = subprocess.run([sys.executable, __file__, "--child", case], capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-2000:])
        table += summarize(case, proc.stdout)
    print(markdown_table(["case", "config", "blocks", "span us", "GHz", "cycles to the wait's end (median / max)",
                          "main loop cycles", "per stage", "after the loops", "block total", "stages, segments"],
                         table))


if __name__ == "__main__":
    main()
