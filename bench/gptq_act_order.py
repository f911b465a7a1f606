"""An act-order GPTQ layer (a permuted g_idx, as GPTQModel / AutoGPTQ write with desc_act) before and after
`use_mma_layout()`, against a bf16 matmul, in one run.

    python bench/gptq_act_order.py [--shapes 18432x7168,7168x7168] [--m 1,16,64,256,1024]

Columns, ms (medians of CUDA-graph replays, weights rotated through copies: bench/common.py L2Rotation, bf16 x):
bf16 F.linear; the ForgeGPTQLinear on its checkpoint layout (the GPTQ Triton kernel, g_idx read per row: all an
act-order layer could run before); the same layer on the mma layout (rows sorted by group, x permuted on each call,
then the AWQ mma kernels); the same codes without act-order on the mma layout (no permutation: what the gather
costs); ratios to bf16; relative error of the mma-layout output against x @ W.T in fp64.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import L2Rotation, bench_graph_ms, device_line, markdown_table  # noqa: E402

G = 128


def gptq_layers(oc: int, ic: int, gen: torch.Generator):
    """(act-order ForgeGPTQLinear, the same codes with k // G groups), random codes, zero points and scales."""
    from torchforge.nn.gptq_linear import ForgeGPTQLinear
    from torchforge.ops.gptq import gptq_pack, gptq_pack_zeros, trivial_g_idx

    codes = torch.randint(0, 16, (ic, oc), dtype=torch.uint8, generator=gen)
    zeros = torch.randint(1, 16, (ic // G, oc), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(ic // G, oc, generator=gen) * 0.004 + 0.001).half()
    trivial = trivial_g_idx(ic, G)
    layers = []
    for g_idx in (trivial[torch.randperm(ic, generator=gen)], trivial):
        mod = ForgeGPTQLinear(ic, oc, group_size=G, device="cuda")
        mod.qweight, mod.qzeros = gptq_pack(codes).cuda(), gptq_pack_zeros(zeros).cuda()
        mod.scales, mod.g_idx = scales.cuda(), g_idx.cuda()
        layers.append(mod)
    return layers


def kernel_sweep(shapes: str, ms: str) -> list:
    """The GPTQ layout's own Triton kernel (what a ForgeGPTQLinear runs before use_mma_layout, and where the mma layout
    does not fit) over tile, stage and K-slice configurations, act-order and not."""
    from torchforge.ops.gptq_triton import launch_w4a16_gptq_linear

    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in shapes.split(","):
        oc, ic = map(int, shape.split("x"))
        act, plain = gptq_layers(oc, ic, gen)
        for m in map(int, ms.split(",")):
            x = torch.randn(m, ic, device="cuda", dtype=torch.bfloat16)
            w = act.dequantized_weight(torch.bfloat16)
            t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w))
            if m <= 16:  # (block_m, block_n, block_k, warps, stages, split_k); None: gptq_split_k
                configs = [(16, 64, 64, 4, 4, 1), (16, 64, 64, 4, 1, 1), (16, 64, 64, 4, 1, None),
                           (16, 64, 64, 4, 2, None), (16, 64, 64, 4, 1, 4), (16, 64, 64, 4, 1, 8),
                           (16, 32, 64, 2, 1, None), (16, 64, 128, 4, 1, None), (16, 128, 64, 4, 1, None),
                           (16, 64, 32, 4, 1, None), (16, 128, 128, 8, 1, None)]
            else:
                bm = 64 if m <= 64 else 128
                configs = [(bm, 128, 64 if m <= 64 else 32, 4, 4, None)] + [
                    (bm, bn, bk, w, st, None) for bn in (64, 128) for bk in (32, 64) for w in (4, 8) for st in (1, 2)]
            for name, mod in (("act-order", act), ("k // G", plain)):
                args = (x, mod.qweight, mod.scales, mod.qzeros, mod.g_idx)
                for bm, bn, bk, warps, stages, split in configs:
                    kw = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split)
                    t = bench_graph_ms(lambda: launch_w4a16_gptq_linear(*args, **kw), rep_ms=30)
                    rows.append([shape, m, name, bm, bn, bk, warps, stages, split or "auto", t, t_bf16 / t])
                print("row:", rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="18432x7168,7168x7168", help="OCxIC list")
    ap.add_argument("--m", default="1,16,64,256,1024")
    ap.add_argument("--kernel-sweep", default="", help="M list: time the GPTQ layout kernel's configurations")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gptq_act_order.py: no CUDA device; nothing to measure")
        return 0
    if args.kernel_sweep:
        rows = kernel_sweep(args.shapes, args.kernel_sweep)
        print(f"device: {device_line()}")
        print("\nGPTQ layout kernel (w4a16_gptq_linear's Triton kernel), ms (CUDA graphs, no rotation):")
        print(markdown_table(["W", "M", "g_idx", "block_m", "block_n", "block_k", "warps", "stages", "split_k", "ms",
                              "bf16/ms"], rows))
        return 0
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        oc, ic = map(int, shape.split("x"))
        act, plain = gptq_layers(oc, ic, gen)
        w = act.dequantized_weight(torch.bfloat16)
        wbytes = act.qweight.numel() * 4 + act.scales.numel() * 2 + act.qzeros.numel() * 4
        ms = [int(m) for m in args.m.split(",")]
        xs = {m: torch.randn(m, ic, device="cuda", dtype=torch.bfloat16) for m in ms}
        L2Rotation.start(wbytes, w, act.qweight, act.qzeros, act.scales)
        before = {m: bench_graph_ms(lambda: act(xs[m])) for m in ms}
        L2Rotation.stop()
        assert act.use_mma_layout() and act.act_perm is not None and plain.use_mma_layout()
        L2Rotation.start(wbytes, w, act.qweight, act.qzeros, act.scales, plain.qweight, plain.qzeros, plain.scales)
        for m in ms:
            x = xs[m]
            ref = x.double() @ act.dequantized_weight(torch.float64).T
            rel = float((act(x).double() - ref).norm() / ref.norm())
            t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w))
            t_act = bench_graph_ms(lambda: act(x))
            t_plain = bench_graph_ms(lambda: plain(x))
            rows.append([shape, m, t_bf16, before[m], t_act, t_plain, t_bf16 / before[m], t_bf16 / t_act,
                         t_act / t_plain, f"{rel:.1e}"])
            print("row:", " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
        L2Rotation.stop()
    print(f"device: {device_line()}")
    print("\nAct-order GPTQ layer, ms: bf16; GPTQ layout (before use_mma_layout); mma layout with the x permutation; "
          "the same codes without act-order on the mma layout:")
    print(markdown_table(["W", "M", "bf16", "GPTQ layout", "mma, act-order", "mma, no act-order", "bf16/GPTQ layout",
                          "bf16/mma act-order", "act-order/no act-order", "rel err"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
