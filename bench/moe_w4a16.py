"""One DeepSeek-V3 MoE layer (256 experts of 7168 x 2048, top-8): W4A16 experts vs HF's bf16 experts.

    python bench/moe_w4a16.py [--m 1,8,64,512] [--experts 256]
    python bench/moe_w4a16.py --gemv-sweep [--gemv-m 1,8]
Baseline: transformers' DeepseekV3Experts in bf16 with `_experts_implementation = "grouped_mm"` (its
fastest path; falls back to the default loop if this transformers lacks it), measured in the same run.
Ours: ForgeAWQExperts (group 128, or --group-size) through awq_moe_gemm: the grouped GEMV (awq_moe_gemv_triton.py) when the
routed rows are few relative to the experts (`use_moe_gemv`; the `path` column), else the expert-sorted
Triton grouped GEMM. Times: eager medians (both sides launch from Python) and, where capture works,
CUDA-graph medians. `floor` is the int4 bytes of the experts actually hit over the measured copy bandwidth.
The `mma` columns: the same experts after `ForgeAWQExperts.use_mma_layout()` (the grouped mma.sync kernel of
csrc/awq_mma_moe.cu, or from WGMMA_MOE_MIN_ROWS_PER_EXPERT routed rows per expert on Hopper the grouped wgmma kernel
of csrc/awq_wgmma.cu; the `mma kernel` column says which; + the same epilogue reduce kernels), timed after the AWQ
rows in the same run, with HF bf16 timed again beside them. Where the wgmma kernel ran, the `mma.sync-only` columns
time the mma.sync kernel on the same call (MOE_WGMMA = False). The experts are quantized symmetrically (the module's
default), so the mma.sync kernel is told their zero points are all 8 and skips qzeros (`zeros_are_8`); `zeros read`
times the same call with the module told otherwise (what an asymmetric checkpoint costs). The mma floor counts the
bytes the kernel reads: without the zero words where it skips them.

`--gemv-sweep` runs alone (no HF model, random AWQ words, ~1-2 min): the grouped GEMV by itself (its split-K
reduce included) on gate_up [E, 7168, 4096/8] and down [E, 2048, 7168/8] at M tokens x top-8 over BLOCK_W,
BLOCK_K, SPLIT_K, num_warps and num_stages (30 configs per case), CUDA-graph medians, against the grouped
GEMM's default in the same run; GB/s counts the int4 bytes (qweight + scales + qzeros) of the experts hit,
read once.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

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


def gemv_sweep(E: int, H: int, I: int, K: int, ms: list[int], G: int = 128, rep_ms: int = 20,
               device: str = "cuda", timer=None) -> tuple[list, list, float]:
    """Grouped GEMV configs on random AWQ experts: (all rows, best-per-case rows, copy GB/s); 30 configs per
    (GEMM, M), listed below. `timer` and `device` let it run on CPU under TRITON_INTERPRET=1 (a logic check)."""
    from torchforge.ops.awq_moe_gemv_triton import launch_awq_moe_gemv, moe_gemv_config
    from torchforge.ops.awq_moe_triton import launch_awq_moe_gemm

    timer = timer or (lambda f: bench_graph_ms(f, rep_ms=rep_ms))
    bw_gbs = copy_bandwidth_gbs(1 << 30) if device == "cuda" else float("nan")
    i32 = dict(dtype=torch.int32, device=device)

    def rand_awq(k: int, n: int):  # random words: the kernels' speed does not depend on the codes
        qw = torch.randint(-2**31, 2**31, (E, k, n // 8), **i32)
        sc = (torch.rand(E, k // G, n, device=device) * 2e-3 + 1e-3).half()
        qz = torch.randint(-2**31, 2**31, (E, k // G, n // 8), **i32)
        return qw, sc, qz

    weights = {"gate_up": (rand_awq(H, 2 * I), K), "down": (rand_awq(I, H), 1)}
    rows, best = [], []
    for M in ms:
        ids = torch.rand(M, E, device=device).topk(K, dim=-1).indices.flatten()
        R, hit = ids.numel(), ids.unique().numel()
        for name, ((qw, sc, qz), div) in weights.items():
            _, k, np_ = qw.shape
            a = torch.randn(R // div, k, device=device, dtype=torch.bfloat16)
            nbytes = hit * (qw[0].numel() * 4 + sc[0].numel() * 2 + qz[0].numel() * 4)
            gemm = lambda: launch_awq_moe_gemm(a, ids, qw, sc, qz, G, x_row_div=div)  # noqa: E731
            ref = gemm().float()
            t_gemm = timer(gemm)
            groups = k // G
            dflt = moe_gemv_config(R, k, np_ * 8, G)
            # (BLOCK_W, warps): 128 words per warp (the K-sum of a group stays in registers) or 64 (one shuffle);
            # BLOCK_K 2 / 4 (8 spills); (pipeline stages, groups per K slice): unpipelined, 3 and 5 stages x 1, 2
            configs = [(bw, bk, groups // gps, nw, ns) for bw, nw in ((64, 1), (128, 1), (256, 2)) for bk in (2, 4)
                       for ns, gps in ((1, 2), (3, 1), (3, 2), (5, 1), (5, 2))] + [dflt]
            configs = list(dict.fromkeys(c for c in configs if c[2] >= 1 and groups % c[2] == 0 and G % c[1] == 0))
            case = []
            for bw, bk, split, nw, ns in configs:
                f = lambda: launch_awq_moe_gemv(a, ids, qw, sc, qz, G, x_row_div=div, block_w=bw,  # noqa: E731
                                                block_k=bk, split_k=split, num_warps=nw, num_stages=ns)
                try:
                    rel = ((f().float() - ref).norm() / ref.norm()).item()
                    t = timer(f)
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"gemv {name} M={M} {bw} {bk} {split} {nw} {ns}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                gbs = nbytes / t / 1e6
                case.append([M, name, R, hit, bw, bk, split, nw, ns, "*" if (bw, bk, split, nw, ns) == dflt else "",
                             t, gbs, gbs / bw_gbs, t_gemm, t_gemm / t, f"{rel:.1e}"])
            case.sort(key=lambda r: r[10])
            rows += case
            if case:
                d = next((r for r in case if r[9] == "*"), None)
                b = case[0]
                best.append([M, name, R, hit, "/".join(map(str, b[4:9])), b[10], b[12],
                             d[10] if d else float("nan"), d[12] if d else float("nan"), t_gemm, t_gemm / b[10]])
    return rows, best, bw_gbs


def wgmma_sweep(q, hf, hf_deq, routed_batch, ms: list[int], E: int, H: int, K: int) -> int:
    """The mma layout's grouped kernels forced one by one at each token count (CUDA-graph ms of the whole experts
    forward), against HF bf16 in the same run: where the wgmma kernel should take over from mma.sync
    (WGMMA_MOE_MIN_ROWS_PER_EXPERT) and which block of sorted rows it should run on (WGMMA_MOE_BLOCK_M)."""
    import torchforge.ops.awq_mma_cuda as mma_cuda

    assert q.use_mma_layout()
    kernels = [("mma.sync", False, 64), ("wgmma 64", True, 64), ("wgmma 128", True, 128)]
    block_m, rows = mma_cuda.WGMMA_MOE_BLOCK_M, []
    try:
        for M in ms:
            torch.manual_seed(M)
            x, ids, w = routed_batch(M, H, E, K)
            with torch.no_grad():
                deq_ref = hf_deq(x, ids, w).float()
                g_hf = bench_graph_ms(lambda: hf(x, ids, w))
                row = [M, f"{M * K / E:.0f}", g_hf]
                for _, wgmma, block in kernels:
                    mma_cuda.MOE_WGMMA, mma_cuda.WGMMA_MOE_BLOCK_M = wgmma, block
                    # no sort (decode-sized calls), or not sm_90: the wgmma columns would time mma.sync
                    if wgmma and not mma_cuda.wgmma_moe_ok(x, ids.numel(), E, q.gate_up_scales, q.gate_up_qzeros,
                                                           q.group_size):
                        row += ["n/a", "", ""]
                        continue
                    rel = ((q(x, ids, w).float() - deq_ref).norm() / deq_ref.norm()).item()
                    g = bench_graph_ms(lambda: q(x, ids, w))
                    row += [g, g_hf / g, f"{rel:.1e}"]
                mma_cuda.MOE_WGMMA, mma_cuda.WGMMA_MOE_BLOCK_M = None, block_m
                row.append(bench_graph_ms(lambda: q(x, ids, w)))  # as dispatched
            rows.append(row)
            torch.cuda.empty_cache()
    finally:
        mma_cuda.MOE_WGMMA, mma_cuda.WGMMA_MOE_BLOCK_M = None, block_m
    print(f"device: {device_line()}; {E} experts, top-{K}; CUDA-graph ms of one experts forward")
    heads = ["M tokens", "rows per expert", "HF bf16"]
    for name, _, _ in kernels:
        heads += [name, f"{name} speedup", f"{name} rel err"]
    print(markdown_table(heads + ["dispatched"], rows))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,8,64,512")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=128, help="AWQ group size of the experts (the mma columns need "
                    "32 or a multiple of 64: group 16 times the AWQ layout only)")
    ap.add_argument("--sweep", action="store_true", help="time the grouped GEMMs over tile configs (M = 1, 8, 64)")
    ap.add_argument("--gemv-sweep", action="store_true",
                    help="only time the grouped GEMV kernel's configs (and the grouped GEMM) on random AWQ experts")
    ap.add_argument("--gemv-m", default="1,8", help="tokens for --gemv-sweep (x top-8 routed rows)")
    ap.add_argument("--mma-warps", default="", help="e.g. 4,8: also time the grouped mma kernel with these warps per "
                    "block (MOE_WARPS; default: mma_cuda_warps)")
    ap.add_argument("--mma-splits", default="", help="e.g. 1,2,4: also time the grouped mma kernel with these K "
                    "slices (MOE_SPLITS; default: the launch's rule)")
    ap.add_argument("--mma-block-rows", default="",
                    help="e.g. 8,16: also time the mma layout with these rows per sorted block (MOE_SORTED_BLOCK_ROWS; "
                         "default: moe_sorted_block_rows)")
    ap.add_argument("--wgmma-sweep", action="store_true",
                    help="only time the mma layout's grouped kernels at each --m: mma.sync (blocks of 8 / 16) and the "
                         "wgmma kernel on blocks of 64 and 128, against HF bf16 (WGMMA_MOE_MIN_ROWS_PER_EXPERT and "
                         "WGMMA_MOE_BLOCK_M)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/moe_w4a16.py: no CUDA device; nothing to measure")
        return 0
    if args.gemv_sweep:
        t0 = time.time()
        torch.manual_seed(0)
        rows, best, bw = gemv_sweep(args.experts, 7168, 2048, 8, [int(m) for m in args.gemv_m.split(",")])
        print(f"device: {device_line()}; copy bandwidth {bw:.0f} GB/s (read+write)")
        print("grouped GEMV sweep (CUDA graph ms, split-K reduce included; * = moe_gemv_config default; "
              "GB/s = int4 bytes of the experts hit / time; % copy = GB/s over the copy rate):")
        print(markdown_table(["M", "GEMM", "rows", "experts hit", "BLOCK_W", "BLOCK_K", "SPLIT_K", "warps", "stages",
                              "default", "ms", "GB/s", "% copy", "grouped GEMM ms", "speedup vs GEMM",
                              "rel err vs GEMM"], rows))
        print("best per case:")
        print(markdown_table(["M", "GEMM", "rows", "experts hit", "BW/BK/SPLIT/warps/stages", "best ms", "best % copy",
                              "default ms", "default % copy", "grouped GEMM ms", "best speedup vs GEMM"], best))
        print(f"sweep took {time.time() - t0:.0f} s")
        return 0
    import torchforge
    from torchforge.nn import ForgeAWQExperts
    from torchforge.ops.awq_moe import use_moe_gemv

    E, H, I, K = args.experts, 7168, 2048, 8
    G = args.group_size
    torch.manual_seed(0)
    # hf_deq: the same module on our dequantized weights, the accuracy oracle
    (hf, hf_deq), impl = deepseek_v3_hf_experts(E, H, I, K, copies=2)
    chunk = 16
    q = quantize_experts_chunked(
        lambda n: ForgeAWQExperts(n, H, I, group_size=G, act_fn=hf.act_fn, device="cuda"), hf, chunk)
    with torch.no_grad():
        for i in range(0, E, chunk):  # chunked: the reference dequantizer's temporaries are large
            sl = slice(i, i + chunk)
            hf_deq.gate_up_proj.data[sl] = torchforge.ops.awq_dequantize(
                q.gate_up_qweight[sl], q.gate_up_scales[sl].float(), q.gate_up_qzeros[sl], G).bfloat16()
            hf_deq.down_proj.data[sl] = torchforge.ops.awq_dequantize(
                q.down_qweight[sl], q.down_scales[sl].float(), q.down_qzeros[sl], G).bfloat16()
    torch.cuda.empty_cache()
    per_expert_int4 = (H * 2 * I + I * H) // 2 + (H // G * 2 * I + I // G * H) * (2 + 0.5)
    per_expert_no_zeros = (H * 2 * I + I * H) // 2 + (H // G * 2 * I + I // G * H) * 2  # zero words not read
    bw = copy_bandwidth_gbs(1 << 30)
    rows = []

    def routed_batch(M, H, E, K):
        """M random bf16 tokens with top-K routing over E experts (weights renormalised, fp32)."""
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        w, ids = torch.rand(M, E, device="cuda").topk(K, dim=-1)
        return x, ids, (w / w.sum(-1, keepdim=True)).float()

    if args.wgmma_sweep:
        return wgmma_sweep(q, hf, hf_deq, routed_batch, [int(m) for m in args.m.split(",")], E, H, K)
    for M in map(int, args.m.split(",")):
        x, ids, w = routed_batch(M, H, E, K)
        with torch.no_grad():
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
        path = "gemv" if use_moe_gemv(M * K, E) else "gemm"
        rows.append([M, hit, path, t_hf, t_q, t_hf / t_q, g_hf, g_q, g_hf / g_q, floor_ms,
                     floor_ms / (g_q if g_q == g_q else t_q), f"{rel:.1e}"])
        torch.cuda.empty_cache()
    # The same experts on the mma layout (ForgeAWQExperts.use_mma_layout: the grouped tensor-core kernel of
    # csrc/awq_mma.cu), timed after the AWQ-layout rows in the same run.
    # Where the rows per expert reach WGMMA_MOE_MIN_ROWS_PER_EXPERT the grouped wgmma kernel runs (csrc/awq_wgmma.cu);
    # the last columns time the grouped mma.sync kernel there too (MOE_WGMMA = False), in the same run.
    import torchforge.ops.awq_mma_cuda as mma_cuda

    for row, M in zip(rows if q.use_mma_layout() else [], map(int, args.m.split(","))):
        torch.manual_seed(M)
        x, ids, w = routed_batch(M, H, E, K)
        with torch.no_grad():
            out = q(x, ids, w)
            deq_ref = hf_deq(x, ids, w)
            g_hf = bench_graph_ms(lambda: hf(x, ids, w))
            g_m = bench_graph_ms(lambda: q(x, ids, w))
            wgmma = mma_cuda.wgmma_moe_ok(x, ids.numel(), E, q.gate_up_scales, q.gate_up_qzeros, q.group_size)
            g_s, g_z = float("nan"), float("nan")
            if q.zeros_are_8:
                q.zeros_are_8 = False
                g_z = bench_graph_ms(lambda: q(x, ids, w))
                q.zeros_are_8 = True
            if wgmma:
                mma_cuda.MOE_WGMMA = False
                g_s = bench_graph_ms(lambda: q(x, ids, w))
                mma_cuda.MOE_WGMMA = None
        rel = ((out.float() - deq_ref.float()).norm() / deq_ref.float().norm()).item()
        floor_ms = ids.unique().numel() * per_expert_int4 / bw / 1e6
        per_m = per_expert_no_zeros if q.zeros_are_8 and not wgmma else per_expert_int4
        floor_m = ids.unique().numel() * per_m / bw / 1e6
        row += [g_hf, g_m, g_hf / g_m, floor_m / g_m, f"{rel:.1e}", "wgmma" if wgmma else "mma.sync", g_s,
                g_hf / g_s, g_z, floor_ms / g_z]
        torch.cuda.empty_cache()
    if args.mma_block_rows or args.mma_warps or args.mma_splits:
        import torchforge.ops.awq_mma_cuda as mma_cuda

        def settings(arg):  # None: the library's rule
            return [int(v) for v in arg.split(",")] if arg else [None]

        brows = []
        for M in map(int, args.m.split(",")):
            torch.manual_seed(M)
            x, ids, w = routed_batch(M, H, E, K)
            for b in settings(args.mma_block_rows):
                for wp in settings(args.mma_warps):
                    for sp in settings(args.mma_splits):
                        mma_cuda.MOE_SORTED_BLOCK_ROWS, mma_cuda.MOE_WARPS, mma_cuda.MOE_SPLITS = b, wp, sp
                        with torch.no_grad():
                            brows.append([M, b or "rule", wp or "rule", sp or "rule",
                                          bench_graph_ms(lambda: q(x, ids, w))])
        mma_cuda.MOE_SORTED_BLOCK_ROWS = mma_cuda.MOE_WARPS = mma_cuda.MOE_SPLITS = None
        print("mma layout, rows per sorted block and warps per block of the grouped kernel (decode batches with no "
              "more routed rows than experts take one row per block whatever the setting):")
        print(markdown_table(["M tokens", "rows per block", "warps", "K slices", "graph ms"], brows))
    if args.sweep:
        print("grouped GEMM tile sweep (CUDA graph ms; BLOCK_M from moe_block_m):")
        print(markdown_table(["M", "GEMM", "BLOCK_N", "BLOCK_K", "warps", "stages", "ms"], sweep(q, E, H, I, K)))
    print(f"device: {device_line()}; copy bandwidth {bw:.0f} GB/s (read+write); HF experts impl: {impl}")
    print(markdown_table(["M tokens", "experts hit", "path", "HF bf16 ms", "W4A16 ms", "speedup", "HF bf16 graph ms",
                          "W4A16 graph ms", "graph speedup", "int4 floor ms", "% of floor", "rel err vs dequant",
                          "HF bf16 graph ms (2)", "mma layout graph ms", "mma speedup", "mma % of floor",
                          "mma rel err", "mma kernel", "mma.sync-only graph ms", "mma.sync-only speedup",
                          "mma zeros read graph ms", "zeros read % of int4 floor"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
