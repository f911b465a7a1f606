"""One DeepSeek-V3 MoE layer (256 experts of 7168 x 2048, top-8): NVFP4 experts vs HF's bf16 experts.

    python bench/nvfp4_moe.py [--m 1,8,64,512] [--experts 256] [--no-awq] [--w4a4] [--sweep]

Baseline: transformers' DeepseekV3Experts in bf16 with `_experts_implementation = "grouped_mm"` where this
transformers has it (else its default loop), built directly on the GPU with random weights, measured in the same
run. Ours: NVFP4Experts (ModelOpt NVFP4, W4A16 compute on Hopper: FP4 x E4M3 dequantized in registers, on-device
expert sort, one grouped Triton GEMM per projection). Also, where it fits, ForgeAWQExperts (W4A16 AWQ, group
128) for the ratio to the W4A16 MoE kernel. Times: eager medians and CUDA-graph medians (GPU time without
host launch gaps). `floor` = NVFP4 bytes (codes + fp8 scales) of the experts hit / measured copy bandwidth.
`rel err` compares NVFP4Experts with the same math on its dequantized weights (a per-expert loop oracle).
Needs about 36 GB of GPU memory with the AWQ comparison, 30 GB without. Exits 0 without a GPU.
`--sweep` also times each grouped GEMM alone over a grid of tile configurations (the defaults in
`torchforge.ops.nvfp4_triton.grouped_config` were chosen without a GPU).
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


def _graph_ms(fn) -> float:
    try:
        return bench_graph_ms(fn)
    except Exception:  # noqa: BLE001  (a path that cannot be captured)
        torch.cuda.synchronize()
        return float("nan")


@torch.no_grad()
def _oracle(q, x, ids, w):
    """HF's expert loop on NVFP4Experts' dequantized weights (bf16), one hit expert at a time."""
    from torchforge.ops import nvfp4_dequantize

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, pos = (ids == e).nonzero(as_tuple=True)
        gu = nvfp4_dequantize(q.gate_up_weight[e], q.gate_up_weight_scale[e], q.gate_up_weight_scale_2[e], torch.bfloat16)
        dn = nvfp4_dequantize(q.down_weight[e], q.down_weight_scale[e], q.down_weight_scale_2[e], torch.bfloat16)
        gate, up = torch.nn.functional.linear(x[tok], gu).chunk(2, dim=-1)
        h = torch.nn.functional.linear(q.act_fn(gate) * up, dn)
        out.index_add_(0, tok, h.float() * w[tok, pos, None].float())
    return out


SWEEP = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 32, 256, 4, 4), (16, 128, 64, 4, 4),
         (32, 64, 128, 4, 4), (64, 128, 64, 8, 3), (64, 64, 128, 4, 3), (16, 64, 128, 4, 3), (16, 128, 128, 4, 4),
         (16, 64, 256, 8, 3), (32, 128, 128, 4, 3), (64, 128, 128, 4, 3), (16, 128, 256, 4, 3)]


@torch.no_grad()
def _sweep(q, ms, k, bw):
    """Each projection's grouped GEMM alone (CUDA-graph medians), per tile config (BLOCK_M, BLOCK_N, BLOCK_K,
    warps, stages)."""
    from torchforge.ops.nvfp4_triton import grouped_config, launch_nvfp4_grouped_linear

    E, H, I = q.num_experts, q.hidden_size, q.intermediate_size
    rows = []
    for M in ms:
        ids = torch.rand(M, E, device="cuda").topk(k, dim=-1).indices.reshape(-1)
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(M * k, I, device="cuda", dtype=torch.bfloat16)
        hit = ids.unique().numel()
        for proj, args, div, nbytes in (
                ("gate_up", (x, ids, q.gate_up_weight, q.gate_up_weight_scale, q.gate_up_weight_scale_2), k,
                 2 * I * H * 9 // 16),
                ("down", (h, ids, q.down_weight, q.down_weight_scale, q.down_weight_scale_2), 1, H * I * 9 // 16)):
            times = {}
            for cfg in SWEEP:
                bm, bn, bk, nw, ns = cfg
                try:
                    times[cfg] = bench_graph_ms(lambda: launch_nvfp4_grouped_linear(  # noqa: B023
                        *args, x_row_div=div, block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns),
                        rep_ms=30)
                except Exception as e:  # noqa: BLE001  (a config that does not compile / fit)
                    times[cfg] = float("nan")
                    print(f"sweep {proj} M={M} {cfg}: {type(e).__name__}")
            best = min((t, c) for c, t in times.items() if t == t)
            default = grouped_config(M * k, E)
            floor = hit * nbytes / (bw / 2) / 1e6
            rows.append([M, proj, str(default), times.get(tuple(default), float("nan")), str(best[1]), best[0],
                         floor / best[0]] + [times[c] for c in SWEEP])
    print(markdown_table(["M", "GEMM", "default cfg", "default ms", "best cfg", "best ms", "best % of floor"]
                         + [str(c) for c in SWEEP], rows))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,8,64,512")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--no-awq", action="store_true", help="skip the W4A16 (AWQ) MoE comparison")
    ap.add_argument("--w4a4", action="store_true", help="also time the W4A4 emulation mode")
    ap.add_argument("--sweep", action="store_true", help="time the grouped GEMMs over a grid of tile configs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/nvfp4_moe.py: no CUDA device; nothing to measure")
        return 0
    from torchforge.nn import ForgeAWQExperts, NVFP4Experts

    E, H, I, K = args.experts, 7168, 2048, 8
    torch.manual_seed(0)
    (hf,), impl = deepseek_v3_hf_experts(E, H, I, K)
    # ModelOpt-exact quantization, 16 experts per call (one call over 256 experts needs > 56 GB of temporaries)
    q = quantize_experts_chunked(lambda n: NVFP4Experts(n, H, I, act_fn=hf.act_fn, device="cuda"), hf)
    awq = None
    if not args.no_awq:
        try:
            awq = quantize_experts_chunked(
                lambda n: ForgeAWQExperts(n, H, I, group_size=128, act_fn=hf.act_fn, device="cuda"), hf)
        except torch.OutOfMemoryError:
            awq = None
    torch.cuda.empty_cache()
    per_expert = (2 * I * H + H * I) // 2 + (2 * I * H + H * I) // 16  # E2M1 codes + fp8 block scales
    bw = copy_bandwidth_gbs(1 << 30)
    rows = []
    for M in map(int, args.m.split(",")):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        scores = torch.rand(M, E, device="cuda")
        w, ids = scores.topk(K, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).float()
        with torch.no_grad():
            out = q(x, ids, w)
            ref = _oracle(q, x, ids, w)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        hit = ids.unique().numel()
        floor_ms = hit * per_expert / (bw / 2) / 1e6  # bytes read at half the read+write copy rate
        f_hf = lambda: hf(x, ids, w)  # noqa: E731
        f_q = lambda: q(x, ids, w)  # noqa: E731
        with torch.no_grad():
            t_hf, t_q = bench_ms(f_hf), bench_ms(f_q)
            g_hf, g_q = _graph_ms(f_hf), _graph_ms(f_q)
            t_awq = g_awq = float("nan")
            if awq is not None:
                f_awq = lambda: awq(x, ids, w)  # noqa: E731
                t_awq, g_awq = bench_ms(f_awq), _graph_ms(f_awq)
            t_w4a4 = float("nan")
            if args.w4a4:
                amax = float(x.float().abs().max())
                q.set_input_amax(torch.full((E,), amax), torch.full((E,), amax))
                q.w4a4 = True
                t_w4a4 = bench_ms(f_q)
                q.w4a4 = False
        best_q = g_q if g_q == g_q else t_q
        rows.append([M, hit, t_hf, t_q, t_hf / t_q, g_hf, g_q, g_hf / g_q, t_awq, t_awq / t_q, g_awq / g_q,
                     floor_ms, floor_ms / best_q, t_w4a4, f"{rel:.1e}"])
        torch.cuda.empty_cache()
    print(f"device: {device_line()}; copy bandwidth {bw:.0f} GB/s (read+write); HF experts impl: {impl}")
    if args.sweep:
        _sweep(q, [int(m) for m in args.m.split(",")], K, bw)
    print(markdown_table(["M tokens", "experts hit", "HF bf16 ms", "NVFP4 ms", "speedup vs bf16", "HF bf16 graph ms",
                          "NVFP4 graph ms", "graph speedup", "W4A16 AWQ ms", "speedup vs AWQ", "graph speedup vs AWQ",
                          "NVFP4 floor ms", "% of floor", "W4A4-emu ms", "rel err vs dequant"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
