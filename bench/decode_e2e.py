"""End to end: greedy decode tokens/s with HF `generate` of a DeepSeek-V3-architecture model, bf16 vs W4A16.

    python bench/decode_e2e.py [--batches 1 16] [--new-tokens 64] [--variants ...] [--no-compile]
                               [--model tiny|h4096|h7168] [--layers N] [--experts E]

Model: `DeepseekV3ForCausalLM` from a `DeepseekV3Config` (random N(0, 0.02) weights, bf16, built on the meta device
and initialised on the target device). `--model h4096` (default): hidden 4096, 8 layers (the first dense, intermediate
11008), 64 routed experts of 1408 (top-8, 8 groups, top-4 groups) + 1 shared expert, MLA as DeepSeek-V3 scaled down
(q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128, 32 heads), vocab 32000: about 8.6 B parameters,
17 GB of bf16. `--model h7168`: DeepSeek-V3's own layer (hidden 7168, 128 heads, experts of 2048, dense
intermediate 18432, top-8 in 8 groups / top-4) with 20 layers of 32 experts and vocab 32000: 32.2 B parameters,
64 GB of bf16 (the most layers that leave room for the caches and CUDA graphs on an 80 GB H100). At batch 1 a step reads the same bytes per layer whatever the expert count (8 routed + 1 shared),
1.17 GB of bf16 for h7168 against 0.39 GB for h4096, so h7168's decode step is weight-read bound where h4096's is
about half host time and fixed-cost kernels (norms, rope, attention, router).

Variants (one model, quantized in place between the bf16 and the W4A16 runs):
  bf16            HF eager. Experts: transformers' `grouped_mm` (torch grouped GEMM over the experts hit, as in
                  bench/moe_w4a16.py) in prefill and decode. transformers 5 switches to `batched_mm` while decoding
                  on CUDA, which gathers a copy of every selected expert's weights per token (about 3x the expert
                  bytes at batch 1, far more at 16); that switch is turned off unless `--bf16-experts hf`.
  bf16-compile    the same, decode step under torch.compile (HF's auto-compile of `generate`, static cache,
                  CompileConfig(mode="reduce-overhead", dynamic=False): CUDA graphs)
  w4a16           `torchforge.quantize(model, "w4a16-rtn")` (group 128, or --group-size, e.g. 32 as Kimi K2's int4
                  experts and many GPTQ checkpoints; symmetric; lm_head, embeddings, routers and
                  kv_b_proj stay bf16), eager
  w4a16-compile   the W4A16 model's decode step under torch.compile, as bf16-compile
  w4a16-mma(-compile)  the same model after `torchforge.use_mma_layout(model)`: every ForgeAWQLinear and the
                  routed experts run on the mma layout (tensor-core kernels of csrc/awq_mma.cu, awq_mma_moe.cu), and
                  each MoE block takes the fused decode path (ForgeMoE.use_fused_decode: DeepSeek-V3 routing in one
                  kernel, the shared expert inside the grouped expert kernels)

Every variant generates from the same random 32-token prompts with a reused StaticCache (reset between calls), greedy,
min_new_tokens = max_new_tokens = N (no EOS). Decode tokens/s = batch * (N - 1) / (t(N new tokens) - t(1 new token)):
the prefill and generate's set-up cancel out. Medians of --repeats timed calls after one warm-up call (the compile;
`warm-up s` = the warm-up calls, compile and CUDA-graph recording included); `ms/step range`: the fastest and the
slowest repeat's own step time. `tokens = eager`: share of the N greedy
tokens a compiled variant generates identical to its eager twin (random weights: near-ties flip and then diverge, so
below 100% is not by itself an error). `weights GB`: parameters + buffers on the device. `--skip-guard-eval`: the
compiled variants' timed calls run under `torch.compiler.set_stance(skip_guard_eval_unsafe=True)` (dynamo's guards
are part of a compiled step's host time, which batch 1 waits for).
Graph breaks: counted by dynamo while the compiled variants warm up (`graph breaks: 0` or the list, with the
source line of each); without a compiled W4A16 variant, one W4A16 decode step is run through `torch._dynamo.explain`.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import markdown_table  # noqa: E402

VARIANTS = ("bf16", "bf16-compile", "w4a16", "w4a16-compile", "w4a16-mma", "w4a16-mma-compile")
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f} s] {msg}", flush=True)


MODELS = ("tiny", "h4096", "h7168")


def make_config(tiny: bool | str, layers: int | None = None, experts: int | None = None):
    """`tiny` (CPU smoke), `h4096` (the default: hidden 4096, 8 layers, 64 experts of 1408) or `h7168` (DeepSeek-V3's
    own layer: hidden 7168, 128 heads, full MLA dims, experts of 2048, dense intermediate 18432; 20 layers of 32
    experts by default, 32.2 B parameters, 64 GB of bf16). `layers` / `experts` override the preset's counts."""
    from transformers import DeepseekV3Config

    name = tiny if isinstance(tiny, str) else ("tiny" if tiny else "h4096")
    if name not in MODELS:
        raise ValueError(f"model preset {name!r}: expected one of {MODELS}")
    if name == "tiny":  # CPU smoke size; every quantized input dim is a multiple of 128 (the recipe's group size)
        dims = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                    num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128,
                    qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
    elif name == "h4096":
        dims = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, moe_intermediate_size=1408,
                    num_hidden_layers=8, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
                    num_attention_heads=32, num_key_value_heads=32, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    else:  # DeepSeek-V3's layer dimensions; fewer experts and layers so that the bf16 model fits one GPU
        dims = dict(vocab_size=32000, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                    num_hidden_layers=20, n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4,
                    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    if layers is not None:
        dims["num_hidden_layers"] = layers
    if experts is not None:
        if experts % dims["n_group"] or experts // dims["n_group"] < 2:
            raise ValueError(f"--experts {experts}: must be a multiple of n_group={dims['n_group']} with at least 2 "
                             "experts per group (the group score is the sum of a group's top 2)")
        dims["n_routed_experts"] = experts
    return DeepseekV3Config(**dims, first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=4096,
                            tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=None,
                            initializer_range=0.02)


@torch.no_grad()
def build_model(cfg, device: torch.device, seed: int = 0, std: float = 0.02):
    """DeepseekV3ForCausalLM in bf16 on `device` with N(0, std) weights, without HF's (slow, CPU) weight init:
    built on the meta device, materialised with `to_empty`, then initialised in place on the device."""
    from transformers import DeepseekV3ForCausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters are created in bf16 (no fp32 copy)
    try:
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:  # RMSNorm scales (attention_bias=False: there are no 1-D biases)
            p.fill_(1.0)
        else:
            p.normal_(0.0, std)
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):  # router bias: fp32 as transformers keeps it (_keep_in_fp32)
            m.e_score_correction_bias = torch.zeros(m.e_score_correction_bias.shape[0], dtype=torch.float32,
                                                    device=device)
    # RoPE's inv_freq is a non-persistent fp32 buffer that to_empty left uninitialised: rebuild the module.
    rot = model.model.rotary_emb
    model.model.rotary_emb = type(rot)(cfg).to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = 0
    return model.eval()


def weight_gb(model) -> float:
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n += t.numel() * t.element_size()
    return n / 1e9


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _generate_cache_kwarg() -> str:
    """generate()'s cache argument: `cache` since transformers 5.24 (`past_key_values` warns there, until 6.0),
    `past_key_values` before. Read from GenerationMixin (which generate() renames for), not from a model's override."""
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


class Generator:
    """generate() with one reused StaticCache per batch size: the compiled decode step sees the same cache
    tensors on every call (no recompile, no CUDA-graph re-record)."""

    def __init__(self, model, device, prompt_len: int, new_tokens: int, seed: int = 0):
        self.model, self.device = model, device
        self.prompt_len, self.new_tokens = prompt_len, new_tokens
        self.caches: dict[int, object] = {}
        self.prompts: dict[int, torch.Tensor] = {}
        self.seed = seed

    def prompt(self, batch: int) -> torch.Tensor:
        if batch not in self.prompts:
            g = torch.Generator().manual_seed(self.seed + batch)
            vocab = self.model.config.vocab_size
            self.prompts[batch] = torch.randint(1, vocab, (batch, self.prompt_len), generator=g).to(self.device)
        return self.prompts[batch]

    def cache(self, batch: int):
        if batch not in self.caches:
            from transformers import StaticCache

            self.caches[batch] = StaticCache(config=self.model.config, max_cache_len=self.prompt_len + self.new_tokens + 8)
        return self.caches[batch]

    def drop_caches(self) -> None:
        self.caches.clear()

    @torch.no_grad()
    def run(self, batch: int, n: int, compile_config=None) -> tuple[float, torch.Tensor]:
        """Seconds for one generate() call of `n` new tokens, and the new tokens [batch, n]."""
        ids = self.prompt(batch)
        cache = self.cache(batch)
        cache.reset()
        kw = dict(compile_config=compile_config) if compile_config is not None else dict(disable_compile=True)
        sync(self.device)
        t0 = time.perf_counter()
        kw[_generate_cache_kwarg()] = cache
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                  max_new_tokens=n, min_new_tokens=n, use_cache=True, **kw)
        sync(self.device)
        dt = time.perf_counter() - t0
        new = out[:, ids.shape[1]:]
        if new.shape[1] != n:
            raise RuntimeError(f"generate returned {new.shape[1]} new tokens, expected {n}")
        return dt, new


def graph_break_state():
    from torch._dynamo.utils import counters

    reasons = getattr(torch._dynamo.utils, "graph_break_reasons", None)
    return counters, reasons


def reset_dynamo(model) -> None:
    torch._dynamo.reset()
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    from torch._dynamo.utils import counters

    counters.clear()


def _where(stack) -> str:
    """The innermost torchforge frame of a graph break's user stack, else its innermost frame."""
    if not stack:
        return "?"
    frames = list(stack)
    pick = next((f for f in reversed(frames) if "torchforge" in f.filename), None) or frames[-1]
    return f"{pick.filename}:{pick.lineno} ({pick.name})"


def summarise_breaks(reason_objs, counter) -> list[str]:
    """Distinct graph breaks as 'count x reason @ file:line'."""
    out: dict[str, int] = {}
    if reason_objs:
        for r in reason_objs:
            key = f"{r.reason.strip().splitlines()[0][:300]} @ {_where(r.user_stack)}"
            out[key] = out.get(key, 0) + 1
    elif counter:
        for k, v in counter.items():
            out[str(k).strip().splitlines()[0][:300]] = v
    return [f"{v} x {k}" for k, v in sorted(out.items(), key=lambda kv: -kv[1])]


@torch.no_grad()
def explain_decode_step(model, gen: Generator, batch: int) -> list[str]:
    """Runs one decode step of `model` (eager generate: prefill + 1 step, arguments captured with a hook) through
    torch._dynamo.explain; returns the graph breaks (empty: none)."""
    captured = {}

    def hook(mod, args, kwargs):
        captured["args"], captured["kwargs"] = args, dict(kwargs)

    h = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        gen.run(batch, 2)  # the last forward is the decode step
    finally:
        h.remove()
    reset_dynamo(model)
    ex = torch._dynamo.explain(model)(*captured["args"], **captured["kwargs"])
    reasons = summarise_breaks(list(ex.break_reasons), None)
    if ex.graph_break_count and not reasons:
        reasons = [f"{ex.graph_break_count} graph breaks (no reasons recorded)"]
    reset_dynamo(model)
    return reasons


def measure(gen: Generator, variant: str, batches, repeats: int, compile_config, results: dict, breaks: dict,
            skip_guard_eval: bool = False) -> None:
    N = gen.new_tokens
    counters, reason_objs = graph_break_state()
    if compile_config is not None:
        reset_dynamo(gen.model)
        if reason_objs is not None:
            reason_objs.clear()
    for B in batches:
        t_w0 = time.perf_counter()
        gen.run(B, N, compile_config)  # compile (+ CUDA-graph record) happens here
        gen.run(B, 1, compile_config)
        warm = time.perf_counter() - t_w0
        tn, t1 = [], []
        # --skip-guard-eval: dynamo skips evaluating the compiled step's guards once it is compiled (a user-level
        # knob that is safe only while nothing would recompile; part of the compiled step's host time per token)
        stance = (torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
                  if skip_guard_eval and compile_config is not None else contextlib.nullcontext())
        with stance:
            for _ in range(repeats):
                dt, tokens = gen.run(B, N, compile_config)
                tn.append(dt)
                t1.append(gen.run(B, 1, compile_config)[0])
        tN, tP = statistics.median(tn), statistics.median(t1)
        dec = tN - tP
        if dec <= 0:  # only on a noisy host (CPU smoke runs): no decode rate to report
            log(f"{variant} batch {B}: t({N} tokens) = {tN * 1e3:.1f} ms <= t(1 token) = {tP * 1e3:.1f} ms; too noisy")
            dec = float("nan")
        # each repeat's own step time (its N-token call less its 1-token call): the spread between repeats, which at
        # batch 1 (host-bound) moved by 0.3-0.5 ms per step on one machine (thirteenth session)
        steps = sorted((a - b) / (N - 1) * 1e3 for a, b in zip(tn, t1))
        results[(variant, B)] = dict(tok_s=B * (N - 1) / dec, ms_step=dec / (N - 1) * 1e3, prefill_ms=tP * 1e3,
                                     warm_s=warm, tokens=tokens.cpu(), spread=(steps[0], steps[-1]))
        r = results[(variant, B)]
        log(f"{variant} batch {B}: {r['tok_s']:.1f} tok/s ({r['ms_step']:.2f} ms/step, prefill {r['prefill_ms']:.1f} ms, "
            f"warm-up {warm:.1f} s)")
    if compile_config is not None:
        stats = counters.get("stats", {})
        lines = summarise_breaks(list(reason_objs) if reason_objs is not None else None, counters.get("graph_break"))
        breaks[variant] = dict(lines=lines, graphs=stats.get("unique_graphs", "?"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="hidden 256, 2 layers, 8 experts (CPU smoke test); = --model tiny")
    ap.add_argument("--model", default="h4096", choices=MODELS, help="model preset (see make_config)")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--experts", type=int, default=None, help="override the preset's routed expert count")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed calls per variant and batch; the median is reported (batch-1 host time swings: BENCHMARKS.md)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    ap.add_argument("--mode", default=None, help="torch.compile mode (default: reduce-overhead on CUDA, default on CPU)")
    ap.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True (a graph break is an error)")
    ap.add_argument("--bf16-experts", default="grouped_mm", choices=("grouped_mm", "hf", "batched_mm", "eager"),
                    help="transformers experts implementation of the bf16 model; hf: transformers' default "
                         "(grouped_mm, switched to batched_mm while decoding on CUDA)")
    ap.add_argument("--skip-guard-eval", action="store_true",
                    help="time the compiled variants under torch.compiler.set_stance(skip_guard_eval_unsafe=True)")
    ap.add_argument("--pdl-levels", type=int, nargs="*", default=[], choices=(0, 1, 2),
                    help="time each compiled mma-layout variant again at these levels of programmatic dependent "
                         "launch (csrc/pdl.cuh; row suffix /pdl-N)")
    ap.add_argument("--group-size", type=int, default=128, help="the W4A16 variants' quantization group (32, 64, 128)")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tiny:
        args.model = "tiny"
    if device.type != "cuda" and args.model != "tiny":
        print("bench/decode_e2e.py: no CUDA device; the full-size model needs one (use --tiny for a CPU smoke test)")
        return 0
    variants = [v for v in VARIANTS if v in args.variants and not (args.no_compile and v.endswith("-compile"))]
    import transformers

    import torchforge
    from transformers import CompileConfig

    dev_line = (f"{torch.cuda.get_device_name(device)}, " if device.type == "cuda" else "CPU, ") + \
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    log(f"device: {dev_line}; variants {variants}; batches {args.batches}; prompt {args.prompt_len}, "
        f"new tokens {args.new_tokens}")
    cfg = make_config(args.model, args.layers, args.experts)
    model = build_model(cfg, device)
    if args.bf16_experts != "hf":
        model.set_experts_implementation(args.bf16_experts)
        # generate() swaps grouped_mm for batched_mm while decoding on CUDA; keep the chosen implementation
        model._optimize_model_for_decode = contextlib.nullcontext
    experts = {"hf": "grouped_mm, batched_mm while decoding" if device.type == "cuda" else "grouped_mm"}.get(
        args.bf16_experts, args.bf16_experts)
    nparams = sum(p.numel() for p in model.parameters())
    log(f"model built: {nparams / 1e9:.3f} B parameters, {weight_gb(model):.3f} GB; attention "
        f"{model.config._attn_implementation}, bf16 experts {experts} (config: {model.get_experts_implementation()})")
    mode = args.mode or ("reduce-overhead" if device.type == "cuda" else "default")
    cc = CompileConfig(fullgraph=args.fullgraph, dynamic=False, mode=mode)
    if device.type != "cuda":
        cc._compile_all_devices = True  # transformers only auto-compiles on accelerators otherwise
    gen = Generator(model, device, args.prompt_len, args.new_tokens)
    results, breaks, weights, explain = {}, {}, {}, None
    shown = []  # variants and their /pdl-off repeats, in the order run
    for v in variants:
        shown.append(v)
        if v.startswith("w4a16") and not any(k.startswith("w4a16") for k in weights):
            reset_dynamo(model)
            gen.drop_caches()
            t0 = time.perf_counter()
            torchforge.quantize(model, torchforge.Recipe.from_preset("w4a16-rtn").replace(group_size=args.group_size))
            sync(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            groups = sorted({m.group_size for m in model.modules() if isinstance(getattr(m, "group_size", None), int)})
            log(f"quantized (w4a16-rtn, group {args.group_size}) in {time.perf_counter() - t0:.1f} s: "
                f"{weight_gb(model):.3f} GB of weights; modules' group sizes {groups}")
        if v.startswith("w4a16-mma") and not any(k.startswith("w4a16-mma") for k in weights):
            reset_dynamo(model)
            gen.drop_caches()
            log(f"use_mma_layout: {torchforge.use_mma_layout(model)} modules switched (linear, experts, fused MoE blocks)")
        weights[v] = weight_gb(model)
        log(f"{v}: start")
        try:
            measure(gen, v, args.batches, args.repeats, cc if v.endswith("-compile") else None, results, breaks,
                    args.skip_guard_eval)
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            log(f"{v}: FAILED: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            breaks.setdefault(v, dict(lines=[f"FAILED: {type(e).__name__}: {e}"[:2000]], graphs="?"))
        if v.endswith("-compile"):
            reset_dynamo(model)
            gen.drop_caches()  # the next variant's cache tensors get fresh static addresses
        for level in args.pdl_levels if v.startswith("w4a16-mma") and v.endswith("-compile") else ():
            from torchforge.ops._ext import set_pdl

            again = f"{v}/pdl-{level}"
            previous = set_pdl(level)
            weights[again] = weights[v]
            log(f"{again}: start (the default level: {previous})")
            try:
                measure(gen, again, args.batches, args.repeats, cc, results, breaks, args.skip_guard_eval)
            finally:
                set_pdl(previous)
                reset_dynamo(model)
                gen.drop_caches()
            shown.append(again)
    if "w4a16" in variants and "w4a16-compile" not in variants:
        log("w4a16: torch._dynamo.explain of one decode step")
        try:
            explain = explain_decode_step(model, gen, args.batches[0])
        except Exception as e:  # noqa: BLE001
            explain = [f"explain FAILED: {type(e).__name__}: {e}"[:2000]]

    def ratio(key, base):
        b = results.get((base, key[1]))
        return f"{results[key]['tok_s'] / b['tok_s']:.2f}x" if b else "-"

    rows = []
    for v in shown:
        for B in args.batches:
            r = results.get((v, B))
            if r is None:
                rows.append([v, B, "failed", "", "", "", "", "", "", f"{weights.get(v, float('nan')):.3f}", ""])
                continue
            same = "-"
            eager = results.get((v.removesuffix("-compile"), B)) if v.endswith("-compile") else None
            if eager is not None:
                same = f"{(r['tokens'] == eager['tokens']).float().mean().item() * 100:.0f}%"
            rows.append([v, B, f"{r['tok_s']:.1f}", f"{r['ms_step']:.2f}",
                         f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}", ratio((v, B), "bf16"),
                         ratio((v, B), "bf16-compile"), f"{r['prefill_ms']:.1f}", f"{r['warm_s']:.1f}",
                         f"{weights[v]:.3f}", same])
    print()
    print(f"device: {dev_line}; model: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
          f"{cfg.n_routed_experts} experts of {cfg.moe_intermediate_size} (top-{cfg.num_experts_per_tok}), "
          f"{nparams / 1e9:.3f} B parameters; bf16 experts: {experts}; attention: {model.config._attn_implementation}; "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy; "
          f"compile: mode={mode}, fullgraph={args.fullgraph}, dynamic=False, static cache"
          + (", timed with guard evaluation skipped (--skip-guard-eval)" if args.skip_guard_eval else ""))
    print(markdown_table(["variant", "batch", "decode tok/s", "ms/step", "ms/step range", "vs bf16 eager",
                          "vs bf16 compile",
                          "prefill ms", "warm-up s", "weights GB", "tokens = eager"], rows))
    for v, b in breaks.items():
        lines = b["lines"]
        head = "graph breaks: 0" if not lines else f"graph breaks: {len(lines)} distinct"
        print(f"{v}: {head} (dynamo graphs compiled: {b['graphs']})")
        for line in lines:
            print(f"  - {line}")
    if explain is not None:
        print("w4a16 decode step, torch._dynamo.explain: " + ("graph breaks: 0" if not explain else
                                                              f"graph breaks: {len(explain)} distinct"))
        for line in explain:
            print(f"  - {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
