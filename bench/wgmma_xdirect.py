"""The Hopper W4A16 kernel (csrc/awq_wgmma.cu) with x copied by its producer warpgroup (TORCHFORGE_WGMMA_XDIRECT=1:
4-byte cp.async into the x image's order, no x image kernel) against the x image path, same call, device only:
    python3 bench/wgmma_xdirect.py --check            (every block shape, K slices and stream-K: bit-equal outputs)
    python3 bench/wgmma_xdirect.py --shapes 18432x7168,7168x7168 --m 256,384,512,4096
Times: CUDA-graph medians, weights rotated through L2 (common.L2Rotation), bf16 x, fp16 scales, ms.
(A trial: the kernel change was reverted after one run, BENCHMARKS.md "thirtieth session".)
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import L2Rotation, bench_graph_ms, device_line, markdown_table  # noqa: E402
from w4a16_linear import G, quantized_case  # noqa: E402

ENV = "TORCHFORGE_WGMMA_XDIRECT"


def _with(xd: bool, fn):
    os.environ[ENV] = "1" if xd else "0"
    try:
        return fn()
    finally:
        os.environ.pop(ENV, None)


def check() -> int:
    import torchforge
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, mma_tickets
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout

    bad = 0
    configs = [(64, 2, 1, 8, True), (64, 2, 3, 8, True, 0), (128, 2, 0, 8, True, 0), (128, 2, 1, 8, True),
               (192, 1, 1, 8, True), (192, 1, 2, 8, True, 0), (256, 1, 0, 8, True, 0), (256, 1, 4, 8, True, 2)]
    for (n, k) in [(1280, 1024), (512, 2048)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, sc, qz = torchforge.ops.awq_quantize(w, group_size=G)
        mma = awq_to_mma_layout(qw)
        tickets = mma_tickets(n, mma.device)
        for dtype, scales in [(torch.bfloat16, sc), (torch.float16, sc), (torch.bfloat16, sc.to(torch.bfloat16))]:
            for m in (1, 70, 200, 385):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                for cfg in configs:
                    run = lambda: launch_awq_wgmma_cuda(x, mma, scales, qz, G, config=cfg, tickets=tickets)  # noqa: E731
                    a, b = _with(False, run), _with(True, run)
                    ok = torch.equal(a, b)
                    bad += not ok
                    if not ok:
                        print("MISMATCH", n, k, dtype, scales.dtype, m, cfg, (a.float() - b.float()).abs().max().item())
    print(f"check: {bad} mismatches", flush=True)
    return bad


def bench(shapes: str, ms: str) -> list:
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, mma_tickets, wgmma_cuda_config, wgmma_rows_ok
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout

    rows = []
    for shape in shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes = quantized_case(shape)
        mma = awq_to_mma_layout(qw)
        L2Rotation.start(wbytes, w, qw, sc, qz, mma)
        tickets = mma_tickets(OC, mma.device)
        for M in map(int, ms.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            cfg = wgmma_cuda_config(M, IC, OC)
            t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w), rep_ms=50)
            run = lambda: launch_awq_wgmma_cuda(x, mma, sc, qz, G, config=cfg, tickets=tickets)  # noqa: E731
            t_img = _with(False, lambda: bench_graph_ms(run, rep_ms=50))
            t_xd = _with(True, lambda: bench_graph_ms(run, rep_ms=50))
            rows.append([shape, M, str(cfg[:3]) + ("" if wgmma_rows_ok(M, IC, OC) else " (not dispatched)"), t_bf16,
                         t_img, t_xd, t_img / t_xd, t_bf16 / t_img, t_bf16 / t_xd])
            print("done", shape, M, flush=True)
        L2Rotation.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shapes", default="18432x7168,7168x7168")
    ap.add_argument("--m", default="256,384,512,4096")
    args = ap.parse_args()
    print(device_line())
    if args.check:
        return 1 if check() else 0
    rows = bench(args.shapes, args.m)
    print(markdown_table(["W", "M", "config", "bf16", "x image", "x direct", "image/direct", "bf16/image",
                          "bf16/direct"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
