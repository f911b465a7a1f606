"""One MoE block of the end-to-end model, bf16 HF against W4A16 `ForgeMoE` on the mma layout with the fused decode path
on and off, at T tokens: where the fused path stops paying.

    python bench/moe_block.py [--tokens 1,8,16,32,64,96,128,192,256,512] [--cpu-smoke]

Block: layer 1 of bench/decode_e2e.py's model (hidden 4096, 64 routed experts of 1408, top-8 in 8 groups / top-4
groups, one shared expert; random N(0, 0.02) weights, bf16). HF's block runs its experts with `grouped_mm`. W4A16:
`torchforge.quantize(model, "w4a16-rtn")` then `torchforge.use_mma_layout(model)`, which turns the fused decode path on
(`ForgeMoE.use_fused_decode`: DeepSeek-V3 routing in one kernel, the shared expert inside the grouped expert kernels).
"fused" and "unfused" time the same block with `torchforge.nn.moe.FUSED_DECODE_MAX_TOKENS` above and below T; the
unfused block runs HF's router, the grouped kernels on the routed rows and the shared expert's three linear layers
(the wgmma or dequantize + cuBLAS kernels past 32 rows). The dispatch takes the fused path up to
FUSED_DECODE_MAX_TOKENS tokens: 128 until this sweep (H200, then H100) moved it to 256.

Times in ms, medians: `eager` launches from Python (what an eager prefill pays, host included), `graph` replays a CUDA
graph (GPU time). `fused / unfused`: graph time ratio (below 1: the fused path is faster). `max |fused - unfused|`
relative to the output's largest magnitude (the two paths round the shared expert's sum differently).
`--cpu-smoke`: tiny dims on the CPU, eager only (checks the script, times nothing meaningful).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import markdown_table  # noqa: E402
from decode_e2e import build_model, make_config  # noqa: E402


def block_of(model):
    return model.model.layers[1].mlp


def time_ms(fn, device, graph: bool) -> float:
    if device.type == "cuda":
        from common import bench_graph_ms, bench_ms

        if not graph:
            return bench_ms(fn)
        try:
            return bench_graph_ms(fn)
        except Exception as e:  # noqa: BLE001 - a path that cannot be captured: report it, keep the eager column
            print(f"CUDA-graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); graph = nan")
            torch.cuda.synchronize()
            return float("nan")
    if graph:
        return float("nan")
    fn()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,16,32,64,96,128,192,256,512")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench/moe_block.py: needs a CUDA device (or --cpu-smoke)")
        return 0
    import torchforge
    import torchforge.nn.moe as forge_moe

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    cfg = make_config(args.cpu_smoke)
    cfg.num_hidden_layers = 2  # layer 0 dense, layer 1 the MoE block
    model = build_model(cfg, device)
    model.set_experts_implementation("grouped_mm")
    tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator(device="cpu").manual_seed(0)
    xs = {t: torch.randn(1, t, cfg.hidden_size, generator=gen).to(device, torch.bfloat16) for t in tokens}
    rows: dict[int, list] = {}
    with torch.no_grad():
        hf = block_of(model)
        for t in tokens:
            rows[t] = [t, time_ms(lambda: hf(xs[t]), device, False), time_ms(lambda: hf(xs[t]), device, True)]
        torchforge.quantize(model, "w4a16-rtn")
        switched = torchforge.use_mma_layout(model)
        block = block_of(model)
        print(f"use_mma_layout: {switched} modules switched; block {type(block).__name__}, fused decode "
              f"{getattr(block, 'fused_decode', False)}, experts {type(block.experts).__name__} "
              f"({getattr(block.experts, 'weight_layout', '?')} layout)")
        default = forge_moe.FUSED_DECODE_MAX_TOKENS
        try:
            for t in tokens:
                x = xs[t]
                outs = {}
                for name, bound in (("unfused", t - 1), ("fused", t)):
                    forge_moe.FUSED_DECODE_MAX_TOKENS = bound
                    outs[name] = block(x).float()
                    rows[t] += [time_ms(lambda: block(x), device, False), time_ms(lambda: block(x), device, True)]
                diff = (outs["fused"] - outs["unfused"]).abs().max() / outs["unfused"].abs().max()
                ratio = rows[t][-1] / rows[t][-3] if device.type == "cuda" else rows[t][-2] / rows[t][-4]
                rows[t] += [f"{ratio:.2f}", f"{diff.item():.1e}"]
        finally:
            forge_moe.FUSED_DECODE_MAX_TOKENS = default
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)"
    print(f"\n{dev}, torch {torch.__version__}; FUSED_DECODE_MAX_TOKENS = {default}\n")
    print(markdown_table(["T", "bf16 eager", "bf16 graph", "unfused eager", "unfused graph", "fused eager",
                          "fused graph", "fused / unfused", "max |fused - unfused|"], [rows[t] for t in tokens]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
