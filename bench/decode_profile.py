"""Where the time of one compiled decode step goes: GPU kernel time per step, by kernel, bf16 against W4A16.

    python bench/decode_profile.py [--model h4096|h7168] [--batch 1] [--steps 32] [--top 25] [--variants bf16-compile w4a16-mma-compile]

Same model and compile settings as bench/decode_e2e.py (CUDA graphs). Each variant is warmed up, then profiled
(torch.profiler, CUDA activity) for one generate() of 1 new token (prefill only) and one of 1 + --steps new tokens;
per-step kernel time = the difference / --steps, so the eager prefill cancels out. "busy" is the sum of kernel
times per step; the step's wall time comes from two timed generate() calls the same way. The trace is cut at gaps longer
than 20 us between kernels: those are the GPU waiting on the host (generate's Python between graph replays), and
"GPU span" is the rest, the time per step the GPU needs with the host out of the way (kernels and the short gaps
between a graph's kernels): what a step would take if the host kept up. Device only.

--host: where the host's time per step goes. The compiled decode step (HF's `_compiled_call`, CUDA graphs) is called
on its own with one step's inputs: with a synchronize after each call (host + GPU, as generate runs it: generate
reads the finished flag every step), and back to back (the larger of host and GPU). Then cProfile over a
generate() of 1 + --steps tokens less one of 1 token: the functions with the most own time per decode step.

--prefill: the eager prefill instead (one generate() of 1 new token, as decode_e2e's "prefill ms"): its wall time,
its kernels by family and by name, the GPU span (as above), and a cProfile of the call (own time per function).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import markdown_table  # noqa: E402
from decode_e2e import MODELS, Generator, build_model, make_config, reset_dynamo, sync  # noqa: E402

# Kernel families, first match wins (names as CUPTI reports them).
FAMILIES = (
    ("torchforge", r"awq|w4a16|wgmma_kernel|mma_moe|moe_align|moe_reduce|torchforge"),
    ("gemm (cuBLAS/CUTLASS)", r"gemm|nvjet|cutlass|xmma|cublas|splitKreduce"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("inductor triton", r"^triton_"),
    ("sort/topk/scan", r"sort|topk|scan|radix|bitonic|select"),
)


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.I):
            return fam
    return "other"


def kernel_times(gen: Generator, batch: int, n: int, cc) -> tuple[dict[str, tuple[float, int]], float]:
    """{kernel name: (total us, count)} of the CUDA kernels of one generate() of n new tokens, and the GPU span: first
    kernel start to last kernel end less the gaps longer than GAP_US (the GPU waiting for the host)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.run(batch, n, cc)
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith(("Memcpy", "Memset")):
            out[ev.name][0] += ev.device_time
            out[ev.name][1] += 1
            spans.append((ev.time_range.start, ev.time_range.end))
    spans.sort()
    idle, end = 0.0, None
    for a, b in spans:
        if end is not None and a - end > GAP_US:
            idle += a - end
        end = b if end is None else max(end, b)
    total = end - spans[0][0] if spans else 0.0
    return {k: (v[0], v[1]) for k, v in out.items()}, total - idle


GAP_US = 20.0


def profile_variant(gen, batch, steps, cc):
    gen.run(batch, steps + 1, cc)  # compile and record the CUDA graphs
    walls = {}
    for n in (1, steps + 1):
        walls[n] = min(gen.run(batch, n, cc)[0] for _ in range(2))
    ms_step = (walls[steps + 1] - walls[1]) / steps * 1e3
    (t1, span1), (tn, spann) = kernel_times(gen, batch, 1, cc), kernel_times(gen, batch, steps + 1, cc)
    per_step = {}
    for name, (us, cnt) in tn.items():
        us0, cnt0 = t1.get(name, (0.0, 0))
        if cnt - cnt0 > 0:
            per_step[name] = ((us - us0) / steps, (cnt - cnt0) / steps)
    busy = sum(us for us, _ in per_step.values())
    fams: dict[str, list] = defaultdict(lambda: [0.0, 0.0])
    for name, (us, cnt) in per_step.items():
        fams[family(name)][0] += us
        fams[family(name)][1] += cnt
    return ms_step, busy, per_step, fams, (spann - span1) / steps


def host_breakdown(gen, batch, steps, cc, top) -> None:
    """Prints ms per compiled decode-step call (synchronized each call, and back to back) and a cProfile of generate."""
    import cProfile
    import pstats

    model = gen.model
    captured = {}
    compiled = model._compiled_call

    def recording(*a, **k):
        captured["a"], captured["k"] = a, k
        return compiled(*a, **k)

    model._compiled_call = recording  # generate reuses it while the compile config is unchanged
    try:
        gen.run(batch, 3, cc)
    finally:
        model._compiled_call = compiled
    a, k = captured["a"], captured["k"]
    cache = gen.cache(batch)

    def per_call_ms(n: int, each: bool) -> float:
        # newer transformers keep the write position in the cache: start every run at 0 (in place, same addresses)
        cache.reset()
        sync(gen.device)
        t = time.perf_counter()
        for _ in range(n):
            compiled(*a, **k)
            if each:
                sync(gen.device)
        sync(gen.device)
        return (time.perf_counter() - t) / n * 1e3

    with torch.no_grad():
        per_call_ms(3, True)
        synced, back = per_call_ms(steps, True), per_call_ms(steps, False)
        t = time.perf_counter()
        for _ in range(steps):
            sync(gen.device)
        sync_only = (time.perf_counter() - t) / steps * 1e3
    print(f"compiled decode step alone: {synced:.3f} ms/call synchronized, {back:.3f} back to back "
          f"(an empty synchronize: {sync_only:.3f})")
    def profiled(n: int) -> dict:  # {(file, line, fn): (calls, own s, cumulative s)} of one generate() of n tokens
        prof = cProfile.Profile()
        prof.enable()
        gen.run(batch, n, cc)
        prof.disable()
        return {k: (v[1], v[2], v[3]) for k, v in pstats.Stats(prof).stats.items()}

    # per step: a generate() of steps + 1 tokens less one of 1 token (the eager prefill and generate's set-up)
    one, many = profiled(1), profiled(steps + 1)
    per_step = {k: tuple((a - b) / steps for a, b in zip(v, one.get(k, (0, 0.0, 0.0)))) for k, v in many.items()}
    rows = sorted(per_step.items(), key=lambda kv: -kv[1][1])[:top]
    print()
    print(markdown_table(["function", "calls/step", "own ms/step", "cumulative ms/step"],
                         [[f"{os.path.basename(f)}:{line}({fn})"[:100], f"{c:.1f}", f"{own * 1e3:.3f}",
                           f"{cum * 1e3:.3f}"] for (f, line, fn), (c, own, cum) in rows]))


def cpu_op_breakdown(gen, batch, cc, top) -> None:
    """torch.profiler's host-side view of one generate() of 1 token: ops by self CPU time, torchforge's ops by total
    CPU time (checks, dispatch rules and launches inside), and the CUDA runtime calls that wait for the device
    (cProfile misattributes time across torch.library's dynamo-disabled wrappers; this does not)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gen.run(batch, 1, cc)
    avg = prof.key_averages()
    self_total = sum(e.self_cpu_time_total for e in avg)
    print(f"\nhost ops (torch.profiler): {sum(e.count for e in avg)} events, self CPU {self_total / 1e3:.2f} ms\n")
    rows = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:top]
    print(markdown_table(["op", "calls", "self CPU ms", "CPU total ms", "us / call"],
                         [[e.key[:80], str(e.count), f"{e.self_cpu_time_total / 1e3:.3f}",
                           f"{e.cpu_time_total / 1e3:.3f}", f"{e.cpu_time_total / max(e.count, 1):.1f}"]
                          for e in rows]))
    mine = [e for e in avg if e.key.startswith("torchforge::") or "Synchronize" in e.key or "Memcpy" in e.key
            or e.key in ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")]
    print("\ntorchforge ops, syncs and copies:\n")
    print(markdown_table(["op", "calls", "self CPU ms", "CPU total ms", "us / call"],
                         [[e.key[:80], str(e.count), f"{e.self_cpu_time_total / 1e3:.3f}",
                           f"{e.cpu_time_total / 1e3:.3f}", f"{e.cpu_time_total / max(e.count, 1):.1f}"]
                          for e in sorted(mine, key=lambda e: -e.cpu_time_total)]))


def prefill_breakdown(gen, batch, cc, top) -> None:
    """The eager prefill (generate() of 1 new token): wall ms, kernels by family and name, the GPU span, and the
    functions with the most own host time."""
    import cProfile
    import pstats

    gen.run(batch, 1, cc)
    wall = min(gen.run(batch, 1, cc)[0] for _ in range(3)) * 1e3
    times, span = kernel_times(gen, batch, 1, cc)
    busy = sum(us for us, _ in times.values())
    print(f"prefill, batch {batch}: {wall:.2f} ms wall, {busy / 1e3:.2f} ms of kernels "
          f"({sum(c for _, c in times.values())} kernels), GPU span {span / 1e3:.2f} ms\n")
    fams: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for name, (us, cnt) in times.items():
        fams[family(name)][0] += us
        fams[family(name)][1] += cnt
    print(markdown_table(["family", "ms", "kernels"], [[f, f"{us / 1e3:.3f}", str(c)] for f, (us, c)
                                                       in sorted(fams.items(), key=lambda kv: -kv[1][0])]))
    print()
    print(markdown_table(["kernel", "family", "us", "count", "us each"],
                         [[name[:90], family(name), f"{us:.1f}", str(c), f"{us / c:.1f}"] for name, (us, c)
                          in sorted(times.items(), key=lambda kv: -kv[1][0])[:top]]))
    cpu_op_breakdown(gen, batch, cc, top)
    prof = cProfile.Profile()
    prof.enable()
    gen.run(batch, 1, cc)
    prof.disable()
    stats = pstats.Stats(prof).stats
    # by own time, then torchforge's own functions by cumulative time (what each op's Python costs, inner calls in)
    for title, key, keep in (("own time", 2, lambda f: True),
                             ("torchforge, cumulative", 3, lambda f: "torchforge" in f)):
        rows = sorted(((k, v) for k, v in stats.items() if keep(k[0])), key=lambda kv: -kv[1][key])[:top]
        print(f"\nhost, by {title}:\n")
        print(markdown_table(["function", "calls", "own ms", "cumulative ms"],
                             [[f"{os.path.basename(f)}:{line}({fn})"[:100], str(v[1]), f"{v[2] * 1e3:.3f}",
                               f"{v[3] * 1e3:.3f}"] for (f, line, fn), v in rows]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--model", default="h4096", choices=[m for m in MODELS if m != "tiny"],
                    help="decode_e2e's model preset")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--variants", nargs="+", default=["bf16-compile", "w4a16-mma-compile"],
                    choices=["bf16-compile", "w4a16-compile", "w4a16-mma-compile"])
    ap.add_argument("--host", action="store_true", help="also time the compiled step alone and cProfile generate")
    ap.add_argument("--prefill", action="store_true", help="profile the eager prefill instead of the decode step")
    ap.add_argument("--batches", type=int, nargs="+", help="with --prefill: the batch sizes (default --batch)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/decode_profile.py: needs a CUDA device")
        return 0
    from transformers import CompileConfig

    import torchforge

    device = torch.device("cuda")
    t0 = time.time()
    model = build_model(make_config(args.model, args.layers, args.experts), device)
    model.set_experts_implementation("grouped_mm")
    model._optimize_model_for_decode = contextlib.nullcontext  # keep grouped_mm while decoding (see decode_e2e)
    cc = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead")
    gen = Generator(model, device, prompt_len=32, new_tokens=args.steps + 1)
    quantized = mma = False
    order = ["bf16-compile", "w4a16-compile", "w4a16-mma-compile"]  # quantizing is one-way: bf16 first
    for v in sorted(set(args.variants), key=order.index):
        if v.startswith("w4a16") and not quantized:
            reset_dynamo(model)
            gen.drop_caches()
            torchforge.quantize(model, "w4a16-rtn")
            quantized = True
            torch.cuda.empty_cache()
        if v == "w4a16-mma-compile" and not mma:
            reset_dynamo(model)
            gen.drop_caches()
            print(f"use_mma_layout: {torchforge.use_mma_layout(model)} modules switched")
            mma = True
        if args.prefill:
            for b in args.batches or [args.batch]:
                print(f"\n## {v}\n")
                prefill_breakdown(gen, b, cc, args.top)
            gen.drop_caches()
            continue
        ms_step, busy, per_step, fams, span = profile_variant(gen, args.batch, args.steps, cc)
        print(f"\n## {v}, batch {args.batch}: {ms_step:.3f} ms/step wall, {busy / 1e3:.3f} ms/step of kernels "
              f"({sum(c for _, c in per_step.values()):.0f} kernels per step), GPU span {span / 1e3:.3f} ms/step "
              f"({time.time() - t0:.0f} s)\n")
        rows = [[f, f"{us / 1e3:.3f}", f"{cnt:.1f}", f"{100 * us / busy:.0f}%"]
                for f, (us, cnt) in sorted(fams.items(), key=lambda kv: -kv[1][0])]
        print(markdown_table(["family", "ms/step", "kernels/step", "share"], rows))
        rows = [[name[:90], family(name), f"{us:.1f}", f"{cnt:.1f}", f"{us / cnt:.1f}"]
                for name, (us, cnt) in sorted(per_step.items(), key=lambda kv: -kv[1][0])[:args.top]]
        print()
        print(markdown_table(["kernel", "family", "us/step", "count/step", "us each"], rows))
        if args.host:
            print()
            host_breakdown(gen, args.batch, args.steps, cc, args.top)
        reset_dynamo(model)
        gen.drop_caches()
    return 0


if __name__ == "__main__":
    sys.exit(main())
