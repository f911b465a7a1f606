"""One DeepSeek-V3 MoE layer (256 experts of 7168 x 2048, top-8): W4A16 experts vs HF's bf16 experts.

    python bench/moe_w4a16.py [--m 1,8,64,512] [--experts 256]
Baseline: transformers' DeepseekV3Experts in bf16 with `_experts_implementation = "grouped_mm"` (its
fastest path; falls back to the default loop if this transformers lacks it), measured in the same run.
Ours: ForgeAWQExperts (group 128), expert-sorted Triton grouped GEMMs. Times: eager medians (both sides
launch from Python) and, where capture works, CUDA-graph medians. `floor` is the int4 bytes of the
experts actually hit over the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    bench_graph_ms, bench_ms, copy_bandwidth_gbs, deepseek_v3_hf_experts, device_line, markdown_table,
    quantize_experts_chunked)


def sweep(q, E: int, H: int, I: int, K: int) -> list:
    from torchforge.ops.awq_moe_triton import launch_awq_moe_gemm

    out = []
    for M in (1, 8, 64):
        ids = torch.rand(M, E, device="cuda").topk(K, dim=-1).indices.flatten()
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(M * K, I, device="cuda", dtype=torch.bfloat16)
        gemms = {"gate_up": (x, q.gate_up_qweight, q.gate_up_scales, q.gate_up_qzeros, K),
                 "down": (h, q.down_qweight, q.down_scales, q.down_qzeros, 1)}
        for name, (a, qw, sc, qz, div) in gemms.items():
            for bn in (64, 128):
                for bk in (64, 128):
                    for nw in (4, 8):
                        for ns in (3, 4):
                            f = lambda: launch_awq_moe_gemm(a, ids, qw, sc, qz, 128, x_row_div=div,  # noqa: E731
                                                            block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                            out.append([M, name, bn, bk, nw, ns, bench_graph_ms(f, rep_ms=30)])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,8,64,512")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--sweep", action="store_true", help="time the grouped GEMMs over tile configs (M = 1, 8, 64)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/moe_w4a16.py: no CUDA device; nothing to measure")
        return 0
    import torchforge
    from torchforge.nn import ForgeAWQExperts

    E, H, I, K = args.experts, 7168, 2048, 8
    torch.manual_seed(0)
    # hf_deq: the same module on our dequantized weights, the accuracy oracle
    (hf, hf_deq), impl = deepseek_v3_hf_experts(E, H, I, K, copies=2)
    chunk = 16
    q = quantize_experts_chunked(
        lambda n: ForgeAWQExperts(n, H, I, group_size=128, act_fn=hf.act_fn, device="cuda"), hf, chunk)
    with torch.no_grad():
        for i in range(0, E, chunk):  # chunked: the reference dequantizer's temporaries are large
            sl = slice(i, i + chunk)
            hf_deq.gate_up_proj.data[sl] = torchforge.ops.awq_dequantize(
                q.gate_up_qweight[sl], q.gate_up_scales[sl].float(), q.gate_up_qzeros[sl], 128).bfloat16()
            hf_deq.down_proj.data[sl] = torchforge.ops.awq_dequantize(
                q.down_qweight[sl], q.down_scales[sl].float(), q.down_qzeros[sl], 128).bfloat16()
    torch.cuda.empty_cache()
    per_expert_int4 = (H * 2 * I + I * H) // 2 + (H // 128 * 2 * I + I // 128 * H) * (2 + 0.5)
    bw = copy_bandwidth_gbs(1 << 30)
    rows = []
    for M in map(int, args.m.split(",")):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        scores = torch.rand(M, E, device="cuda")
        w, ids = scores.topk(K, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).float()
        with torch.no_grad():
            ref = hf(x, ids, w)
            out = q(x, ids, w)
            deq_ref = hf_deq(x, ids, w)
        rel = ((out.float() - deq_ref.float()).norm() / deq_ref.float().norm()).item()
        hit = ids.unique().numel()
        floor_ms = hit * per_expert_int4 / bw / 1e6  # the bytes read, at the measured copy rate (read + write)
        f_hf = lambda: hf(x, ids, w)  # noqa: E731
        f_q = lambda: q(x, ids, w)  # noqa: E731
        with torch.no_grad():
            t_hf, t_q = bench_ms(f_hf), bench_ms(f_q)
            try:
                g_hf = bench_graph_ms(f_hf)
            except Exception:  # noqa: BLE001
                g_hf = float("nan")
            try:
                g_q = bench_graph_ms(f_q)
            except Exception:  # noqa: BLE001
                g_q = float("nan")
        rows.append([M, hit, t_hf, t_q, t_hf / t_q, g_hf, g_q, g_hf / g_q, floor_ms,
                     floor_ms / (g_q if g_q == g_q else t_q), f"{rel:.1e}"])
        torch.cuda.empty_cache()
    if args.sweep:
        print("grouped GEMM tile sweep (CUDA graph ms; BLOCK_M from moe_block_m):")
        print(markdown_table(["M", "GEMM", "BLOCK_N", "BLOCK_K", "warps", "stages", "ms"], sweep(q, E, H, I, K)))
    print(f"device: {device_line()}; copy bandwidth {bw:.0f} GB/s (read+write); HF experts impl: {impl}")
    print(markdown_table(["M tokens", "experts hit", "HF bf16 ms", "W4A16 ms", "speedup", "HF bf16 graph ms",
                          "W4A16 graph ms", "graph speedup", "int4 floor ms", "% of floor", "rel err vs dequant"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
