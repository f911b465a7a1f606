"""Host time of one eager call of torchforge's W4A16 linear against `F.linear` in bf16, layer by layer of the call.

Why: the eager prefill of the end-to-end model (bench/decode_profile.py --prefill) is host bound, and its W4A16
form took longer than bf16 with fewer kernel microseconds. This splits one `awq_mma_linear` call into what it
costs on the host: the public op (torch.library dispatch + argument checks + dispatch rules + launch), the
registered Python function alone, the dispatch rules alone, the checks alone, and the launcher (config + extension op).

Each row: microseconds per call, back to back for N calls with one synchronize at the end (the host cost when it
exceeds the kernel), and the ratio to `F.linear` on the same shape in the same run. Then the MoE ops' row sort
(`moe_align`): the one-launch Triton kernel against the torch ops, host us (launched as inside the ops, not through
torch's wrap_triton HOP) and CUDA-graph GPU us. bench/moe_align.py times all three of its forms.

    python3 bench/op_host_overhead.py [--shapes 4096x4096,11008x4096] [--ms 1,32] [--calls 2000]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_line, direct_triton_launches, markdown_table  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def graph_us(fn) -> float:
    """GPU microseconds of one call, replayed from a CUDA graph (no host launch cost)."""
    from common import bench_graph_ms

    return bench_graph_ms(fn, rep_ms=50) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096x4096,11008x4096", help="OCxIC,...")
    ap.add_argument("--ms", default="1,32", help="rows of x")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="also cProfile 200 calls of the public op")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/op_host_overhead.py: needs a CUDA device")
        return 0
    import torchforge  # noqa: F401
    from torchforge.ops import awq_mma as mma_ops
    from torchforge.ops.awq import awq_quantize
    from torchforge.ops.awq_mma_cuda import (launch_awq_mma_cuda, launch_awq_wgmma_cuda, mma_cuda_ok, mma_tickets,
                                             wgmma_cuda_ok)
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout

    print(f"{device_line()}, torch {torch.__version__}")
    g = 128
    rows = []
    for shape in args.shapes.split(","):
        oc, ic = map(int, shape.split("x"))
        w = torch.randn(oc, ic, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, sc, qz = awq_quantize(w, g)
        mma = awq_to_mma_layout(qw)
        tickets = mma_tickets(oc, mma.device)
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, ic, device="cuda", dtype=torch.bfloat16)
            use_wgmma = wgmma_cuda_ok(x, mma, sc, qz, g, None)
            launch = launch_awq_wgmma_cuda if use_wgmma else launch_awq_mma_cuda
            impl = getattr(mma_ops._awq_mma_linear, "_init_fn", None)
            cases = {
                "F.linear bf16 (baseline)": lambda: torch.nn.functional.linear(x, w),
                "awq_mma_linear (public op)": lambda: mma_ops.awq_mma_linear(x, mma, sc, qz, g, None, tickets),
                "registered function alone": (lambda: impl(x, mma, sc, qz, g, None, tickets)) if impl else None,
                "checks alone": lambda: mma_ops._check_mma_args(x, mma, sc, qz, g, None),
                "dispatch rules alone": lambda: (wgmma_cuda_ok(x, mma, sc, qz, g, None),
                                                 mma_cuda_ok(x, mma, sc, qz, g, None)),
                f"{launch.__name__} (launcher)": lambda: launch(x, mma, sc, qz, g, None, tickets=tickets),
            }
            base = per_call_us(cases["F.linear bf16 (baseline)"], args.calls)
            for name, fn in cases.items():
                if fn is None:
                    rows.append([shape, m, name, "n/a", ""])
                    continue
                us = base if name.startswith("F.linear") else per_call_us(fn, args.calls)
                rows.append([shape, m, name, f"{us:.1f}", f"{us / base:.2f}"])
    print()
    print(markdown_table(["OCxIC", "M", "call", "us / call", "/ F.linear"], rows))
    # the MoE ops' row sort at the end-to-end model's sizes (65 = 64 experts + the shared one) and DeepSeek-V3's
    # (257): the one-launch Triton kernel against the torch ops (moe_align_ref), host us back to back and GPU us
    # from a CUDA graph
    from torchforge.ops.awq_mma_cuda import moe_sorted_block_rows
    from torchforge.ops.moe_align import moe_align_ref
    from torchforge.ops.moe_align_triton import launch_moe_align_triton

    direct = direct_triton_launches()  # as inside the MoE ops (seventeenth session; the sixteenth went through the HOP)
    print(f"\nmoe_align eager launches: {'direct, as inside an op' if direct else 'through wrap_triton (HOP)'}")

    sort_rows = []
    for experts in (65, 257):
        for tokens in (1, 16, 32, 128, 512, 1820):
            ids = torch.randint(0, experts, (tokens, 9), device="cuda", dtype=torch.int64)
            bm = moe_sorted_block_rows(ids.numel(), experts)
            tri = lambda: launch_moe_align_triton(ids, experts, bm)  # noqa: E731
            ref = lambda: moe_align_ref(ids, experts, bm)  # noqa: E731
            same = all(torch.equal(a, b) for a, b in zip(tri(), ref()))
            host = [per_call_us(f, args.calls // 4) for f in (tri, ref)]
            sort_rows.append([ids.numel(), experts, bm, *(f"{us:.1f}" for us in host),
                              f"{graph_us(tri):.1f}", f"{graph_us(ref):.1f}", "yes" if same else "NO"])
    print()
    print(markdown_table(["rows", "experts", "block rows", "triton host us", "torch ops host us", "triton GPU us",
                          "torch ops GPU us", "same"], sort_rows))
    if args.profile:  # where the public op's host time goes, by own time
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            mma_ops.awq_mma_linear(x, mma, sc, qz, g, None, tickets)
        torch.cuda.synchronize()
        prof.disable()
        print("\ncProfile of 200 public-op calls (last shape and M), by own time:\n")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
