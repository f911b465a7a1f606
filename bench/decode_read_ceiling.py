"""How close the one-row W4A16 decode is to a plain read of the same bytes, in one run on the device.

    python bench/decode_read_ceiling.py [--shapes 18432x7168,7168x7168] [--m 1]

Columns (microseconds, CUDA graphs, every weight rotated through L2 as in w4a16_linear.py):
  op          awq_mma_linear as a module dispatches it on the mma layout (int4 words + fp16 scales, + qzeros
              unless every zero point is 8: awq_quantize's symmetric codes, which the kernel does not read then);
  read        the fastest of a few configurations of a streaming read (Triton, 16-byte loads, one int32 sum per
              program) of the same bytes as the op: what a kernel that only reads them can reach;
  words in decode order   the int4 words alone (96% of the bytes) read as the plain (not prefetching) decode loop
              reads them, without its arithmetic: the K slices, warps per block and item size that
              mma_cuda_launch_config dispatches for the shape and M (3 slices of 4-warp blocks, items of 4 KB, on
              18432x7168 at one row), one round of an item per warp at a time. Where the dispatch takes the
              prefetching loop (7168x7168 at one row: one 8-warp block per column block, two items ahead) this is
              the same grid read one round at a time, not that loop's order;
              `pipelined`: the same with Triton's 3-stage software pipeline (the next rounds in flight);
  bf16 same   F.linear on a bf16 weight of [OC / 4, IC], as many bytes as the int4 words: cuBLAS at that size;
  bf16        F.linear on the bf16 weight [OC, IC] (the goal's baseline).
Bandwidths count the bytes each reads. `op / read` says how much of the read ceiling the kernel leaves, and
`bf16 / read` the best ratio against bf16 that any kernel reading those bytes could show.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from common import L2Rotation, bench_graph_ms, device_line, markdown_table  # noqa: E402

G = 128


def _same_words(out: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the per-program int32 sums `out` add up to the sum of `src` (mod 2^32: the kernels' sums wrap)."""
    return int(out.sum()) % 2**32 == int(src.sum()) % 2**32


@triton.jit
def _read_kernel(src, out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0)
    tl.store(out + pid, tl.sum(acc, axis=0))


@triton.jit
def _read_decode_order_kernel(src, out, n_cb, cb_words, items, SPLITS: tl.constexpr, W: tl.constexpr,
                              ITEM: tl.constexpr, ROUNDS: tl.constexpr):
    # the decode kernel's reads of its words without its arithmetic: program = block (column block cb, K slice),
    # round r = the W items r * SPLITS * W + slice * W .. + W - 1 of that column block (W warps, one item each)
    pid = tl.program_id(0)
    cb, sl = pid % n_cb, pid // n_cb
    offs = tl.arange(0, W * ITEM)
    acc = tl.zeros([W * ITEM], dtype=tl.int32)
    for r in range(ROUNDS):
        first = (r * SPLITS + sl) * W
        acc += tl.load(src + cb * cb_words + first * ITEM + offs, mask=first + offs // ITEM < items, other=0)
    tl.store(out + pid, tl.sum(acc, axis=0))


def read_decode_order_us(words: torch.Tensor, splits: int, warps: int, stages: int, item_chunks: int = 2) -> float:
    """The mma-layout words [N / 64, K * 8] read in the decode kernel's order (splits K slices of warps-warp blocks,
    items of 64 k x item_chunks = 512 x item_chunks words), one round of items at a time (stages 1) or pipelined by
    Triton."""
    n_cb, cb_words = words.shape[0], words.shape[1]
    item = 512 * item_chunks
    items = cb_words // item
    rounds = triton.cdiv(items, splits * warps)
    out = torch.empty(n_cb * splits, dtype=torch.int32, device=words.device)
    f = lambda: _read_decode_order_kernel[(n_cb * splits,)](words, out, n_cb, cb_words, items, SPLITS=splits,  # noqa: E731
                                                             W=warps, ITEM=item, ROUNDS=rounds, num_warps=warps,
                                                             num_stages=stages)
    f()
    torch.cuda.synchronize()
    assert _same_words(out, words), "the decode-order read lost words"
    return 1e3 * bench_graph_ms(f, rep_ms=50)


def read_us(src: torch.Tensor) -> tuple[float, str]:
    """The fastest streaming read of the int32 tensor `src` (rotated by the caller) over a few configurations."""
    n = src.numel()
    best = (float("inf"), "")
    for block, iters, warps in ((1024, 1, 4), (2048, 1, 4), (2048, 2, 8), (4096, 1, 8), (4096, 4, 8),
                                (8192, 1, 8), (8192, 2, 16)):
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, dtype=torch.int32, device=src.device)
        f = lambda: _read_kernel[(grid,)](src, out, n, BLOCK=block, ITERS=iters, num_warps=warps)  # noqa: E731
        f()
        torch.cuda.synchronize()
        assert _same_words(out, src), "the read kernel lost words"
        t = 1e3 * bench_graph_ms(f, rep_ms=50)
        best = min(best, (t, f"{block}x{iters}/{warps}w"))
    return best


def rows(shapes: str, ms: str) -> list:
    import torchforge
    from torchforge.ops.awq_mma import awq_mma_linear
    from torchforge.ops.awq_mma_cuda import mma_cuda_launch_config, mma_tickets
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout
    from torchforge.ops.zero_points import zeros_are_8

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    out = []
    for shape in shapes.split(","):
        OC, IC = map(int, shape.split("x"))
        w = torch.randn(OC, IC, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, sc, qz = torchforge.ops.awq_quantize(w, group_size=G)
        mma, tickets = awq_to_mma_layout(qw), mma_tickets(OC, w.device)
        w_same = torch.randn(OC // 4, IC, device="cuda", dtype=torch.bfloat16) * 0.02
        sym = zeros_are_8(qz)  # what ForgeAWQLinear.zeros_are_8 tells the kernel
        # the op's bytes as one int32 buffer for the read kernel: words, scales (fp16 pairs), qzeros if it reads them
        flat = torch.cat([mma.flatten(), sc.flatten().view(torch.int32)] + ([] if sym else [qz.flatten()]))
        nbytes = flat.numel() * 4
        for M in map(int, ms.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            L2Rotation.start(nbytes, mma, sc, qz)
            t_op = 1e3 * bench_graph_ms(lambda: awq_mma_linear(x, mma, sc, qz, G, tickets=tickets, symmetric=sym),
                                        rep_ms=50)
            L2Rotation.start(nbytes, flat)
            t_read, cfg = read_us(flat)
            L2Rotation.start(mma.numel() * 4, mma)
            splits, chunks, warps, _ = mma_cuda_launch_config(M, IC, OC, G, sms)
            t_order = {st: read_decode_order_us(mma, splits, warps, st, chunks) for st in (1, 3)}
            L2Rotation.start(w_same.numel() * 2, w_same)
            t_same = 1e3 * bench_graph_ms(lambda: torch.nn.functional.linear(x, w_same), rep_ms=50)
            L2Rotation.start(w.numel() * 2, w)
            t_bf16 = 1e3 * bench_graph_ms(lambda: torch.nn.functional.linear(x, w), rep_ms=50)
            L2Rotation.stop()
            tb = lambda b, t: f"{b / t / 1e6:.2f}"  # noqa: E731  bytes / us -> TB/s
            out.append([shape, M, "8" if sym else "read", f"{nbytes / 1e6:.1f}", f"{t_op:.1f}", f"{t_read:.1f}", cfg,
                        f"{t_order[1]:.1f}", f"{t_order[3]:.1f}", f"{splits}/{warps}/{64 * chunks}", f"{t_same:.1f}",
                        f"{t_bf16:.1f}", tb(nbytes, t_op), tb(nbytes, t_read), tb(w_same.numel() * 2, t_same),
                        tb(w.numel() * 2, t_bf16), f"{t_read / t_op:.2f}", f"{t_bf16 / t_op:.2f}x",
                        f"{t_bf16 / t_read:.2f}x"])
            print("done", shape, M, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="18432x7168,7168x7168", help="OCxIC list")
    ap.add_argument("--m", default="1", help="rows of x")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 1
    table = rows(args.shapes, args.m)
    print(f"device: {device_line()}")
    print("\nthe decode kernel against a plain read of its bytes (us, CUDA graphs, weights rotated; TB/s on the bytes "
          "each reads):")
    print(markdown_table(["W", "M", "zeros", "MB read", "op", "read", "read cfg", "words in decode order",
                          "same, pipelined", "order: slices/warps/k", "bf16 same bytes", "bf16", "op TB/s",
                          "read TB/s", "bf16 same TB/s", "bf16 TB/s", "read/op", "bf16/op", "bf16/read"], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
