"""A/B of a trial switch of the Hopper W4A16 kernel (csrc/awq_wgmma.cu) that its launcher reads from the environment
at each launch, in one process, device only. The csrc/ of this tree has no such switch: a trial adds one (the
thirtieth session's TORCHFORGE_WGMMA_WORDS_GLOBAL, commit 9726ec7) and is reverted or made the default after.
    python3 bench/wgmma_env_ab.py --env TORCHFORGE_WGMMA_WORDS_GLOBAL --check     (bit-equal outputs, many configs)
    python3 bench/wgmma_env_ab.py --env TORCHFORGE_WGMMA_WORDS_GLOBAL --shapes 18432x7168,7168x7168 --m 256,384
Times: CUDA-graph medians, weights rotated through L2 (common.L2Rotation), bf16 x, fp16 scales, ms; for each M the
dispatched configuration and the --configs ones (block_m x tile_set x splits; splits 0: stream-K).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import L2Rotation, bench_graph_ms, device_line, markdown_table  # noqa: E402
from w4a16_linear import G, rotated_mma_case  # noqa: E402


def _with(env: str, on: bool, fn):
    os.environ[env] = "1" if on else "0"
    try:
        return fn()
    finally:
        os.environ.pop(env, None)


def _config(spec: str) -> tuple:
    bm, tw, splits = map(int, spec.split("x"))
    return (bm, tw, splits, 8, True, 0)


def check(env: str) -> int:
    import torchforge
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, mma_tickets
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout

    bad = n = 0
    configs = [(192, 1, 1, 8, True), (192, 1, 2, 8, True, 0), (192, 1, 0, 8, True, 0), (256, 1, 1, 8, True),
               (256, 1, 0, 8, True, 0), (256, 1, 4, 8, True, 2), (128, 2, 1, 8, True), (64, 2, 0, 8, True, 0)]
    for (nn, k) in [(1280, 1024), (512, 2048), (1088, 1152)]:  # 1088: a last column block group of one block
        w = torch.randn(nn, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, sc, qz = torchforge.ops.awq_quantize(w, group_size=G if k % 128 == 0 else 64)
        g = G if k % 128 == 0 else 64
        mma = awq_to_mma_layout(qw)
        tickets = mma_tickets(nn, mma.device)
        for dtype, scales in [(torch.bfloat16, sc), (torch.float16, sc), (torch.bfloat16, sc.to(torch.bfloat16))]:
            for m in (1, 70, 200, 385):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                for cfg in configs:
                    run = lambda: launch_awq_wgmma_cuda(x, mma, scales, qz, g, config=cfg, tickets=tickets)  # noqa: E731
                    a, b = _with(env, False, run), _with(env, True, run)
                    n += 1
                    if not torch.equal(a, b):
                        bad += 1
                        print("MISMATCH", nn, k, dtype, scales.dtype, m, cfg, (a.float() - b.float()).abs().max().item())
    print(f"check: {bad} mismatches of {n}", flush=True)
    return bad


def bench(env: str, shapes: str, ms: str, extra: str) -> list:
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, wgmma_cuda_config

    rows = []
    for shape in shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes, mma, tickets = rotated_mma_case(shape)
        for M in map(int, ms.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w), rep_ms=50)
            cfgs = [("dispatched", wgmma_cuda_config(M, IC, OC))]
            cfgs += [(spec, _config(spec)) for spec in extra.split(",") if spec]
            for name, cfg in cfgs:
                run = lambda: launch_awq_wgmma_cuda(x, mma, sc, qz, G, config=cfg, tickets=tickets)  # noqa: E731
                t_off = _with(env, False, lambda: bench_graph_ms(run, rep_ms=50))
                t_on = _with(env, True, lambda: bench_graph_ms(run, rep_ms=50))
                rows.append([shape, M, f"{name} {cfg[:3]}", t_bf16, t_off, t_on, t_off / t_on, t_bf16 / t_off,
                             t_bf16 / t_on])
            print("done", shape, M, flush=True)
        L2Rotation.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", required=True)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shapes", default="18432x7168,7168x7168")
    ap.add_argument("--m", default="256,384,512")
    ap.add_argument("--configs", default="", help="extra configurations, e.g. 256x1x1,192x1x0")
    args = ap.parse_args()
    print(device_line())
    if args.check:
        return 1 if check(args.env) else 0
    rows = bench(args.env, args.shapes, args.m, args.configs)
    print(markdown_table(["W", "M", "config", "bf16", "off", "on", "off/on", "bf16/off", "bf16/on"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
