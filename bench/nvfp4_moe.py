"""One DeepSeek-V3 MoE layer (256 experts of 7168 x 2048, top-8): NVFP4 experts vs HF's bf16 experts.

    python bench/nvfp4_moe.py [--m 1,8,64,512] [--experts 256] [--no-awq] [--w4a4] [--sweep]
    python bench/nvfp4_moe.py --gemv-sweep [--gemv-m 1,8] [--experts 256]

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
`ops.nvfp4_grouped_linear` runs the grouped GEMV (`torchforge.ops.nvfp4_gemv_triton`) when the routed rows are at
most half the experts (`use_grouped_gemv`, column `kernel`), else the sorted grouped GEMM.
`--gemv-sweep` only times the grouped GEMV kernel alone (no HF model, random NVFP4 bytes: timing does not depend
on values), gate_up [E, 4096, 7168] and down [E, 7168, 2048] at `--gemv-m` tokens x top-8, over `GEMV_SWEEP`
(BLOCK_N, BLOCK_K, SPLIT_K, warps; the defaults of `gemv_config` were chosen without a GPU) and the grouped GEMM
kernel (with its align kernel) in the same run; CUDA-graph medians; GB/s = NVFP4 bytes (codes + fp8 scales) of
the experts hit / time. About 1.5 minutes, most of it compiling.
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


GEMV_SWEEP = [(16, 256, 1, 2), (16, 512, 1, 2), (16, 512, 1, 4), (32, 128, 1, 2), (32, 256, 1, 2),
              (32, 256, 1, 4), (32, 512, 1, 4), (64, 128, 1, 4), (64, 256, 1, 4), (64, 256, 1, 8), (64, 512, 1, 4),
              (64, 512, 1, 8), (128, 128, 1, 4), (128, 128, 1, 8), (128, 256, 1, 4), (128, 256, 1, 8),
              (32, 256, 2, 4), (32, 512, 2, 4), (64, 128, 2, 4), (64, 256, 2, 4), (64, 256, 4, 4), (128, 128, 2, 4),
              (128, 256, 2, 8), (128, 256, 4, 8)]


@torch.no_grad()
def _gemv_sweep(ms, E: int, bw: float, H: int = 7168, I: int = 2048, K: int = 8):
    """The grouped GEMV kernel alone per projection over GEMV_SWEEP (BLOCK_N, BLOCK_K, SPLIT_K, warps), against
    the grouped GEMM kernel in the same run (CUDA-graph medians). Random codes, fp8 scales in [0.5, 2)."""
    from torchforge.ops.nvfp4_gemv_triton import gemv_config, launch_nvfp4_grouped_gemv
    from torchforge.ops.nvfp4_triton import launch_nvfp4_grouped_linear

    def weights(n, k):
        packed = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device="cuda")
        scales = torch.randint(0x30, 0x40, (E, n, k // 16), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        return packed, scales, torch.full((E,), 1e-3, device="cuda")

    projs = [("gate_up", weights(2 * I, H), 2 * I, H, K), ("down", weights(H, I), H, I, 1)]
    read_bw = bw / 2  # GB/s of reads in a device copy
    summary, grid_cols, grid = [], [], {cfg: [] for cfg in GEMV_SWEEP}
    for M in ms:
        ids = torch.rand(M, E, device="cuda").topk(K, dim=-1).indices.reshape(-1)
        hit = ids.unique().numel()
        R = M * K
        for proj, (packed, scales, ws2), n, k, div in projs:
            x = torch.randn(R // div, k, device="cuda", dtype=torch.bfloat16)
            args = (x, ids, packed, scales, ws2)
            gbytes = hit * n * k * 9 / 16 / 1e9  # E2M1 codes + fp8 block scales of the experts hit
            ref = launch_nvfp4_grouped_linear(*args, x_row_div=div).float()
            t_grouped = bench_graph_ms(lambda: launch_nvfp4_grouped_linear(*args, x_row_div=div), rep_ms=20)  # noqa: B023
            default = gemv_config(R, n, k)
            times, worst = {}, 0.0
            for cfg in GEMV_SWEEP + ([default] if default not in GEMV_SWEEP else []):
                bn, bk, sk, nw = cfg
                run = lambda: launch_nvfp4_grouped_gemv(*args, x_row_div=div, block_n=bn, block_k=bk,  # noqa: E731,B023
                                                        split_k=sk, num_warps=nw)
                try:
                    err = float((run().float() - ref).norm() / ref.norm())
                    worst = max(worst, err)
                    times[cfg] = bench_graph_ms(run, rep_ms=20)
                except Exception as e:  # noqa: BLE001  (a config that does not compile / fit)
                    times[cfg] = float("nan")
                    print(f"gemv sweep {proj} M={M} {cfg}: {type(e).__name__}: {e}"[:200])
            best_t, best_cfg = min((t, c) for c, t in times.items() if t == t)
            t_def = times.get(default, float("nan"))
            summary.append([M, proj, R, hit, f"{gbytes * 1e3:.0f}", t_grouped, gbytes / t_grouped * 1e3, str(default),
                            t_def, gbytes / t_def * 1e3, str(best_cfg), best_t, gbytes / best_t * 1e3,
                            f"{gbytes / best_t * 1e3 / read_bw:.0%}", t_grouped / best_t, f"{worst:.1e}"])
            grid_cols.append(f"M={M} {proj} ms (GB/s)")
            for cfg in GEMV_SWEEP:
                t = times[cfg]
                grid[cfg].append(f"{t:.4f} ({gbytes / t * 1e3:.0f})" if t == t else "fail")
    print(f"\n### grouped NVFP4 GEMV sweep ({E} experts, top-{K}; read bandwidth of a device copy {read_bw:.0f} GB/s)")
    print(markdown_table(["M", "GEMM", "rows", "experts hit", "MB read", "grouped GEMM ms", "grouped GB/s",
                          "GEMV default cfg", "default ms", "default GB/s", "GEMV best cfg", "best ms", "best GB/s",
                          "best % of read bw", "best speedup vs grouped", "max rel err vs grouped"], summary))
    print("\nGEMV per config (BLOCK_N, BLOCK_K, SPLIT_K, warps):")
    print(markdown_table(["config"] + grid_cols, [[str(c)] + grid[c] for c in GEMV_SWEEP]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,8,64,512")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--no-awq", action="store_true", help="skip the W4A16 (AWQ) MoE comparison")
    ap.add_argument("--w4a4", action="store_true", help="also time the W4A4 emulation mode")
    ap.add_argument("--sweep", action="store_true", help="time the grouped GEMMs over a grid of tile configs")
    ap.add_argument("--gemv-sweep", action="store_true",
                    help="only time the grouped GEMV kernel over a grid of configs (and the grouped GEMM), then exit")
    ap.add_argument("--gemv-m", default="1,8", help="token counts of --gemv-sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/nvfp4_moe.py: no CUDA device; nothing to measure")
        return 0
    if args.gemv_sweep:
        bw = copy_bandwidth_gbs(1 << 30)
        print(f"device: {device_line()}; copy bandwidth {bw:.0f} GB/s (read+write)")
        _gemv_sweep([int(m) for m in args.gemv_m.split(",")], args.experts, bw)
        return 0
    from torchforge.ops.nvfp4_gemv_triton import use_grouped_gemv
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
        kernel = "GEMV" if use_grouped_gemv(M * K, E) else "grouped GEMM"
        rows.append([M, hit, kernel, t_hf, t_q, t_hf / t_q, g_hf, g_q, g_hf / g_q, t_awq, t_awq / t_q, g_awq / g_q,
                     floor_ms, floor_ms / best_q, t_w4a4, f"{rel:.1e}"])
        torch.cuda.empty_cache()
    print(f"device: {device_line()}; copy bandwidth {bw:.0f} GB/s (read+write); HF experts impl: {impl}")
    if args.sweep:
        _sweep(q, [int(m) for m in args.m.split(",")], K, bw)
    print(markdown_table(["M tokens", "experts hit", "kernel", "HF bf16 ms", "NVFP4 ms", "speedup vs bf16", "HF bf16 graph ms",
                          "NVFP4 graph ms", "graph speedup", "W4A16 AWQ ms", "speedup vs AWQ", "graph speedup vs AWQ",
                          "NVFP4 floor ms", "% of floor", "W4A4-emu ms", "rel err vs dequant"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
