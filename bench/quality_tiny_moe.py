"""Held-out perplexity of the trained tiny MoE under each 4-bit scheme (issues 3 and 6): fp32, bf16, RTN,
GPTQ (sym / asym, with and without MSE scale refinement), NVFP4 weight-only and its W4A4 emulation.

    python bench/quality_tiny_moe.py [--eval-chars 16384] [--device cpu]

Group size 64 for the W4A16 schemes (the experts' down_proj has 64 input channels); NVFP4 uses its block of
16. Calibration (GPTQ Hessians, NVFP4 input scales) uses the calib_{math,prose,code} text, never the eval
text. Every quantized Linear and all routed and shared experts are quantized; the recipe's default ignores
(lm_head, routers, MLA kv_b_proj) stay in full precision.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import torchforge
from torchforge.nn.nvfp4_moe import emulate_w4a4
from torchforge.testing.tiny_moe import DOMAINS, encode, load_text, load_tiny_moe, perplexity, windows


def calibration_ids(seq: int, per_domain: int) -> torch.Tensor:
    return torch.cat([windows(encode(load_text(f"calib_{d}")), seq)[:per_domain] for d in DOMAINS])


def variants(calib: torch.Tensor):
    """(name, fn(model) -> model) in table order."""
    g64 = {"bits": 4, "group_size": 64}

    def gptq(symmetric, mse=False):
        return lambda m: torchforge.quantize(m, {"scheme": "w4a16-gptq", **g64, "symmetric": symmetric},
                                             calib_data=calib, gptq={"mse": mse})

    def nvfp4(w4a4, per_expert=False):
        def fn(m):
            m = torchforge.quantize(m, "nvfp4", calib_data=calib)
            return emulate_w4a4(m, True, per_expert_input_scales=per_expert) if w4a4 else m
        return fn

    return [
        ("fp32", lambda m: m),
        ("bf16 weights", lambda m: m.to(torch.bfloat16).float()),
        ("w4a16-rtn g64 sym", lambda m: torchforge.quantize(m, {"scheme": "w4a16-rtn", **g64, "symmetric": True})),
        ("w4a16-rtn g64 asym", lambda m: torchforge.quantize(m, {"scheme": "w4a16-rtn", **g64, "symmetric": False})),
        ("w4a16-gptq g64 sym", gptq(True)),
        ("w4a16-gptq g64 asym", gptq(False)),
        ("w4a16-gptq g64 sym + mse", gptq(True, mse=True)),
        ("nvfp4 (W4A16 compute)", nvfp4(False)),
        ("nvfp4 W4A4 emulation", nvfp4(True)),  # routed experts: one input scale per layer (vLLM FlashInfer)
        ("nvfp4 W4A4 emulation, per-expert input scales", nvfp4(True, per_expert=True)),  # vLLM CUTLASS
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eval-chars", type=int, default=16384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calib-windows", type=int, default=128, help="calibration windows per domain (128 = all)")
    p.add_argument("--only", default=None, help="comma-separated substrings of variant names to run")
    a = p.parse_args(argv)
    base = load_tiny_moe(device=a.device)
    texts = {d: load_text(f"eval_{d}")[: a.eval_chars] for d in DOMAINS}
    calib = calibration_ids(a.seq, a.calib_windows)
    print(f"tiny MoE ({sum(t.numel() for t in base.parameters()):,} params), eval {a.eval_chars} bytes per domain, "
          f"calibration {calib.numel():,} tokens, device {a.device}\n")
    print("| scheme | math ppl | prose ppl | code ppl | mean rel. increase vs fp32 | s |")
    print("|---|---|---|---|---|---|")
    ref = None
    for name, fn in variants(calib):
        if a.only and not any(s in name for s in a.only.split(",")):
            continue
        t0 = time.time()
        model = fn(copy.deepcopy(base))
        ppl = {d: perplexity(model, texts[d], a.seq) for d in DOMAINS}
        ref = ref or ppl
        inc = sum(ppl[d] / ref[d] - 1 for d in DOMAINS) / len(DOMAINS)
        print(f"| {name} | {ppl['math']:.4f} | {ppl['prose']:.3f} | {ppl['code']:.4f} | {inc:+.2%} | "
              f"{time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
