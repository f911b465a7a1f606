"""w4a16_linear (AWQ layout, group 128) against a bf16 matmul on DeepSeek-V3 shapes, measured in one run.

    python bench/w4a16_linear.py [--m 1,16,64,256,1024,4096]
Prints a markdown table: median ms of each, the ratio bf16 / w4a16 (>1 means w4a16 is faster), and the
bandwidth achieved on the int4 weight bytes (qweight + scales + qzeros).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import bench_ms, device_line, markdown_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,64,256,1024,4096")
    ap.add_argument("--shapes", default="18432x7168,7168x7168", help="OCxIC list")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/w4a16_linear.py: no CUDA device; nothing to measure")
        return 0
    import torchforge

    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        OC, IC = map(int, shape.split("x"))
        w = torch.randn(OC, IC, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, sc, qz = torchforge.ops.awq_quantize(w, group_size=128)
        wbytes = qw.numel() * 4 + sc.numel() * 2 + qz.numel() * 4
        for M in map(int, args.m.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, torchforge.ops.awq_dequantize(qw, sc, qz, 128).to(x.dtype))
            out = torchforge.ops.w4a16_linear(x, qw, sc, qz, 128)
            rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t_bf16 = bench_ms(lambda: torch.nn.functional.linear(x, w))
            t_w4 = bench_ms(lambda: torchforge.ops.w4a16_linear(x, qw, sc, qz, 128))
            rows.append([f"{OC}x{IC}", M, t_bf16, t_w4, t_bf16 / t_w4, wbytes / t_w4 / 1e6, f"{rel:.1e}"])
    print(f"device: {device_line()}")
    print(markdown_table(["W [OC x IC]", "M", "bf16 ms", "w4a16 ms", "speedup vs bf16", "int4 GB/s", "rel err"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
