"""W4A16 layers with group sizes 32, 64 and 128 as a user runs them, against a bf16 matmul, in one run.

    python bench/group_size.py [--shapes 18432x7168,7168x7168] [--groups 32,64,128] [--m 1,16,64,256,1024]

Group size 32 (which vLLM's Marlin takes, GPTQ checkpoints use, and Kimi K2's int4 experts have) used to run on the
AWQ layout's kernels (`w4a16_linear`), and a `ForgeGPTQLinear` of group 32 on the GPTQ layout's own kernel; the mma
layout's decode kernel now takes it (csrc/awq_mma.cuh, item_dq). Columns, ms (medians of CUDA-graph replays, weights
rotated through copies: bench/common.py L2Rotation, bf16 x, fp16 scales), the same random codes in every layer:
- bf16: F.linear on the dequantized weight;
- AWQ layout: a ForgeAWQLinear left on its checkpoint layout (`w4a16_linear`'s kernels);
- AWQ: the same layer after `torchforge.use_mma_layout` (its layout in the `layout` column);
- GPTQ before: a ForgeGPTQLinear on its checkpoint layout (the GPTQ Triton kernel, a scale per row through g_idx);
- GPTQ after: the same layer after `torchforge.use_mma_layout` (mma layout, or the AWQ layout where that does not fit);
- act-order before / after: the same codes with a permuted g_idx (GPTQModel / AutoGPTQ desc_act).
Each timed output is checked against x @ W.T in fp64 (largest relative error of the row printed).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import L2Rotation, bench_graph_ms, device_line, markdown_table  # noqa: E402


def layers(oc: int, ic: int, g: int, gen: torch.Generator) -> dict:
    """{name: module}: the AWQ, GPTQ and act-order GPTQ layers of one set of random codes (each twice for GPTQ: one
    kept on its checkpoint layout)."""
    from torchforge.nn import ForgeAWQLinear
    from torchforge.nn.gptq_linear import ForgeGPTQLinear
    from torchforge.ops.awq import awq_pack
    from torchforge.ops.gptq import gptq_pack, gptq_pack_zeros, trivial_g_idx

    codes = torch.randint(0, 16, (ic, oc), dtype=torch.uint8, generator=gen)
    zeros = torch.randint(1, 16, (ic // g, oc), dtype=torch.uint8, generator=gen)  # GPTQ v1 stores z - 1 >= 0
    scales = (torch.rand(ic // g, oc, generator=gen) * 0.004 + 0.001).half()
    awq = ForgeAWQLinear(ic, oc, group_size=g, device="cuda")
    awq.qweight, awq.qzeros, awq.scales = awq_pack(codes).cuda(), awq_pack(zeros).cuda(), scales.cuda()
    trivial = trivial_g_idx(ic, g)
    shuffled = trivial[torch.randperm(ic, generator=gen)]
    kept = ForgeAWQLinear(ic, oc, group_size=g, device="cuda")
    kept.qweight, kept.qzeros, kept.scales = awq.qweight.clone(), awq.qzeros, awq.scales
    out = {"AWQ layout": kept, "AWQ": awq}
    for name, g_idx in (("GPTQ", trivial), ("act-order", shuffled)):
        for when in ("before", "after"):
            mod = ForgeGPTQLinear(ic, oc, group_size=g, device="cuda")
            mod.qweight, mod.qzeros = gptq_pack(codes).cuda(), gptq_pack_zeros(zeros).cuda()
            mod.scales, mod.g_idx = scales.cuda(), g_idx.cuda()
            out[f"{name} {when}"] = mod
    return out


def weight_tensors(mod) -> list:
    return [mod.qweight, mod.qzeros, mod.scales] + [t for t in (getattr(mod, "act_perm", None),) if t is not None]


def main() -> int:
    import torchforge

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="18432x7168,7168x7168", help="OCxIC list")
    ap.add_argument("--groups", default="32,64,128")
    ap.add_argument("--m", default="1,16,64,256,1024")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/group_size.py: no CUDA device; nothing to measure")
        return 0
    gen = torch.Generator().manual_seed(0)
    ms = [int(m) for m in args.m.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        oc, ic = map(int, shape.split("x"))
        xs = {m: torch.randn(m, ic, device="cuda", dtype=torch.bfloat16) for m in ms}
        for g in map(int, args.groups.split(",")):
            mods = layers(oc, ic, g, gen)
            for name, mod in mods.items():
                if name not in ("AWQ", "AWQ layout") and not name.endswith("before"):
                    torchforge.use_mma_layout(torch.nn.Sequential(mod))
            torchforge.use_mma_layout(torch.nn.Sequential(mods["AWQ"]))
            w = mods["AWQ"].dequantized_weight(torch.bfloat16)
            w64 = {"plain": mods["AWQ"].dequantized_weight().double(),  # fp32 is exact; act-order: other groups
                   "act": mods["act-order before"].dequantized_weight().double()}
            wbytes = sum(t.numel() * t.element_size() for t in weight_tensors(mods["AWQ"]))
            times = {m: {"bf16": bench_graph_ms(lambda x=xs[m], w=w: torch.nn.functional.linear(x, w))} for m in ms}
            err = {m: 0.0 for m in ms}
            for name, mod in mods.items():
                L2Rotation.start(wbytes, *weight_tensors(mod))
                for m in ms:
                    ref = xs[m].double() @ w64["act" if name.startswith("act") else "plain"].T
                    times[m][name] = bench_graph_ms(lambda x=xs[m], mod=mod: mod(x), rep_ms=100)
                    err[m] = max(err[m], float((mod(xs[m]).double() - ref).norm() / ref.norm()))
                L2Rotation.stop()
            layout = {k: mods[k].weight_layout for k in ("AWQ", "GPTQ after", "act-order after")}
            for m in ms:
                t = times[m]
                rows.append([shape, g, m, t["bf16"], t["AWQ layout"], t["AWQ"], layout["AWQ"], t["GPTQ before"],
                             t["GPTQ after"],
                             layout["GPTQ after"], t["act-order before"], t["act-order after"],
                             t["bf16"] / t["AWQ layout"], t["bf16"] / t["AWQ"], t["bf16"] / t["GPTQ before"],
                             t["bf16"] / t["GPTQ after"],
                             t["bf16"] / t["act-order after"], f"{err[m]:.1e}"])
                print("row:", " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
            del mods, w, w64
            torch.cuda.empty_cache()
    print(f"device: {device_line()}")
    print("\nW4A16 layers by group size, ms (CUDA graphs, weights rotated, bf16 x, fp16 scales):")
    print(markdown_table(["W", "G", "M", "bf16", "AWQ layout", "AWQ", "layout", "GPTQ before", "GPTQ after", "layout",
                          "act-order before", "act-order after", "bf16/AWQ layout", "bf16/AWQ", "bf16/GPTQ before",
                          "bf16/GPTQ after",
                          "bf16/act-order after", "max rel err"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
