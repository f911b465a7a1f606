"""awq_dequantize (and nvfp4_dequantize, gptq_dequantize) on CUDA (one Triton launch for a stack of experts, straight into the compute dtype) against what the
op did before the twenty-eighth session: the pure-PyTorch reference, a bounded chunk of experts at a time (its
temporaries are about 20 bytes a weight), then a cast. This is the dequantization the quantized MoE backward
(`torchforge/ops/moe_autograd.py`) and the dense W4A16 backward run on every call. Also the device-to-device copy
bandwidth in the same run, and the Triton pass's bandwidth (int4 + scales read, bf16 written).

    python3 bench/awq_dequantize.py                      # DeepSeek-V3 experts (256 x gate_up, 256 x down), 18432x7168
    python3 bench/awq_dequantize.py --experts 32
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_bandwidth_gbs, device_line, markdown_table  # noqa: E402

G = 128
CHUNK_WEIGHTS = 1 << 26  # the reference path's chunk (moe_autograd._CHUNK_WEIGHTS)
SWEEP = False


def random_awq(e: int, oc: int, ic: int):
    """Random AWQ tensors of e experts [oc, ic] (codes and zeros uniform, scales ~ 0.01): what the dequantization
    reads, without quantizing 7.5 G weights first."""
    qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, ic, oc // 8), dtype=torch.int32, device="cuda")
    s = (torch.rand(e, ic // G, oc, device="cuda") * 0.02 + 1e-3).half()
    z = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, ic // G, oc // 8), dtype=torch.int32, device="cuda")
    return qw, s, z


def time_case(name: str, e: int, oc: int, ic: int) -> list:
    import torchforge
    from torchforge.ops._chunks import map_leading_chunks
    from torchforge.ops.awq_reference import awq_dequantize_ref

    qw, s, z = random_awq(e, oc, ic)
    new = lambda: torchforge.ops.awq_dequantize(qw, s, z, G, torch.bfloat16)  # noqa: E731
    old = lambda: map_leading_chunks(  # noqa: E731
        lambda q, s_, z_: awq_dequantize_ref(q, s_.float(), z_, G).to(torch.bfloat16), (qw, s, z), (oc, ic),
        ic * oc, CHUNK_WEIGHTS, torch.bfloat16)
    if e * oc * ic <= 1 << 28:  # same bits (checked on the smaller cases; the big ones take seconds in the reference)
        assert torch.equal(new(), old())
    t_new = bench_ms(new, warmup_ms=50, rep_ms=300)
    t_old = bench_ms(old, warmup_ms=50, rep_ms=300)
    nbytes = e * oc * ic * (0.5 + 2) + s.numel() * 2 + z.numel() * 4
    row = [name, f"{e}x{oc}x{ic}", t_old, t_new, t_old / t_new, nbytes / t_new / 1e6]
    if SWEEP:  # the W-form launch's tile rows (k, contiguous in W) and warps
        from torchforge.ops.awq_dequant_triton import _launch
        for bk, warps in ((32, 8), (64, 4), (64, 8), (128, 8)):
            t = bench_ms(lambda: _launch(qw, s, z, G, torch.bfloat16, False, bk, warps), warmup_ms=50, rep_ms=300)
            row.append(f"{t:.3f}")
    return row


def time_nvfp4_case(name: str, e: int, n: int, k: int) -> list:
    """nvfp4_dequantize the same way: its Triton launch against the reference in chunks (before)."""
    import torchforge
    from torchforge.ops._chunks import map_leading_chunks
    from torchforge.ops.nvfp4_reference import nvfp4_dequantize_ref

    p = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
    s = (torch.rand(e, n, k // 16, device="cuda") * 400 + 1).to(torch.float8_e4m3fn)
    ws2 = torch.rand(e, device="cuda") * 1e-3
    new = lambda: torchforge.ops.nvfp4_dequantize(p, s, ws2, torch.bfloat16)  # noqa: E731
    old = lambda: map_leading_chunks(  # noqa: E731
        lambda p_, s_, g_: nvfp4_dequantize_ref(p_, s_, g_, torch.float32).to(torch.bfloat16), (p, s, ws2), (n, k),
        n * k, CHUNK_WEIGHTS, torch.bfloat16)
    if e * n * k <= 1 << 28:
        assert torch.equal(new(), old())
    t_new = bench_ms(new, warmup_ms=50, rep_ms=300)
    t_old = bench_ms(old, warmup_ms=50, rep_ms=300)
    nbytes = e * n * k * (0.5 + 2) + s.numel()
    return [name, f"{e}x{n}x{k}", t_old, t_new, t_old / t_new, nbytes / t_new / 1e6] + ([""] * 4 if SWEEP else [])


def time_gptq_case(name: str, oc: int, ic: int) -> list:
    """gptq_dequantize (act-order g_idx) the same way: its Triton launch against the reference, in fp32 as the GPTQ
    linear's backward asks for it."""
    import torchforge
    from torchforge.ops.gptq_reference import gptq_dequantize_ref

    qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (ic // 8, oc), dtype=torch.int32, device="cuda")
    s = torch.rand(ic // G, oc, device="cuda") * 0.02 + 1e-3
    z = torch.randint(-2 ** 31, 2 ** 31 - 1, (ic // G, oc // 8), dtype=torch.int32, device="cuda")
    g_idx = (torch.arange(ic, device="cuda") // G)[torch.randperm(ic, device="cuda")].int()
    new = lambda: torchforge.ops.gptq_dequantize(qw, s, z, g_idx)  # noqa: E731
    old = lambda: gptq_dequantize_ref(qw, s, z, g_idx)  # noqa: E731
    assert torch.equal(new(), old())
    t_new = bench_ms(new, warmup_ms=50, rep_ms=300)
    t_old = bench_ms(old, warmup_ms=50, rep_ms=300)
    nbytes = oc * ic * (0.5 + 4) + s.numel() * 4 + z.numel() * 4
    return [name, f"{oc}x{ic}", t_old, t_new, t_old / t_new, nbytes / t_new / 1e6] + ([""] * 4 if SWEEP else [])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--sweep", action="store_true", help="also time the Triton launch's other tile shapes")
    args = ap.parse_args()
    global SWEEP
    SWEEP = args.sweep
    rows = []
    for name, e, oc, ic in [("gate_up", args.experts, 4096, 7168), ("down", args.experts, 7168, 2048),
                            ("dense", 1, 18432, 7168)]:
        rows.append(time_case(name, e, oc, ic))
        torch.cuda.empty_cache()
    rows.append(time_gptq_case("GPTQ dense, act order, to fp32", 18432, 7168))
    torch.cuda.empty_cache()
    for name, e, n, k in [("nvfp4 gate_up", args.experts, 4096, 7168), ("nvfp4 down", args.experts, 7168, 2048)]:
        rows.append(time_nvfp4_case(name, e, n, k))
        torch.cuda.empty_cache()
    print(device_line())
    print(f"device-to-device copy: {copy_bandwidth_gbs(1 << 30):.0f} GB/s")
    print("awq_dequantize / gptq_dequantize / nvfp4_dequantize to bf16 (GPTQ: fp32), ms: the reference (in chunks of "
          "2^26 weights for the stacks) before, against the Triton launch:")
    extra = ["k32 w8 ms", "k64 w4 ms", "k64 w8 ms", "k128 w8 ms"] if SWEEP else []
    print(markdown_table(["weights", "shape", "reference ms", "Triton ms", "speedup", "Triton GB/s", *extra], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
