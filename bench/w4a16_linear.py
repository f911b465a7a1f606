"""w4a16_linear (AWQ layout, group 128, bf16) against a bf16 matmul on DeepSeek-V3 shapes, in one run.

    python bench/w4a16_linear.py [--m 1,16,64,256,1024,4096] [--sweep]
Times are medians of CUDA-graph replays (GPU time, no host launch gaps) except the `eager` column. Consecutive calls
read different copies of the weights (bench/common.py L2Rotation), since one int4 weight of 7168x7168 (27 MB) fits
the H100's 50 MB L2 and replays on one copy measured the cache (before the nineteenth session).
Columns: bf16 F.linear; torchforge's dispatched op (AWQ layout) (the CUDA GEMV of csrc/ for M = 1 where built, else Triton's, the tensor-core kernel up to 128 rows,
dequant + cuBLAS beyond); each path forced (the split-K and tiled kernels are the fp32 paths now); tinygemm (`torch._weight_int4pack_mm`) where this torch has it; the ratio
bf16 / w4a16 (> 1: w4a16 faster); bandwidth on the int4 weight bytes (qweight + scales + qzeros); then `mma layout`:
`awq_mma_linear` on the same weight in the mma layout (what a ForgeAWQLinear runs after `use_mma_layout()`: the
CUDA tensor-core kernel up to 128 rows, on Hopper the wgmma kernel for 129-256 (97-256 on wide matrices), Triton
dequantize + cuBLAS beyond) with
its ratios, told that every zero point is 8 as a module on these symmetric codes is (`symmetric`, zeros_are_8: the
decode kernel skips qzeros); `mma, zeros read`: the same call without (an asymmetric checkpoint's cost); and the
GPTQ layout's own
Triton kernel (`w4a16_gptq_linear`, what a ForgeGPTQLinear runs before `use_mma_layout()`) on the same numbers.
`--sweep` also times split-K configurations at M = 1 and 16 (to pick the defaults in awq_splitk_triton.py);
`--gemv-sweep` the batch-1 GEMV kernel's (awq_gemv_triton.py); `--cuda-gemv-sweep` only the extension's batch-1
GEMV (csrc/awq_gemv.cu), which the op dispatches at M = 1 when it is built; `--mma-sweep 16,64,...` only the tensor-core
kernel's (awq_mma_triton.py) at those M; `--mma-cuda-sweep 1,4,16,...` only the extension's tensor-core kernel on the
mma layout (csrc/awq_mma.cu); `--wgmma-sweep 128,256,...` only the Hopper kernel on it (csrc/awq_wgmma.cu), over its
configurations (`--best`: the fastest and the default per M).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import L2Rotation, bench_graph_ms, bench_ms, device_line, markdown_table  # noqa: E402

G = 128


def tinygemm_fn(w: torch.Tensor, x: torch.Tensor):
    """tinygemm int4 (group 128, asymmetric bf16 scale/zero); None where this torch build lacks it."""
    try:
        n, k = w.shape
        wg = w.float().reshape(n, k // G, G)
        mn, mx = wg.amin(-1), wg.amax(-1)
        scale = ((mx - mn).clamp(min=1e-6) / 15)
        q = ((wg - mn[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        wp = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
        # tinygemm decodes (q - 8) * scale + zero, so zero = min + 8 * scale
        sz = torch.stack([scale, mn + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        fn = lambda: torch.ops.aten._weight_int4pack_mm(x, wp, G, sz)  # noqa: E731
        fn()
        fn.tensors = (wp, sz)  # its weights, for an L2Rotation
        return fn
    except Exception as e:  # noqa: BLE001 - report, don't fail the bench
        print(f"tinygemm unavailable: {type(e).__name__}: {str(e)[:120]}")
        return None


def timed_tinygemm(w: torch.Tensor, x: torch.Tensor, rep_ms: int = 200) -> float:
    """bench_graph_ms of tinygemm on w (its packed weights rotated with the others in an active L2Rotation); NaN
    where this torch lacks it."""
    tg = tinygemm_fn(w, x)
    if tg is None:
        return float("nan")
    rot = L2Rotation.active
    if rot is not None:
        rot.add(*tg.tensors)
    try:
        return bench_graph_ms(tg, rep_ms=rep_ms)
    finally:
        if rot is not None:
            rot.drop(*tg.tensors)


def quantized_case(shape: str):
    """"OCxIC" -> (OC, IC, bf16 weight N(0, 0.02), qweight, scales, qzeros, int4 bytes read per matmul)."""
    import torchforge

    OC, IC = map(int, shape.split("x"))
    w = torch.randn(OC, IC, device="cuda", dtype=torch.bfloat16) * 0.02
    qw, sc, qz = torchforge.ops.awq_quantize(w, group_size=G)
    return OC, IC, w, qw, sc, qz, qw.numel() * 4 + sc.numel() * 2 + qz.numel() * 4


def rotated_mma_case(shape: str, scale_dtype: str = "fp16"):
    """quantized_case(shape) on the mma layout, its weights rotated through L2 from here on (L2Rotation.start), and
    kept tickets, as a module on the mma layout has them (mma_tickets: without, every call with K slices paid a memset
    kernel for fresh ones; sessions before the thirteenth swept that way): (OC, IC, w, qw, sc, qz, wbytes, mma,
    tickets).
    scale_dtype "bf16": the scales a bf16 model holds after .to(torch.bfloat16) (no hi / lo scale split)."""
    from torchforge.ops.awq_mma_cuda import mma_tickets
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout

    OC, IC, w, qw, sc, qz, wbytes = quantized_case(shape)
    if scale_dtype == "bf16":
        sc = sc.to(torch.bfloat16)
    mma = awq_to_mma_layout(qw)
    L2Rotation.start(wbytes, w, qw, sc, qz, mma)
    return OC, IC, w, qw, sc, qz, wbytes, mma, mma_tickets(OC, mma.device)


def cuda_gemv_sweep(shapes: str) -> list:
    """The extension's batch-1 GEMV (csrc/awq_gemv.cu) over (splits, rows), against the Triton GEMV, tinygemm and
    bf16 in the same run."""
    from torchforge.ops.awq_gemv_cuda import cuda_gemv_config, launch_awq_gemv_cuda
    from torchforge.ops.awq_gemv_triton import launch_w4a16_gemv
    from torchforge.ops.awq_reference import awq_dequantize_ref

    out = []
    for shape in shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes = quantized_case(shape)
        L2Rotation.start(wbytes, w, qw, sc, qz)
        x = torch.randn(1, IC, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), awq_dequantize_ref(qw, sc, qz, G).float())
        t_triton = bench_graph_ms(lambda: launch_w4a16_gemv(x, qw, sc, qz, G))
        t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w))
        t_tg = timed_tinygemm(w, x)
        default = cuda_gemv_config(IC, OC, G)
        for rows in (16, 32, 64):
            for splits in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 28):
                if splits > IC // rows:
                    continue
                f = lambda: launch_awq_gemv_cuda(x, qw, sc, qz, G, splits=splits, rows=rows)  # noqa: E731
                rel = ((f().float() - ref).norm() / ref.norm()).item()
                t = bench_graph_ms(f, rep_ms=30)
                out.append([shape, rows, splits, "*" if (splits, rows) == default else "", t, wbytes / t / 1e6,
                            t_triton, t_tg, t_bf16, t_bf16 / t, f"{rel:.1e}"])
    out.sort(key=lambda r: (r[0], r[4]))
    L2Rotation.stop()
    return out


def mma_cuda_sweep(shapes: str, ms: str, split_counts: str = "1,2,3,4,6,8", chunk_counts: str = "") -> list:
    """The extension's tensor-core kernel on the mma layout (csrc/awq_mma.cu) over its K slices, item chunks (as
    configured, or `chunk_counts`: items of 64 or 128 k), warps and the prefetching loop, with fp16 scales and with
    bf16 ones (as after `model.to(torch.bfloat16)`), kept tickets, against bf16, tinygemm and the AWQ-layout op as dispatched
    (`w4a16_linear`), in the same run."""
    import torchforge
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda, mma_cuda_launch_config
    from torchforge.ops.awq_reference import awq_dequantize_ref
    from torchforge.ops.zero_points import zeros_are_8

    out = []
    for shape in shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes, mma, tickets = rotated_mma_case(shape)
        wdq = awq_dequantize_ref(qw, sc, qz, G).float()
        zeros_8 = zeros_are_8(qz)
        for M in map(int, ms.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wdq.T
            t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w), rep_ms=50)
            t_op = bench_graph_ms(lambda: torchforge.ops.w4a16_linear(x, qw, sc, qz, G), rep_ms=50)
            t_tg = timed_tinygemm(w, x, rep_ms=50)
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            default_splits, chunks, default_warps, default_pf = mma_cuda_launch_config(M, IC, OC, G, sms)
            default = (default_splits, chunks)
            counts = sorted({*map(int, split_counts.split(",")), default[0]})
            configs = []
            for ch in (sorted(set(map(int, chunk_counts.split(",")))) if chunk_counts else (chunks,)):
                pfs = (False, True) if ch == 2 else (False,)  # the prefetching loop: items of 128 k only
                configs += [(s, w_, sc, pf, ch) for s in counts for w_ in (4, 8) for pf in pfs]
            configs.append((default[0], default_warps, sc.bfloat16(), default_pf, chunks))
            # zeros "8": symmetric=True, qzeros not read (these codes are symmetric: awq_quantize's default); groups
            # of 32 read them anyway, so no such rows there
            configs = [c + (sym,) for c in configs for sym in ((False, True) if zeros_8 and G != 32 else (False,))]
            for splits, warps, scales, pf, ch, sym in configs:
                if splits > IC // (64 * ch) or (G % (64 * ch) and not (G == 32 and ch == 1)):  # groups of 32: 64-k items
                    continue
                f = lambda: launch_awq_mma_cuda(x, mma, scales, qz, G, splits=splits, item_chunks=ch,  # noqa: E731
                                                warps=warps, prefetch=pf, tickets=tickets, symmetric=sym)
                rel = ((f().float() - ref).norm() / ref.norm()).item()
                t = bench_graph_ms(f, rep_ms=30)
                out.append([shape, M, str(scales.dtype).removeprefix("torch."), "8" if sym else "read", splits, warps,
                            ch, "yes" if pf else "",
                            "*" if (splits, warps, pf, ch) == (default[0], default_warps, default_pf, chunks) else "", t,
                            f"{t * 1e3:.1f}", wbytes / t / 1e6, t_op,
                            t_tg, t_bf16, t_bf16 / t, t_tg / t, f"{rel:.1e}"])
            print("done", shape, M, flush=True)
    out.sort(key=lambda r: (r[0], r[1], r[9]))
    L2Rotation.stop()
    return out


def _model_ms(m: int, k: int, n: int, cfg: tuple, sms: int) -> float:
    """The dispatch's time model (torchforge/ops/awq_wgmma_cost.py) for a swept WS configuration, to check its fit
    against the measured column (nan where it has no estimate: non-WS kernels, shapes without a fit, and inf where the
    model rules a configuration out)."""
    from torchforge.ops.awq_wgmma_cost import (WGMMA_US_PER_CHUNK, wgmma_cluster_time_us, wgmma_split_time_us,
                                               wgmma_stream_k_time_us, wgmma_tail_time_us, wgmma_time_us)

    shape, splits, ws, dp = tuple(cfg[:2]), cfg[2], cfg[4], (cfg[5] if len(cfg) > 5 else 0)
    if not ws or shape not in WGMMA_US_PER_CHUNK:
        return float("nan")
    if len(cfg) > 6 and cfg[6]:
        us = wgmma_cluster_time_us(m, k, n, shape, splits, sms)
    elif splits == 0:
        us = wgmma_stream_k_time_us(m, k, n, shape, sms)
    elif dp:
        us = wgmma_tail_time_us(m, k, n, shape, splits, sms)
    elif splits > 1:
        us = wgmma_split_time_us(m, k, n, shape, splits, sms)
    else:
        us = wgmma_time_us(m, k, n, shape, sms)
    return us / 1e3


def wgmma_sweep(shapes: str, ms: str, producer_warp: bool = False, only: str = "",
                split_counts: str = "1,2,3,4,6,8", tail: bool = False) -> list:
    """The extension's Hopper kernel on the mma layout (csrc/awq_wgmma.cu) over (block_m, tile_set, splits), against
    bf16, the decode mma kernel (up to 128 rows), the mma layout's dequantize + cuBLAS and tinygemm in the same run.
    Both CUDA kernels get kept tickets, as a module on the mma layout passes them (sessions before the thirteenth
    swept the Hopper kernel with a fresh zeroed buffer, a memset kernel, on every call with K slices)."""
    from torchforge.ops.awq_mma_cuda import launch_awq_mma_cuda, launch_awq_wgmma_cuda, wgmma_cuda_config
    from torchforge.ops.awq_mma_dequant_triton import launch_awq_mma_dequantize_t
    from torchforge.ops.awq_reference import awq_dequantize_ref
    from torchforge.ops.awq_wgmma_cost import wgmma_blocks

    out = []
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    for shape in shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes, mma, tickets = rotated_mma_case(shape)
        wdq = awq_dequantize_ref(qw, sc, qz, G).to(torch.bfloat16).float()
        for M in map(int, ms.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wdq.T
            t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w), rep_ms=50)
            t_dec = (bench_graph_ms(lambda: launch_awq_mma_cuda(x, mma, sc, qz, G, tickets=tickets), rep_ms=50)
                     if M <= 128 else float("nan"))
            t_deq = bench_graph_ms(lambda: x @ launch_awq_mma_dequantize_t(mma, sc, qz, G, x.dtype), rep_ms=50)
            t_tg = timed_tinygemm(w, x, rep_ms=50) if M <= 256 else float("nan")
            default = wgmma_cuda_config(M, IC, OC, sms)
            # no tail slices, no cluster: the plain 5-tuple the sweep makes
            default = default if default[5] or default[6] else default[:5]
            configs = {default}
            for bm, tw in ((64, 4), (64, 2), (128, 2), (192, 1), (256, 1)):
                if bm > 2 * M and bm > 64:
                    continue
                blocks = wgmma_blocks(M, OC, (bm, tw))
                dp = blocks - blocks % sms  # K slices for the last round's tiles only: the full rounds run whole
                for splits in map(int, split_counts.split(",")):
                    if splits == 1 or (not tail and blocks * splits <= 4 * 264):
                        configs.add((bm, tw, splits, 8, False))
                        if producer_warp:  # the warp-specialized kernel
                            configs.add((bm, tw, splits, 8, True))
                    if tail and splits > 1 and 0 < dp < blocks and (blocks - dp) * splits <= sms:
                        configs.add((bm, tw, splits, 8, producer_warp, dp))
                if producer_warp:  # stream-K: one block per SM, the tiles' chunks shared evenly
                    configs.add((bm, tw, 0, 8, True, 0))
            if only:  # e.g. "64x2,128x2": these (block_m, tile_set) only, and the default
                keep = {tuple(map(int, o.split("x"))) for o in only.split(",")}
                configs = {c for c in configs if c[:2] in keep or c == default}
            for cfg in sorted(configs):
                f = lambda: launch_awq_wgmma_cuda(x, mma, sc, qz, G, config=cfg, tickets=tickets)  # noqa: E731
                rel = ((f().float() - ref).norm() / ref.norm()).item()
                t = bench_graph_ms(f, rep_ms=30)
                kind = ("stream-K" if cfg[2] == 0 else ("ws" if cfg[4] else "")
                        + (f"+tail {cfg[5]}" if len(cfg) > 5 and cfg[5] else "")
                        + ("+cluster" if len(cfg) > 6 and cfg[6] else ""))
                out.append([shape, M, *cfg[:3], kind, "*" if cfg == default else "", t,
                            _model_ms(M, IC, OC, cfg, sms), 2 * M * OC * IC / t / 1e9,
                            wbytes / t / 1e6, t_bf16, t_dec, t_deq, t_tg, t_bf16 / t, f"{rel:.1e}"])
            print("done", shape, M, flush=True)
    out.sort(key=lambda r: (r[0], r[1], r[7]))
    L2Rotation.stop()
    return out


def cublas_fit(shapes: str, ms: str) -> list:
    """The dequantize + cuBLAS fallback in its two parts (the mma-layout dequantization kernel alone, then x @ W.T in
    cuBLAS on the dequantized weight) and together, against awq_wgmma_cost.dequant_cublas_time_us: the numbers to
    refit that estimate from, which the dispatch compares with the kernels' estimates."""
    from torchforge.ops.awq_mma_dequant_triton import launch_awq_mma_dequantize_t
    from torchforge.ops.awq_wgmma_cost import dequant_cublas_time_us

    out = []
    for shape in shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes, mma, _ = rotated_mma_case(shape)
        t_dq = bench_graph_ms(lambda: launch_awq_mma_dequantize_t(mma, sc, qz, G, torch.bfloat16), rep_ms=50)
        wt = launch_awq_mma_dequantize_t(mma, sc, qz, G, torch.bfloat16)
        L2Rotation.active.add(wt)  # cuBLAS reads it from DRAM, as it would right after the dequantization
        for M in map(int, ms.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            t_mm = bench_graph_ms(lambda: x @ wt, rep_ms=50)
            t_both = bench_graph_ms(lambda: x @ launch_awq_mma_dequantize_t(mma, sc, qz, G, x.dtype), rep_ms=50)
            model = dequant_cublas_time_us(M, IC, OC) / 1e3
            out.append([shape, M, t_dq, t_mm, t_both, model, model / t_both, 2 * M * OC * IC / t_mm / 1e9])
        print("done", shape, flush=True)
        L2Rotation.stop()
    return out


def dispatch_audit(rows: list, takes_wgmma, decode_max_m: int) -> list:
    """Per matrix and M of a wgmma sweep's rows: the path awq_mma_linear dispatches to (the Hopper kernel where
    `takes_wgmma(m, k, n)`, else the decode kernel up to `decode_max_m` rows, else dequantize + cuBLAS), its time, the
    fastest path measured (any swept kernel configuration, the decode kernel, dequantize + cuBLAS) and the ratio of
    the two: where the time model's choice is off, and by how much (1.00: it took the fastest)."""
    out = []
    for (shape, m), group in itertools.groupby(rows, key=lambda r: (r[0], r[1])):
        group = list(group)
        n, k = map(int, shape.split("x"))
        times = {}
        for r in group:  # (a stream-K default is swept twice under the same name: its faster time)
            name = f"wgmma {r[2]}x{r[3]}/{r[4]} {r[5]}".rstrip()
            times[name] = min(times.get(name, float("inf")), r[7])
        times["decode kernel"], times["dequant+cuBLAS"] = group[0][12], group[0][13]
        default = next((r[7] for r in group if r[6] == "*"), float("nan"))
        if takes_wgmma(m, k, n):
            path, t_path = "wgmma (default)", default
        elif m <= decode_max_m:
            path, t_path = "decode kernel", times["decode kernel"]
        else:
            path, t_path = "dequant+cuBLAS", times["dequant+cuBLAS"]
        measured = {name: t for name, t in times.items() if t == t}  # NaN: not run at this M
        best = min(measured, key=measured.get)
        out.append([shape, m, path, t_path, best, measured[best], t_path / measured[best]])
    return out


def _rotated_rows(shapes: str, ms: str, scale_dtype: str = "fp16"):
    """For each shape (rotated_mma_case, weights rotated through L2) and M: (shape, OC, IC, sc, qz, mma, tickets, M, x,
    bf16 ms of x @ w.T in the same run)."""
    try:
        for shape in shapes.split(","):
            OC, IC, w, qw, sc, qz, wbytes, mma, tickets = rotated_mma_case(shape, scale_dtype)
            for M in map(int, ms.split(",")):
                x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
                t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w), rep_ms=50)
                yield shape, OC, IC, sc, qz, mma, tickets, M, x, t_bf16
                print("done", shape, M, flush=True)
    finally:
        L2Rotation.stop()


def stream_k_check(shapes: str, ms: str, scale_dtype: str = "fp16") -> list:
    """The wgmma dispatch with stream-K (awq_wgmma_cost.STREAM_K_US) against the same dispatch without it (every
    stream-K estimate made infinite), bf16 in the same run: what the twenty-first session's dispatch change buys or
    costs on each shape and M, where wgmma_rows_ok sends the call to the kernel either way."""
    from torchforge.ops import awq_wgmma_cost as cost
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, wgmma_cuda_config

    def config(m, k, n, sms, stream_k):
        saved = cost.wgmma_stream_k_time_us
        if not stream_k:
            cost.wgmma_stream_k_time_us = lambda *a, **kw: float("inf")
        cost.best_wgmma_config.cache_clear()
        try:
            return wgmma_cuda_config(m, k, n, sms)
        finally:
            cost.wgmma_stream_k_time_us = saved
            cost.best_wgmma_config.cache_clear()

    out = []
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    for shape, OC, IC, sc, qz, mma, tickets, M, x, t_bf16 in _rotated_rows(shapes, ms, scale_dtype):
        new, old = config(M, IC, OC, sms, True), config(M, IC, OC, sms, False)
        t = {}
        for cfg in {new, old}:
            t[cfg] = bench_graph_ms(lambda: launch_awq_wgmma_cuda(x, mma, sc, qz, G, config=cfg, tickets=tickets),
                                    rep_ms=50)
        out.append([shape, M, str(new[:3]), str(old[:3]), t[new], t[old], t[old] / t[new], t_bf16,
                    t_bf16 / t[new], t_bf16 / t[old]])
    return out


def cluster_check(shapes: str, ms: str, split_counts: str = "2,3,4,6,8", scale_dtype: str = "fp16") -> list:
    """Every tile in K slices (awq_wgmma_cuda, dp_tiles 0), the slices meeting through fp32 partials in global memory
    (one last block reads them all) against the same slices run as a thread block cluster (cluster=True: they meet in
    distributed shared memory), bf16 and the dispatched configuration in the same run. `same` checks the two give the
    same bits; `slots`: clusters of that many blocks the device runs at once (awq_wgmma_cluster_slots)."""
    from torchforge.ops.awq_mma_cuda import launch_awq_wgmma_cuda, wgmma_cuda_config
    from torchforge.ops.awq_wgmma_cost import wgmma_blocks

    out = []
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    for shape, OC, IC, sc, qz, mma, tickets, M, x, t_bf16 in _rotated_rows(shapes, ms, scale_dtype):
        default = wgmma_cuda_config(M, IC, OC, sms)
        t_default = bench_graph_ms(lambda: launch_awq_wgmma_cuda(x, mma, sc, qz, G, config=default,
                                                                 tickets=tickets), rep_ms=50)
        for bm, tw in ((64, 2), (128, 2), (192, 1), (256, 1)):
            if bm > 2 * M and bm > 64:
                continue
            blocks = wgmma_blocks(M, OC, (bm, tw))
            for splits in map(int, split_counts.split(",")):
                slots = torch.ops.torchforge.awq_wgmma_cluster_slots(bm, tw, splits)
                if slots == 0 or blocks * splits > 2 * sms or splits > IC // 64:
                    continue
                t, res = {}, {}
                for cluster in (False, True):
                    cfg = (bm, tw, splits, 8, True, 0, cluster)
                    f = lambda: launch_awq_wgmma_cuda(x, mma, sc, qz, G, config=cfg, tickets=tickets)  # noqa: E731
                    res[cluster] = f()
                    t[cluster] = bench_graph_ms(f, rep_ms=30)
                out.append([shape, M, f"({bm}, {tw})", splits, blocks * splits, slots, t[False], t[True],
                            t[False] / t[True], "yes" if torch.equal(res[False], res[True]) else "NO", t_bf16,
                            str(default[:3]), t_default, t_bf16 / min(t[True], t_default)])
    return out


def cluster_dispatch_check(shapes: str, ms: str, scale_dtype: str = "fp16") -> list:
    """awq_mma_linear as dispatched with clusters in the time model (new) and without (old: the dispatch's
    awq_mma_cuda._clusters_ok answering False), bf16 in the same run: what the thirty-third session's dispatch change
    buys or costs, including the rows it moves from the decode kernel to the Hopper kernel (path: the wgmma config
    (block_m, tile_set, splits, c for a cluster), or "decode" / "cuBLAS")."""
    from torchforge.ops import awq_mma_cuda
    from torchforge.ops.awq_mma import awq_mma_linear
    from torchforge.ops.awq_mma_cuda import MMA_CUDA_MAX_M, wgmma_cuda_config, wgmma_rows_ok

    clusters_ok = awq_mma_cuda._clusters_ok

    def use_clusters(on: bool) -> None:
        # (the device's own slots since the review fixes: emptying the H100 table, as the first run of this check
        # did, no longer turns them off)
        awq_mma_cuda._clusters_ok = clusters_ok if on else (lambda *a, **kw: False)

    def path(m, k, n, sms):
        if not wgmma_rows_ok(m, k, n, sms):
            return "decode" if m <= MMA_CUDA_MAX_M else "cuBLAS"
        c = wgmma_cuda_config(m, k, n, sms)
        return f"{c[0]}x{c[1]}/{c[2]}" + ("t" if c[5] else "") + ("c" if c[6] else "")

    out = []
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    try:
        for shape, OC, IC, sc, qz, mma, tickets, M, x, t_bf16 in _rotated_rows(shapes, ms, scale_dtype):
            t, p = {}, {}
            for on in (True, False):
                use_clusters(on)
                p[on] = path(M, IC, OC, sms)
                t[on] = bench_graph_ms(lambda: awq_mma_linear(x, mma, sc, qz, G, tickets=tickets), rep_ms=50)
            out.append([shape, M, p[True], p[False], t[True], t[False], t[False] / t[True], t_bf16,
                        t_bf16 / t[True], t_bf16 / t[False]])
    finally:
        use_clusters(True)
    return out


def _mma_call_cases(shapes: str, ms: str):
    """(shape, M, us) for each shape and M, the weights rotated: us(kind) is the CUDA-graph time in microseconds of a
    bf16 F.linear ("bf16") or awq_mma_linear as dispatched ("op"), each also after a norm-like kernel ("bf16 norm",
    "op norm": x * g, one torch elementwise kernel without PDL, before every call, its time included), under
    whatever launch settings the caller has made."""
    from torchforge.ops.awq_mma import awq_mma_linear

    try:
        for shape in shapes.split(","):
            OC, IC, w, qw, sc, qz, wbytes, mma, tickets = rotated_mma_case(shape)
            g = torch.rand(IC, device="cuda", dtype=torch.bfloat16) + 0.5
            for M in map(int, ms.split(",")):
                x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
                fns = {"bf16": lambda: torch.nn.functional.linear(x, w),
                       "bf16 norm": lambda: torch.nn.functional.linear(x * g, w),
                       "op": lambda: awq_mma_linear(x, mma, sc, qz, G, tickets=tickets),
                       "op norm": lambda: awq_mma_linear(x * g, mma, sc, qz, G, tickets=tickets)}
                yield shape, M, lambda kind: 1e3 * bench_graph_ms(fns[kind], rep_ms=50)
                print("done", shape, M, flush=True)
    finally:
        L2Rotation.stop()


def pdl_check(shapes: str, ms: str) -> list:
    """awq_mma_linear as dispatched at the three levels of programmatic dependent launch (csrc/pdl.cuh: 0 off, 1 within
    an op, 2 every launch), bf16 in the same run. Back to back (each call right after the previous one, as every other
    table here times it: at level 2 a call overlaps the end of the call before) and after a norm-like kernel (as an
    RMSNorm precedes a projection in a model; at level 2 the call may launch as that kernel's blocks exit and prefetch
    its first weights while it drains). `np`: level 1 with the decode kernel's L2 prefetch at its start turned off
    (set_start_prefetch). Microseconds."""
    from torchforge.ops._ext import set_pdl, set_start_prefetch

    out, levels = [], (0, 1, 2, "np")
    previous = set_pdl(1)
    try:
        for shape, M, us in _mma_call_cases(shapes, ms):
            bf16, bf16_norm = us("bf16"), us("bf16 norm")
            t, tn = {}, {}
            for level in levels:
                set_pdl(1 if level == "np" else level)
                set_start_prefetch(0 if level == "np" else -1)
                t[level], tn[level] = us("op"), us("op norm")
            out.append([shape, M, f"{bf16:.1f}", *(f"{t[v]:.1f}" for v in levels),
                        *(f"{bf16 / t[v]:.2f}x" for v in levels), f"{bf16_norm:.1f}",
                        *(f"{tn[v]:.1f}" for v in levels), *(f"{bf16_norm / tn[v]:.2f}x" for v in levels)])
    finally:
        set_pdl(previous)
        set_start_prefetch(-1)
    return out


def prefetch_sweep(shapes: str, ms: str) -> list:
    """awq_mma_linear as dispatched with the decode kernel's L2 prefetch at its start by the launcher's rule and
    forced to 0, 1 or 2 rounds of items (set_start_prefetch), back to back and after a norm-like kernel (as in
    pdl_check), bf16 in the same run. Microseconds."""
    from torchforge.ops._ext import set_start_prefetch

    out, modes = [], (-1, 0, 1, 2)
    try:
        for shape, M, us in _mma_call_cases(shapes, ms):
            bf16 = us("bf16")
            t, tn = {}, {}
            for mode in modes:
                set_start_prefetch(mode)
                t[mode], tn[mode] = us("op"), us("op norm")
            out.append([shape, M, f"{bf16:.1f}", *(f"{t[v]:.1f}" for v in modes),
                        *(f"{tn[v]:.1f}" for v in modes), f"{bf16 / min(t.values()):.2f}x"])
    finally:
        set_start_prefetch(-1)
    return out


def gemv_sweep(shapes: str) -> list:
    from torchforge.ops.awq_gemv_triton import gemv_config, launch_w4a16_gemv
    from torchforge.ops.awq_reference import awq_dequantize_ref
    from torchforge.ops.awq_splitk_triton import launch_w4a16_splitk

    rows = []
    for shape in shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes = quantized_case(shape)
        L2Rotation.start(wbytes, w, qw, sc, qz)
        x = torch.randn(1, IC, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), awq_dequantize_ref(qw, sc, qz, G).float())
        t_split = bench_graph_ms(lambda: launch_w4a16_splitk(x, qw, sc, qz, G))
        t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w))
        groups = IC // G
        _, _, auto_split, _ = gemv_config(IC, OC, G)
        for bw in (32, 64, 128):
            for bk in (8, 16, 32):
                for nw in (2, 4, 8):
                    for split in sorted({auto_split, max(1, auto_split // 2), min(groups, auto_split * 2)}):
                        if groups % split:
                            continue
                        f = lambda: launch_w4a16_gemv(x, qw, sc, qz, G, block_w=bw, block_k=bk, split_k=split,  # noqa: E731
                                                      num_warps=nw)
                        try:
                            rel = ((f().float() - ref).norm() / ref.norm()).item()
                            t = bench_graph_ms(f, rep_ms=30)
                        except Exception as e:  # noqa: BLE001 - a config that does not compile
                            print(f"gemv {shape} {bw} {bk} {nw} {split}: {type(e).__name__}: {str(e)[:100]}")
                            continue
                        rows.append([shape, bw, bk, split, nw, t, wbytes / t / 1e6, t_split, t_bf16, f"{rel:.1e}"])
    rows.sort(key=lambda r: (r[0], r[5]))
    L2Rotation.stop()
    return rows


def mma_candidates(m: int) -> list:
    """MmaConfig grid per M bucket for `--mma-sweep`. The first two sweeps (2026-11-22, BENCHMARKS.md) settled the
    layout (SWAP_AB + FACTORED up to 16 rows, the plain layout from 64) and register prefetch; `ncu` then showed
    the kernel latency bound (no unit above 51% busy; 4 resp. 2 blocks per SM, limited by registers), so this grid
    varies what sets registers and bytes in flight: BLOCK_K, warps, stages, SPLIT_K."""
    from torchforge.ops.awq_mma_triton import MmaConfig

    if m <= 16:
        return [MmaConfig(16, 64, bk, sp, True, True, nw, st, True) for bk in (32, 64, 128) for sp in (4, 8)
                for nw in (2, 4) for st in (2, 3)]
    if m <= 64:
        return ([MmaConfig(64, 64, bk, sp, False, False, nw, st, True) for bk in (32, 64, 128) for sp in (2, 4)
                 for nw in (4, 8) for st in (2, 3)]
                + [MmaConfig(64, 64, 64, sp, True, True, 4, 3, True) for sp in (2, 4)])
    if m <= 256:
        return [MmaConfig(bm, bn, 128, sp, False, f, 4, 4, True) for bm, bn, sp in ((64, 64, 2), (64, 128, 1),
                                                                                   (128, 128, 1)) for f in (False, True)]
    return [MmaConfig(128, 128, 64, 1, False, False, 4, st, pf) for st in (3, 4) for pf in (False, True)]


def mma_sweep(shapes: str, ms: str) -> list:
    """Time every `mma_candidates` config of the tensor-core kernel; bf16 and the dispatched op in the same run."""
    import time

    import torchforge
    from torchforge.ops.awq_mma_triton import launch_w4a16_mma
    from torchforge.ops.awq_reference import awq_dequantize_ref

    deadline = time.time() + float(os.environ.get("SWEEP_BUDGET_S", "420"))  # print what we have within a device call
    rows = []
    for shape in shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes = quantized_case(shape)
        L2Rotation.start(wbytes, w, qw, sc, qz)
        wdq = awq_dequantize_ref(qw, sc, qz, G).float()
        for M in map(int, ms.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wdq.T
            t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w), rep_ms=50)
            t_op = bench_graph_ms(lambda: torchforge.ops.w4a16_linear(x, qw, sc, qz, G), rep_ms=50)
            for cfg in mma_candidates(M):
                if time.time() > deadline:
                    print(f"mma sweep: time budget spent, skipped {shape} M={M} {cfg}")
                    continue
                f = lambda: launch_w4a16_mma(x, qw, sc, qz, G, config=cfg)  # noqa: E731
                try:
                    rel = ((f().float() - ref).norm() / ref.norm()).item()
                    t = bench_graph_ms(f, rep_ms=30)
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"mma {shape} M={M} {cfg}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                rows.append([shape, M, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, int(cfg.swap_ab),
                             int(cfg.factored), int(cfg.prefetch), cfg.num_warps, cfg.num_stages, t, t_bf16 / t, t_op,
                             wbytes / t / 1e6, f"{rel:.1e}"])
    rows.sort(key=lambda r: (r[0], r[1], r[11]))
    L2Rotation.stop()
    return rows


def _report(rows: list, title: str, columns: list) -> int:
    """A sweep's table: the device line, the title, the rows (what every table-printing mode of main ends with)."""
    print(f"device: {device_line()}")
    print("\n" + title)
    print(markdown_table(columns, rows))
    return 0


def main() -> int:
    global G
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--shapes", default="18432x7168,7168x7168", help="OCxIC list")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--gemv-sweep", action="store_true", help="time the batch-1 GEMV kernel's configurations")
    ap.add_argument("--cuda-gemv-sweep", action="store_true",
                    help="time the extension's batch-1 GEMV (csrc/awq_gemv.cu) over its configurations, then stop")
    ap.add_argument("--mma-cuda-sweep", default="",
                    help="M list: time the extension's tensor-core kernel on the mma layout (csrc/awq_mma.cu), then stop")
    ap.add_argument("--cublas-fit", default="", help="M list: time dequantize + cuBLAS in parts against the "
                                                     "dispatch's estimate of it, then stop")
    ap.add_argument("--mma-splits", default="1,2,3,4,6,8", help="with --mma-cuda-sweep: the K slice counts tried")
    ap.add_argument("--mma-chunks", default="", help="with --mma-cuda-sweep: the item chunk counts tried (1: items of "
                                                     "64 k, 2: 128 k; default: as dispatched)")
    ap.add_argument("--mma-sweep", default="", help="M list: time the tensor-core kernel's configurations, then stop")
    ap.add_argument("--wgmma-sweep", default="",
                    help="M list: time the extension's Hopper kernel (csrc/awq_wgmma.cu) over its configurations, "
                         "then stop")
    ap.add_argument("--best", action="store_true", help="with --wgmma-sweep: print only the fastest configuration per M")
    ap.add_argument("--wgmma-ws", action="store_true",
                    help="with --wgmma-sweep: also time the warp-specialized kernel (producer_warp)")
    ap.add_argument("--wgmma-splits", default="1,2,3,4,6,8", help="with --wgmma-sweep: the K slice counts tried")
    ap.add_argument("--wgmma-tail", action="store_true",
                    help="with --wgmma-sweep: K slices on the last round's tiles only (dp_tiles), instead of on "
                         "every tile")
    ap.add_argument("--wgmma-only", default="",
                    help="with --wgmma-sweep: only these block shapes (e.g. 64x2,128x2) besides the default")
    ap.add_argument("--cluster-check", default="",
                    help="M list: K slices through global partials against clusters (distributed shared memory)")
    ap.add_argument("--cluster-dispatch-check", default="",
                    help="M list: awq_mma_linear as dispatched with clusters in the time model and without")
    ap.add_argument("--stream-k-check", default="",
                    help="M list: the wgmma dispatch with stream-K against the one without, then stop")
    ap.add_argument("--prefetch-sweep", default="",
                    help="M list: the decode kernel's L2 prefetch at its start by rule and forced to 0, 1, 2 rounds")
    ap.add_argument("--pdl-check", default="",
                    help="M list: awq_mma_linear as dispatched at PDL levels 0, 1 and 2, back to back and after a "
                         "norm kernel, bf16 in the same run (csrc/pdl.cuh)")
    ap.add_argument("--group-size", type=int, default=G,
                    help="quantization group of the cases (32, 64, 128; issue 4's goals are at 128); run with 32 "
                         "on the device: the as-dispatched table and --mma-cuda-sweep")
    ap.add_argument("--scale-dtype", default="fp16", choices=("fp16", "bf16"),
                    help="with --stream-k-check: the scales' dtype (x is bf16)")
    args = ap.parse_args()
    G = args.group_size
    if not torch.cuda.is_available():
        print("bench/w4a16_linear.py: no CUDA device; nothing to measure")
        return 0
    if args.cuda_gemv_sweep:
        return _report(cuda_gemv_sweep(args.shapes),
                       "CUDA batch-1 GEMV (csrc/awq_gemv.cu) sweep, CUDA graph, bf16; * = default; Triton GEMV, tinygemm and "
                       "bf16 in the same run:",
                       ["W", "rows", "splits", "default", "ms", "int4 GB/s", "Triton GEMV ms", "tinygemm ms",
                        "bf16 ms", "bf16/ms", "rel err"])
    if args.mma_cuda_sweep:
        return _report(mma_cuda_sweep(args.shapes, args.mma_cuda_sweep, args.mma_splits, args.mma_chunks),
                       "CUDA tensor-core kernel on the mma layout (csrc/awq_mma.cu), CUDA graph, bf16 x; * = default splits, warps, chunks and prefetch; "
                       "op = w4a16_linear on the AWQ layout as dispatched; tinygemm and bf16 in the same run:",
                       ["W", "M", "scales", "zeros", "splits", "warps", "chunks", "prefetch", "default", "ms", "us",
                        "int4 GB/s",
                        "op ms",
                        "tinygemm ms", "bf16 ms",
                        "bf16/ms", "tinygemm/ms", "rel err"])
    if args.prefetch_sweep:
        return _report(prefetch_sweep(args.shapes, args.prefetch_sweep),
                       "awq_mma_linear as dispatched, the decode kernel's L2 prefetch at its start by rule (-1) and forced to "
                       "0, 1, 2 rounds of items, CUDA graphs, weights rotated, bf16 x, fp16 scales, us; norm: x * g before "
                       "every call, included:",
                       ["W", "M", "bf16", "rule", "0", "1", "2", "rule norm", "0 norm", "1 norm", "2 norm",
                        "bf16/best"])
    if args.pdl_check:
        return _report(pdl_check(args.shapes, args.pdl_check),
                       "awq_mma_linear as dispatched at PDL levels 0 (off), 1 (within an op) and 2 (every launch), CUDA "
                       "graphs, weights rotated, bf16 x, fp16 scales, us; np: level 1 without the decode kernel's L2 prefetch at "
                       "its start; `norm`: x * g (one torch kernel) before every call, its time included, bf16 too:",
                       ["W", "M", "bf16", "L0", "L1", "L2", "np", "bf16/L0", "bf16/L1", "bf16/L2", "bf16/np",
                        "bf16 norm", "L0 norm", "L1 norm", "L2 norm", "np norm", "bf16/L0 norm", "bf16/L1 norm",
                        "bf16/L2 norm", "bf16/np norm"])
    if args.cublas_fit:
        return _report(cublas_fit(args.shapes, args.cublas_fit),
                       "dequantize + cuBLAS in parts (weights rotated, bf16 x, fp16 scales, CUDA graphs), ms, against "
                       "the dispatch's estimate (awq_wgmma_cost.dequant_cublas_time_us):",
                       ["W", "M", "dequant ms", "matmul ms", "both ms", "model ms", "model / both", "matmul TFLOP/s"])
    if args.cluster_check:
        return _report(cluster_check(args.shapes, args.cluster_check, args.wgmma_splits, args.scale_dtype),
                       f"every tile in K slices, partials in global memory against a cluster per tile (DSMEM), CUDA "
                       f"graphs, weights rotated, bf16 x, {args.scale_dtype} scales, ms; dispatched = the time model's "
                       f"choice (block_m, tile_set, splits):",
                       ["W", "M", "block", "splits", "blocks", "slots", "partials ms", "cluster ms",
                        "partials/cluster", "same bits", "bf16 ms", "dispatched", "dispatched ms",
                        "bf16/best"])
    if args.cluster_dispatch_check:
        return _report(cluster_dispatch_check(args.shapes, args.cluster_dispatch_check, args.scale_dtype),
                       f"awq_mma_linear as dispatched with clusters (new) and without (old), CUDA graphs, weights "
                       f"rotated, bf16 x, {args.scale_dtype} scales; path: wgmma block_m x tile_set / splits (t: the "
                       f"last round's tiles, c: clusters), or the decode kernel / dequantize + cuBLAS:",
                       ["W", "M", "new path", "old path", "new ms", "old ms", "old/new", "bf16 ms", "bf16/new",
                        "bf16/old"])
    if args.stream_k_check:
        return _report(stream_k_check(args.shapes, args.stream_k_check, args.scale_dtype),
                       f"wgmma dispatch with stream-K (new) and without (old), CUDA graphs, weights rotated, bf16 x, "
                       f"{args.scale_dtype} scales; config = (block_m, tile_set, splits), splits 0 = stream-K:",
                       ["W", "M", "new config", "old config", "new ms", "old ms", "old/new", "bf16 ms",
                        "bf16/new", "bf16/old"])
    if args.wgmma_sweep:
        wrows = wgmma_sweep(args.shapes, args.wgmma_sweep, args.wgmma_ws, args.wgmma_only,
                            args.wgmma_splits, args.wgmma_tail)
        from torchforge.ops.awq_mma_cuda import MMA_CUDA_MAX_M, wgmma_rows_ok

        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        print("\nDispatch audit: awq_mma_linear's path against the fastest measured (same run):")
        print(markdown_table(["W", "M", "dispatched", "dispatched ms", "fastest", "fastest ms", "dispatched / fastest"],
                             dispatch_audit(wrows, lambda m, k, n: wgmma_rows_ok(m, k, n, sms), MMA_CUDA_MAX_M)))
        if args.best:
            wrows = [r for i, r in enumerate(wrows) if i == 0 or r[:2] != wrows[i - 1][:2] or r[6] == "*"]
        return _report(wrows,
                       "Hopper W4A16 kernel on the mma layout (csrc/awq_wgmma.cu), CUDA graph, bf16 x, fp16 scales; "
                       "* = default; bf16, the decode kernel (csrc/awq_mma.cu), dequantize + cuBLAS and tinygemm in the "
                       "same run:",
                       ["W", "M", "block_m", "tile_set", "splits", "kernel", "default", "ms", "model ms", "TFLOP/s",
                        "int4 GB/s", "bf16 ms", "decode kernel ms", "dequant+cuBLAS ms", "tinygemm ms", "bf16/ms",
                        "rel err"])
    if args.mma_sweep:
        return _report(mma_sweep(args.shapes, args.mma_sweep),
                       "tensor-core kernel (awq_mma_triton.py) sweep, CUDA graph, bf16; ratio = bf16 / config:",
                       ["W", "M", "BM", "BN", "BK", "split", "swap", "fact", "prefetch", "warps", "stages", "ms", "bf16/ms",
                        "op ms", "int4 GB/s", "rel err"])
    import torchforge
    from torchforge.ops.awq_dequant_triton import launch_awq_dequantize_t
    from torchforge.ops.awq_reference import awq_dequantize_ref
    from torchforge.ops.awq_gemv_triton import launch_w4a16_gemv
    from torchforge.ops.awq_mma_triton import launch_w4a16_mma
    from torchforge.ops.awq_moe_gemv_triton import launch_awq_moe_gemv
    from torchforge.ops.awq_splitk_triton import launch_w4a16_splitk
    from torchforge.ops.awq_triton import launch_w4a16_linear
    from torchforge.ops import awq_unpack
    from torchforge.ops.awq_mma import awq_mma_linear
    from torchforge.ops.awq_mma_cuda import mma_tickets
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout
    from torchforge.ops.gptq import gptq_pack, gptq_pack_zeros, trivial_g_idx, w4a16_gptq_linear
    from torchforge.ops.zero_points import zeros_are_8

    torch.manual_seed(0)
    rows, sweep_rows = [], []
    for shape in args.shapes.split(","):
        OC, IC, w, qw, sc, qz, wbytes = quantized_case(shape)
        mma = awq_to_mma_layout(qw)
        # the same numbers in the GPTQ layout (symmetric: true zero point 8, stored as 7 by GPTQ's v1 convention)
        g_qw = gptq_pack(awq_unpack(qw))
        g_qz = gptq_pack_zeros(awq_unpack(qz))
        g_idx = trivial_g_idx(IC, G, device="cuda")
        zero_id = torch.zeros(1, dtype=torch.int64, device="cuda")
        mma_tickets_ = mma_tickets(OC, "cuda")
        zeros_8 = zeros_are_8(qz)  # what a module on the mma layout looks at once (use_mma_layout)
        L2Rotation.start(wbytes, w, qw, sc, qz, mma, g_qw, g_qz)
        for M in map(int, args.m.split(",")):
            x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x.float(), awq_dequantize_ref(qw, sc, qz, G).float())
            op = lambda: torchforge.ops.w4a16_linear(x, qw, sc, qz, G)  # noqa: E731
            rel = ((op().float() - ref).norm() / ref.norm()).item()
            t_bf16 = bench_graph_ms(lambda: torch.nn.functional.linear(x, w))
            t_op = bench_graph_ms(op)
            t_eager = bench_ms(op)
            t_tiled = bench_graph_ms(lambda: launch_w4a16_linear(x, qw, sc, qz, G)) if M <= 256 else float("nan")
            t_split = bench_graph_ms(lambda: launch_w4a16_splitk(x, qw, sc, qz, G)) if M <= 16 else float("nan")
            t_gemv = bench_graph_ms(lambda: launch_w4a16_gemv(x, qw, sc, qz, G)) if M == 1 else float("nan")
            # the MoE decode GEMV with one expert: its 8-accumulator inner loop compiles to ~4 instructions per
            # weight against ~5.9 for the dense GEMV's (SASS read on CPU); this column says whether that shows
            t_gemv8 = (bench_graph_ms(lambda: launch_awq_moe_gemv(x, zero_id, qw[None], sc[None], qz[None], G))
                       if M == 1 else float("nan"))
            t_mma = bench_graph_ms(lambda: launch_w4a16_mma(x, qw, sc, qz, G)) if 1 < M <= 256 else float("nan")
            t_deq = bench_graph_ms(lambda: x @ launch_awq_dequantize_t(qw, sc, qz, G, x.dtype))
            t_tg = timed_tinygemm(w, x)
            mma_op = lambda sym=zeros_8: awq_mma_linear(x, mma, sc, qz, G, tickets=mma_tickets_,  # noqa: E731
                                                        symmetric=sym)  # (a module's)
            rel_mma = ((mma_op().float() - ref).norm() / ref.norm()).item()
            t_lay = bench_graph_ms(mma_op)
            t_lay_z = bench_graph_ms(lambda: mma_op(False)) if zeros_8 else t_lay
            t_gptq = bench_graph_ms(lambda: w4a16_gptq_linear(x, g_qw, sc, g_qz, g_idx))
            rows.append([f"{OC}x{IC}", M, t_bf16, t_op, t_eager, t_gemv, t_gemv8, t_mma, t_tiled, t_split, t_deq, t_tg,
                         t_bf16 / t_op, t_tg / t_op, wbytes / t_op / 1e6, f"{rel:.1e}", t_lay, t_bf16 / t_lay,
                         t_tg / t_lay, wbytes / t_lay / 1e6, f"{rel_mma:.1e}", t_lay_z, t_bf16 / t_lay_z, t_gptq,
                         t_bf16 / t_gptq])
            print("row:", " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
        if args.sweep:
            for M in (1, 16):
                x = torch.randn(M, IC, device="cuda", dtype=torch.bfloat16)
                for bn in (64, 128, 256):
                    for bk in (64, 128):
                        for split in (4, 8, 16):
                            for nw in (4, 8):
                                if IC % (split * bk):
                                    continue
                                f = lambda: launch_w4a16_splitk(  # noqa: E731
                                    x, qw, sc, qz, G, block_n=bn, block_k=bk, split_k=split, num_warps=nw)
                                t = bench_graph_ms(f, rep_ms=30)
                                sweep_rows.append([f"{OC}x{IC}", M, bn, bk, split, nw, t, wbytes / t / 1e6])
    L2Rotation.stop()
    gemv_rows = gemv_sweep(args.shapes) if args.gemv_sweep else []
    print(f"device: {device_line()}")
    if gemv_rows:
        print("\nbatch-1 GEMV (awq_gemv_triton.py) sweep, CUDA graph, bf16; split-K kernel and bf16 in the same run:")
        print(markdown_table(["W", "BLOCK_W", "BLOCK_K", "SPLIT_K", "warps", "ms", "int4 GB/s", "split-K ms", "bf16 ms",
                              "rel err"], gemv_rows))
    if sweep_rows:
        print("\nsplit-K sweep (CUDA graph):")
        sweep_rows.sort(key=lambda r: (r[0], r[1], r[6]))
        print(markdown_table(["W", "M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "warps", "ms", "int4 GB/s"], sweep_rows))
    print("\nw4a16_linear vs bf16 (ms, CUDA-graph medians unless eager):")
    print(markdown_table(["W [OC x IC]", "M", "bf16", "w4a16", "w4a16 eager", "GEMV", "MoE GEMV, E=1", "tensor-core", "tiled", "split-K", "dequant+cuBLAS",
                          "tinygemm", "bf16/w4a16", "tinygemm/w4a16", "int4 GB/s", "rel err", "mma layout",
                          "bf16/mma", "tinygemm/mma", "mma int4 GB/s", "mma rel err", "mma, zeros read",
                          "bf16/mma, zeros read", "GPTQ layout kernel",
                          "bf16/GPTQ kernel"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
