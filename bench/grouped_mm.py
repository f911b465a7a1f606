"""The quantized MoE backward's fp32 grouped GEMM (fp16 / fp32 activations): the Triton kernel over rows sorted by
expert (torchforge/ops/grouped_mm_triton.py) against what ran before it, PyTorch's `torch._grouped_mm` fallback for
fp32 (the offsets copied to the host, one mm per expert), and bf16 `torch._grouped_mm` (CUTLASS on Hopper, what bf16
activations take) for scale, same run. Rows spread over the experts as top-k routing spreads them (random ids).

    python3 bench/grouped_mm.py                   # 2048 rows, 64 experts, DeepSeek-V3's 7168 -> 4096 and 2048 -> 7168
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, device_line, markdown_table  # noqa: E402


def case(rows: int, experts: int, a: int, b: int) -> list:
    from torchforge.ops.grouped_mm_triton import launch_grouped_rows_mm

    ids = torch.sort(torch.randint(0, experts, (rows,), device="cuda")).values
    offs = torch.searchsorted(ids, torch.arange(experts, device="cuda"), right=True).to(torch.int32)
    x = torch.randn(rows, a, device="cuda")
    w = torch.randn(experts, a, b, device="cuda") * 0.02
    new = lambda: launch_grouped_rows_mm(x, w, offs)  # noqa: E731
    old = lambda: torch._grouped_mm(x, w, offs=offs)  # noqa: E731
    xb, wb = x.bfloat16(), w.bfloat16()
    bf16 = lambda: torch._grouped_mm(xb, wb, offs=offs)  # noqa: E731
    x3 = lambda: launch_grouped_rows_mm(x, w, offs, precision="tf32x3")  # noqa: E731  (three TF32 products)
    bounds = [0, *offs.tolist()]  # float64, expert by expert (a bench may loop)
    ref = torch.cat([x[s:e].double() @ w[i].double() for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    rel = [((f().double() - ref).norm() / ref.norm()).item() for f in (old, new, x3)]
    t_new, t_old, t_bf16, t_x3 = (bench_ms(f, warmup_ms=50, rep_ms=300) for f in (new, old, bf16, x3))
    return [f"{rows}x{a} @ {experts}x{a}x{b}", t_old, t_new, t_old / t_new, t_bf16,
            2 * rows * a * b / t_new / 1e9, t_x3, *(f"{r:.1e}" for r in rel)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    args = ap.parse_args()
    out = [case(args.rows, args.experts, a, b) for a, b in ((7168, 4096), (2048, 7168), (4096, 7168))]
    print(device_line())
    print("fp32 grouped GEMM over rows sorted by expert, ms: PyTorch's fallback (before), the Triton kernel (now), "
          "bf16 CUTLASS for scale; relative errors against float64:")
    print(markdown_table(["shape", "fallback ms", "Triton ms", "speedup", "bf16 CUTLASS ms", "Triton TFLOP/s",
                          "Triton tf32x3 ms", "fallback err", "Triton err", "tf32x3 err"], out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
