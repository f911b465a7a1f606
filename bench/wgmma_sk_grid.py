"""Stream-K of the Hopper W4A16 kernel (csrc/awq_wgmma.cu) on fewer blocks than SMs: the same units shared by
`dp_tiles` blocks, from one block per tile (whole tiles through the stream-K code, no partials) up to one per SM.
If the time per chunk per block stays flat as blocks are added, the kernel scales with SMs and stream-K's cost is its
partials; if it grows, the SMs share something (L2, DRAM, the power budget). Run it on a plain build and on ablation
builds (bench/wgmma_ablation.sh BENCH=bench/wgmma_sk_grid.py) to see which part of the kernel stops scaling.

    python bench/wgmma_sk_grid.py --shapes 18432x7168 --m 16,64,256
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import L2Rotation, bench_graph_ms  # noqa: E402
from w4a16_linear import G, rotated_mma_case  # noqa: E402


def main() -> None:
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda
    from torchforge.ops.awq_wgmma_cost import wgmma_blocks

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="18432x7168")
    ap.add_argument("--m", default="16,64,256")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    print("| W | M | block | blocks | tiles | chunks per block | ms | us per chunk per block |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes, mma, tickets = rotated_mma_case(shape)
        for M in map(int, args.m.split(",")):
            bm = 64 if M <= 64 else 128
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            tiles = wgmma_blocks(M, OC, (bm, 2))
            chunks = IC // 64
            for blocks in sorted({min(tiles, sms), *[b for b in (96, 110, sms) if tiles <= b <= sms or b == sms]}):
                cfg = (bm, 2, 0, 8, True, blocks)
                t = bench_graph_ms(lambda: launch_awq_wgmma_cuda(x, mma, sc, qz, G, config=cfg, tickets=tickets),
                                   rep_ms=50)
                per_block = tiles * chunks / blocks
                print(f"| {shape} | {M} | ({bm}, 2) | {blocks} | {tiles} | {per_block:.1f} | {t:.4f} | "
                      f"{t * 1e3 / per_block:.3f} |", flush=True)
        L2Rotation.stop()


if __name__ == "__main__":
    main()
