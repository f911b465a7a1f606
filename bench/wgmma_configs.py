"""Time the Hopper W4A16 kernel (csrc/awq_wgmma.cu) on a few fixed configurations against bf16 in the same run: a
short, repeatable table to compare two builds of the kernel (run it once per build on one machine).

    python3 bench/wgmma_configs.py --shapes 18432x7168,7168x7168 --m 64,256,4096
    python3 bench/wgmma_configs.py --configs 128,2,1,8,1 --m 4096     # block_m,tile_set,splits,group_m,ws[,dp_tiles]

Without --configs each (shape, M) runs the configuration wgmma_cuda_config picks (what the op runs where the time
model sends those rows to this kernel; past 512 rows it dispatches dequantize + cuBLAS instead). Columns: the kernel's
median (CUDA graphs), bf16 `F.linear` in the same run, the ratio, TFLOP/s, and the relative error against the
dequantized weight in fp32.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_graph_ms, device_line, markdown_table  # noqa: E402
from w4a16_linear import G, quantized_case  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="18432x7168,7168x7168", help="OCxIC list")
    ap.add_argument("--m", default="64,256,4096")
    ap.add_argument("--configs", default="", help="';'-separated block_m,tile_set,splits,group_m,ws[,dp_tiles] "
                                                  "(default: the dispatched one per shape and M)")
    ap.add_argument("--label", default="", help="a name for this build, printed in every row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/wgmma_configs.py: no CUDA device; nothing to measure")
        return 0
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, mma_tickets, wgmma_cuda_config
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout
    from torchforge.ops.awq_reference import awq_dequantize_ref
    from torchforge.ops.awq_wgmma_cost import wgmma_blocks

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    fixed = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    rows = []
    for shape in args.shapes.split(","):
        oc, ic, w, qw, sc, qz, _ = quantized_case(shape)
        mma = awq_to_mma_layout(qw)
        wdq = awq_dequantize_ref(qw, sc, qz, G).to(torch.bfloat16).float()
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, ic, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wdq.T
            t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w), rep_ms=50)
            for cfg in fixed or [wgmma_cuda_config(m, ic, oc, sms)]:
                cfg = (*cfg[:4], bool(cfg[4]), *cfg[5:])
                # a kept zeroed buffer with a ticket per tile, as a module keeps one (too few: the op would allocate
                # and zero one on every call, a memset inside the timing)
                need = max(mma_tickets(oc).numel(), wgmma_blocks(m, oc, cfg[:2]))
                tickets = torch.zeros(need, dtype=torch.int32, device=mma.device)
                f = lambda: launch_awq_wgmma_cuda(x, mma, sc, qz, G, config=cfg, tickets=tickets)  # noqa: E731
                rel = ((f().float() - ref).norm() / ref.norm()).item()
                t = bench_graph_ms(f, rep_ms=50)
                rows.append([args.label, shape, m, ",".join(map(str, (*cfg[:4], int(cfg[4]), *cfg[5:]))), t, t_bf16,
                             t_bf16 / t, 2 * m * oc * ic / t / 1e9, f"{rel:.1e}"])
            print("done", shape, m, flush=True)
    print(f"device: {device_line()}")
    print(markdown_table(["build", "W", "M", "config", "ms", "bf16 ms", "bf16/ms", "TFLOP/s", "rel err"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
