"""GPTQ solver on DeepSeek-V3 expert shapes: the per-column reference loop against the fast batched solver,
and the output error of RTN / GPTQ reference / fast GPTQ (with and without the L^2.4 scale search).

    python bench/gptq.py [--batches 32,256] [--json out.json]

Timing (CUDA): ``torchforge.gptq.solve`` (blocked GPTQ, Python loop over every column, one matrix) against
``torchforge.gptq.solve_batched`` (Triton block kernel + batched lazy update, all matrices in one call) on
``[2048, 7168]`` (gate or up: OC x IC), ``[4096, 7168]`` (gate+up fused: one Hessian per expert, what the
calibration driver solves) and ``[7168, 2048]`` (down). Times include the Hessian factorisation. Dense
Hessians of 256 gate/up experts need 52.6 GB for H alone, so that batch runs as chunks of 32 experts
(printed); block-diagonal Hessians (bs 128) run all 256 in one call. Every expert gets the same
(well-conditioned, correlated) Hessian: the work per matrix does not depend on the values. Also reported:
peak GPU memory of each fast call, time per matrix, the ratio reference / fast, with fp32 matmuls
(default) and with TF32 matmuls for the lazy update, and a projection for DeepSeek-V3's 58 MoE layers x
256 routed experts.

Quality: a ``[2048, 7168]`` layer, activations ``X [8192, 7168]`` with strongly correlated channels
(decaying spectrum), relative output error ``||X (W - Q)^T|| / ||X W^T||`` and its ratio to RTN.
Exits 0 with a message when there is no CUDA device (``--smoke`` runs the whole script on tiny shapes, on
the CPU without a GPU: a check that it works, not a measurement). Runtime on an H100: about 2 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import device_line, markdown_table  # noqa: E402

GS = 128
DEV = "cuda"
# DeepSeek-V3 dims; --smoke maps them to tiny ones
HID, INTER, TOKENS = 7168, 2048, 8192


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _sync_time(fn):
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t, out


def _reset_peak() -> int:
    if DEV != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_gb(base: int) -> float:
    return (torch.cuda.max_memory_allocated() - base) / 2**30 if DEV == "cuda" else 0.0


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def correlated_x(t: int, d: int, seed: int = 0) -> torch.Tensor:
    """Activations with a decaying spectrum and correlated channels (like LLM hidden states), plus a few
    outlier channels."""
    g = _gen(seed)
    mix = torch.randn(d, d, device=DEV, generator=g) * torch.logspace(0, -2.5, d, device=DEV).unsqueeze(1)
    x = torch.randn(t, d, device=DEV, generator=g) @ mix / d**0.5
    x += 0.02 * torch.randn(t, d, device=DEV, generator=g)
    x[:, torch.randperm(d, device=DEV, generator=g)[:8]] *= 10.0
    return x


def hessian_for(d: int, seed: int = 0) -> torch.Tensor:
    from torchforge.gptq import accumulate_hessian

    x = correlated_x(2 * d, d, seed)
    h, _ = accumulate_hessian(x, d)
    return h


def time_reference(oc: int, ic: int, h: torch.Tensor) -> float:
    from torchforge.gptq import solve

    w = torch.randn(oc, ic, device=DEV) * 0.02
    sec, _ = _sync_time(lambda: solve(w, h, group_size=GS))
    return sec


def time_fast(oc: int, ic: int, b: int, h: torch.Tensor, chunk: int | None, block: bool = False) -> tuple[float, float]:
    """(seconds for all b matrices, peak GB). Weights in bf16 like a checkpoint; H cloned per chunk."""
    from torchforge.gptq import solve_batched

    w = (torch.randn(b, oc, ic, device=DEV) * 0.02).to(torch.bfloat16)
    step = chunk or b
    solve_batched(w[:1], h[None].clone(), group_size=GS, inplace=True)  # Triton specialises on strides: compile here
    base = _reset_peak()
    t0 = time.perf_counter()
    for i in range(0, b, step):
        n = min(step, b - i)
        hb = h.expand(n, *h.shape).clone()
        solve_batched(w[i:i + n], hb, group_size=GS, inplace=True)
        del hb
    _sync()
    sec = time.perf_counter() - t0
    peak = _peak_gb(base)
    del w
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return sec, peak


def quality(oc: int, ic: int, tokens: int) -> list[list]:
    from torchforge.gptq import accumulate_hessian, solve, solve_batched
    from torchforge.ops.awq import awq_dequantize, awq_quantize
    from torchforge.ops.qmeta4 import qmeta4_build, qmeta4_decode, qmeta4_effective_scale, qmeta4_mse_refine

    x = correlated_x(tokens, ic, seed=1)
    w = torch.randn(oc, ic, device=DEV, generator=_gen(2)) * 0.02
    h, _ = accumulate_hessian(x, ic)
    hb, _ = accumulate_hessian(x, ic, block_size=128)
    ref_out = x @ w.T

    def err(w_hat):
        return float((x @ (w - w_hat).T).norm() / ref_out.norm())

    def rtn(mse):
        q = qmeta4_build(w, GS, 4, True)
        if mse:
            q = qmeta4_mse_refine(w, q, GS, 4)
        s = qmeta4_effective_scale(q).repeat_interleave(GS, -1)
        z = qmeta4_decode(q)[1].float().repeat_interleave(GS, -1)
        return (torch.clamp(torch.round(w / s) + z, 0, 15) - z) * s

    rows = []
    e_rtn = err(rtn(False))
    runs = [
        ("RTN (GPTQ grid: 2 amax / 15, zero 8)", lambda: rtn(False)),
        ("RTN + L^2.4 scale search", lambda: rtn(True)),
        ("RTN AWQ (amax / 7, zero 8)", lambda: awq_dequantize(*awq_quantize(w, GS, True), GS).float()),
        ("GPTQ reference (per-column loop)", lambda: solve(w, h, group_size=GS).dequantize()),
        ("GPTQ reference + L^2.4", lambda: solve(w, h, group_size=GS, mse=True).dequantize()),
        ("GPTQ fast", lambda: solve_batched(w[None], h[None], group_size=GS).dequantize()[0]),
        ("GPTQ fast + L^2.4", lambda: solve_batched(w[None], h[None], group_size=GS, mse=True).dequantize()[0]),
        ("GPTQ fast, static groups", lambda: solve_batched(w[None], h[None], group_size=GS,
                                                           static_groups=True).dequantize()[0]),
        ("GPTQ fast, block-diagonal H (bs 128)", lambda: solve_batched(w[None], hb[None], group_size=GS).dequantize()[0]),
    ]
    for name, fn in runs:
        sec, w_hat = _sync_time(fn)
        e = err(w_hat)
        rows.append([name, e, e / e_rtn, sec])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_gptq.json"))
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU without a GPU): checks the script runs")
    args = ap.parse_args()
    global DEV, HID, INTER, TOKENS
    if args.smoke:
        HID, INTER, TOKENS = 512, 256, 1024
        args.batches = "2,4"
        DEV = "cuda" if torch.cuda.is_available() else "cpu"
    elif not torch.cuda.is_available():
        print("bench/gptq.py: no CUDA device; nothing to measure")
        return 0
    import torchforge  # noqa: F401
    from torchforge.gptq import solve_batched

    t_start = time.perf_counter()
    print(device_line() if DEV == "cuda" else "CPU smoke run (tiny shapes, not a measurement)")
    batches = [int(b) for b in args.batches.split(",")]
    free_gb = torch.cuda.mem_get_info()[0] / 2**30 if DEV == "cuda" else 1e9
    hs = {d: hessian_for(d, seed=d) for d in (HID, INTER)}
    # compile the kernels (every shape class uses BLOCK_K = 128) outside the timings
    solve_batched(torch.randn(2, 256, 256, device=DEV), hessian_for(256)[None].expand(2, 256, 256).clone(),
                  group_size=GS)
    time_reference(64, 256, hessian_for(256))

    shapes = [("gate or up", INTER, HID), ("gate+up fused", 2 * INTER, HID), ("down", HID, INTER)]
    ref_sec = {}
    for name, oc, ic in shapes:
        if name == "gate+up fused":
            continue
        ref_sec[(oc, ic)] = time_reference(oc, ic, hs[ic])
        print(f"reference [{oc}, {ic}]: {ref_sec[(oc, ic)]:.2f} s per matrix", flush=True)
    ref_sec[(2 * INTER, HID)] = None
    rows, per_matrix = [], {}
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for name, oc, ic in shapes:
            for b in batches:
                if tf32 and b != batches[0]:
                    continue
                if name == "gate+up fused" and b != batches[0]:
                    continue
                need_gb = b * (ic * ic * 4 * 2 + oc * ic * (4 + 2 + 1)) / 2**30
                chunk = None
                if need_gb > 0.8 * free_gb:
                    chunk = 32
                sec, peak = time_fast(oc, ic, b, hs[ic], chunk)
                pm = sec / b
                per_matrix[(name, b, tf32)] = pm
                ref = ref_sec.get((oc, ic))
                rows.append([f"{name} [{oc}, {ic}]", b, "tf32" if tf32 else "fp32",
                             f"chunks of {chunk}" if chunk else "one call", sec, pm * 1e3, peak,
                             f"{ref / pm:.1f}x" if ref else "-"])
                print(rows[-1], flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    from torchforge.gptq.solver import _factor_batched

    for name, oc, ic in (("gate or up", INTER, HID), ("down", HID, INTER)):  # where the time goes: H -> U alone
        b = batches[0]
        hcl = hs[ic].expand(b, ic, ic).clone()
        wdummy = torch.zeros(b, 1, ic, device=DEV)
        sec, _ = _sync_time(lambda hcl=hcl, wdummy=wdummy: _factor_batched(hcl, wdummy, 0.01, False, True, "bench"))
        rows.append([f"{name} [{oc}, {ic}], factorisation H -> U only", b, "fp32", "one call", sec, sec / b * 1e3,
                     0.0, "-"])
        print(rows[-1], flush=True)
        del hcl
    for name, oc, ic in (("gate or up", INTER, HID), ("down", HID, INTER)):
        b = batches[-1]
        hb = torch.stack([hs[ic][i:i + 128, i:i + 128] for i in range(0, ic, 128)])
        w = (torch.randn(b, oc, ic, device=DEV) * 0.02).to(torch.bfloat16)
        base = _reset_peak()
        sec, _ = _sync_time(lambda w=w, hb=hb, b=b: solve_batched(w, hb.expand(b, *hb.shape).clone(), group_size=GS,
                                                                          inplace=True))
        peak = _peak_gb(base)
        per_matrix[(name + " block-diag", b, False)] = sec / b
        ref = ref_sec[(oc, ic)]
        rows.append([f"{name} [{oc}, {ic}], block-diagonal H", b, "fp32", "one call", sec, sec / b * 1e3, peak,
                     f"{ref / (sec / b):.1f}x"])
        print(rows[-1], flush=True)
        del w
        if DEV == "cuda":
            torch.cuda.empty_cache()

    print()
    print("## GPTQ solver time (includes the Hessian factorisation)\n")
    print(markdown_table(["matrix [OC, IC]", "B", "matmul", "how", "total s", "ms / matrix", "peak GB",
                          "reference / fast"], rows))
    print("\nreference per-column loop, one matrix: " + ", ".join(
        f"[{oc}, {ic}] {s:.2f} s" for (oc, ic), s in ref_sec.items() if s))
    b = batches[-1]
    proj = {}
    for tf32 in (False, True):
        bb = b if (("gate or up", b, tf32) in per_matrix) else batches[0]
        t_exp = 2 * per_matrix[("gate or up", bb, tf32)] + per_matrix[("down", bb, tf32)]
        t_fused = per_matrix[("gate+up fused", batches[0], tf32)] + per_matrix[("down", bb, tf32)]
        proj["tf32" if tf32 else "fp32"] = (58 * 256 * t_exp, 58 * 256 * t_fused)
    t_ref = 2 * ref_sec[(INTER, HID)] + ref_sec[(HID, INTER)]
    t_blk = 2 * per_matrix[("gate or up block-diag", b, False)] + per_matrix[("down block-diag", b, False)]
    print("\n## Projection: DeepSeek-V3, 58 MoE layers x 256 routed experts (solver only)\n")
    print(markdown_table(["solver", "hours"], [
        ["reference loop (gate, up, down separately)", 58 * 256 * t_ref / 3600],
        ["fast, fp32, gate / up / down separately", proj["fp32"][0] / 3600],
        ["fast, fp32, gate+up fused (shared Hessian) + down", proj["fp32"][1] / 3600],
        ["fast, tf32 lazy update, gate+up fused + down", proj["tf32"][1] / 3600],
        ["fast, block-diagonal H (bs 128)", 58 * 256 * t_blk / 3600],
    ]))
    qrows = []
    if not args.skip_quality:
        qrows = quality(INTER, HID, TOKENS)
        print(f"\n## Output error ||X (W - Q)^T|| / ||X W^T||, [{INTER}, {HID}], {TOKENS} correlated tokens, "
              "group 128\n")
        print(markdown_table(["method", "rel. error", "/ RTN", "seconds"], qrows))
        # Perplexity on held-out text of a small trained HF model (the tiny MoE fixture), same run.
        import quality_tiny_moe

        print("\n## Held-out perplexity of the trained tiny MoE (bench/quality_tiny_moe.py)\n")
        quality_tiny_moe.main(["--only", "fp32,bf16,rtn g64 sym,gptq g64 sym", "--eval-chars",
                               "4096" if args.smoke else "16384", "--device", DEV])
    total = time.perf_counter() - t_start
    print(f"\ntotal bench time {total:.0f} s")
    with open(args.json, "w") as f:
        json.dump({"device": device_line() if DEV == "cuda" else "cpu smoke", "timing": rows, "reference_s": {str(k): v for k, v in ref_sec.items()},
                   "projection_hours": {k: [v[0] / 3600, v[1] / 3600] for k, v in proj.items()},
                   "quality": qrows, "total_s": total}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
