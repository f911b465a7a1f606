"""Run the mma-layout CUDA kernel (csrc/awq_mma.cu), or with --wgmma the Hopper one (csrc/awq_wgmma.cu), a few times
on one shape, for Nsight Compute:

    ncu --set full -k regex:awq_mma -c 1 python3 bench/mma_profile.py --m 64 --shape 18432x7168
    ncu --set full -k regex:awq_wgmma_kernel -c 1 python3 bench/mma_profile.py --m 1024 --wgmma 128,2,1,8
"""
from __future__ import annotations

import argparse

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=64)
    p.add_argument("--shape", default="18432x7168", help="OCxIC")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--symmetric", action="store_true", help="zero points all 8, not read (as modules dispatch "
                                                             "symmetric checkpoints)")
    p.add_argument("--wgmma", default="", help="block_m,tile_set,splits,group_m[,ws]: run csrc/awq_wgmma.cu instead "
                                            "(ws 1: the producer warp)")
    args = p.parse_args()
    from torchforge.ops._ext import has_cuda_ext
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda, launch_awq_wgmma_cuda
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout

    assert has_cuda_ext(), "the compiled extension (csrc/) did not load"
    oc, ic = map(int, args.shape.split("x"))
    g = args.group_size
    torch.manual_seed(0)
    qw = torch.randint(-2**31, 2**31 - 1, (ic, oc // 8), dtype=torch.int32, device="cuda")
    qz = torch.randint(-2**31, 2**31 - 1, (ic // g, oc // 8), dtype=torch.int32, device="cuda")
    if args.symmetric:
        qz.fill_(0x88888888 - 2**32)
    sc = (torch.rand(ic // g, oc, device="cuda") * 0.01).half()
    mma = awq_to_mma_layout(qw)
    x = torch.randn(args.m, ic, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.iters):
        if args.wgmma:
            bm, tw, splits, gm, *ws = map(int, args.wgmma.split(","))
            launch_awq_wgmma_cuda(x, mma, sc, qz, g, config=(bm, tw, splits, gm, bool(ws and ws[0])))
        else:
            launch_awq_mma_cuda(x, mma, sc, qz, g, symmetric=args.symmetric)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
