"""Trains torchforge's fixture model: a tiny DeepSeek-V3 MoE over bytes (see torchforge/testing/tiny_moe.py).

    python examples/train_tiny_moe.py --minutes 6            # on a GPU; writes torchforge/testing/data/tiny_moe
    python examples/train_tiny_moe.py --write-text-only      # only the held-out eval / calibration text

Each training sequence comes from one domain (math 40%, prose 30%, code 30%), so experts can specialise by
domain. Load balance uses DeepSeek-V3's auxiliary-loss-free rule: after each step every router's
e_score_correction_bias moves by `bias_speed` towards under-used experts (bias += speed * sign(mean - load)).
The checkpoint is written in bf16 (the bias stays fp32), atomically: into a temp folder, then renamed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

import torch

from torchforge.testing import corpus
from torchforge.testing.tiny_moe import DOMAINS, TINY_MOE_DIR, encode, load_text, perplexity, tiny_moe_config

MIX = {"math": 0.4, "prose": 0.3, "code": 0.3}
EVAL_CHARS = 32_768


TEXT_NAMES = ("eval_math", "eval_prose", "eval_code", "calib_math", "calib_prose", "calib_code")


def fixture_text() -> dict[str, str]:
    """Held-out eval text per domain (never trained on) and calibration slices: math from its own seed
    (disjoint from eval and training), prose and code from the training split (as calibration sets usually are)."""
    return {
        "eval_math": corpus.math_text("eval", EVAL_CHARS)[:EVAL_CHARS],
        "eval_prose": corpus.sample_text(corpus.prose_documents("eval"), EVAL_CHARS, seed=0),
        "eval_code": corpus.sample_text(corpus.code_documents("eval"), EVAL_CHARS, seed=0),
        "calib_math": corpus.math_text("calib", EVAL_CHARS)[:EVAL_CHARS],
        "calib_prose": corpus.sample_text(corpus.prose_documents("train"), EVAL_CHARS, seed=1),
        "calib_code": corpus.sample_text(corpus.code_documents("train"), EVAL_CHARS, seed=1),
    }


def write_text(out: str, texts: dict[str, str]) -> None:
    os.makedirs(out, exist_ok=True)
    for name, text in texts.items():
        tmp = os.path.join(out, f".{name}.txt.tmp")
        with open(tmp, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, f"{name}.txt"))


def training_streams(math_chars: int) -> dict[str, torch.Tensor]:
    return {"math": encode(corpus.math_text("train", math_chars)),
            "prose": encode("".join(corpus.prose_documents("train"))),
            "code": encode("".join(corpus.code_documents("train")))}


def sample_batch(streams, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    domains = torch.multinomial(torch.tensor([MIX[d] for d in DOMAINS]), batch, replacement=True, generator=gen)
    rows = []
    for d in domains.tolist():
        s = streams[DOMAINS[d]]
        start = torch.randint(0, s.numel() - seq - 1, (1,), generator=gen).item()
        rows.append(s[start: start + seq])
    return torch.stack(rows)


class BiasBalancer:
    """DeepSeek-V3 auxiliary-loss-free balancing: counts each router's picks, then nudges its bias."""

    def __init__(self, model, speed: float):
        self.speed = speed
        self.routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.loads = [torch.zeros(r.weight.shape[0], device=r.weight.device) for r in self.routers]
        for r, load in zip(self.routers, self.loads):
            r.register_forward_hook(self._counter(load))

    @staticmethod
    def _counter(load):
        def hook(module, inputs, output):  # returns None: the router's output is left as it is
            load.add_(torch.bincount(output[2].reshape(-1), minlength=load.numel()).float())
        return hook

    @torch.no_grad()
    def step(self) -> float:
        """Updates the biases; returns the worst layer's max-load / mean-load before the update."""
        worst = 0.0
        for r, load in zip(self.routers, self.loads):
            mean = load.mean()
            worst = max(worst, (load.max() / mean.clamp_min(1)).item())
            r.e_score_correction_bias.add_(self.speed * torch.sign(mean - load))
            load.zero_()
        return worst


def train_loss(model, x: torch.Tensor, device: str) -> torch.Tensor:
    with torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16):
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             x[:, 1:].reshape(-1))


def save_checkpoint(model, out: str, extra_files: dict[str, str]) -> None:
    biases = {n: b.detach().float().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    model = model.to(torch.bfloat16)
    for name, b in biases.items():  # HF keeps this one in fp32 (_keep_in_fp32_modules); so do we
        mod = model.get_submodule(name.rsplit(".", 1)[0])
        mod.e_score_correction_bias = b
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="10MB")  # shards under the device tool's 16 MiB file limit
    if os.path.isdir(out):  # keep the held-out text already there
        for f in os.listdir(out):
            if f.endswith(".txt") and not os.path.exists(os.path.join(tmp, f)):
                shutil.copy2(os.path.join(out, f), os.path.join(tmp, f))
    for name, text in extra_files.items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    old = out.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(out):
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=TINY_MOE_DIR)
    p.add_argument("--minutes", type=float, default=6.0, help="training wall-clock budget")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--bias-speed", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experts-impl", default="grouped_mm", help="HF experts implementation (falls back to eager)")
    p.add_argument("--text-dir", default=TINY_MOE_DIR, help="read held-out text from here when present")
    p.add_argument("--write-text-only", action="store_true")
    a = p.parse_args(argv)

    if not a.write_text_only and all(os.path.isfile(os.path.join(a.text_dir, f"{n}.txt")) for n in TEXT_NAMES):
        texts = {n: load_text(n, a.text_dir) for n in TEXT_NAMES}  # the committed text, whatever Python runs
    else:
        texts = fixture_text()
        write_text(a.out, texts)
    if a.write_text_only:
        print(f"wrote {sorted(texts)} to {a.out}")
        return

    torch.manual_seed(a.seed)
    log_lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_lines.append(msg)

    t0 = time.time()
    streams = training_streams(math_chars=24_000_000)
    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, device {a.device}; corpus bytes "
        + ", ".join(f"{d}={s.numel():,}" for d, s in streams.items()) + f" (built in {time.time() - t0:.1f}s)")

    from transformers import DeepseekV3ForCausalLM

    cfg = tiny_moe_config()
    model = DeepseekV3ForCausalLM(cfg).to(a.device)
    if a.device.startswith("cuda") and a.experts_impl != "eager":
        try:
            model.set_experts_implementation(a.experts_impl)
        except Exception as e:  # older transformers: keep eager
            log(f"experts implementation {a.experts_impl!r} unavailable ({e}); using eager")
    n_params = sum(t.numel() for t in model.parameters())
    log(f"params {n_params:,}; config {json.dumps({k: getattr(cfg, k) for k in ('hidden_size', 'num_hidden_layers', 'n_routed_experts', 'num_experts_per_tok', 'moe_intermediate_size')})}")

    balancer = BiasBalancer(model, a.bias_speed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=a.device != "cpu")
    gen = torch.Generator().manual_seed(a.seed)
    budget = a.minutes * 60
    model.train()
    t_start, step, tokens = time.time(), 0, 0
    while step < a.max_steps and time.time() - t_start < budget:
        # cosine schedule over whichever budget ends first: wall clock or steps
        frac = min(1.0, max((time.time() - t_start) / budget, step / a.max_steps))
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = sample_batch(streams, a.batch, a.seq, gen).to(a.device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        try:
            loss = train_loss(model, x, a.device)
            loss.backward()
        except (RuntimeError, NotImplementedError) as e:
            if step > 0:
                raise
            log(f"experts implementation failed on the first step ({str(e).splitlines()[0]}); using eager")
            model.set_experts_implementation("eager")
            opt.zero_grad(set_to_none=True)
            loss = train_loss(model, x, a.device)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = balancer.step()
        step += 1
        tokens += x.numel()
        if step % 100 == 0 or step == 1:
            el = time.time() - t_start
            log(f"step {step:6d}  loss {loss.item():.4f}  lr {lr:.2e}  max/mean load {imbalance:.2f}  "
                f"{tokens / el:,.0f} tok/s  {el:.0f}s")
    log(f"trained {step} steps, {tokens:,} tokens in {time.time() - t_start:.0f}s")

    model.eval()
    model.set_experts_implementation("eager")  # scored as load_tiny_moe() runs it on CPU (fp32, eager experts)
    metrics = {"steps": step, "tokens": tokens, "params": n_params}
    for d in DOMAINS:
        metrics[f"ppl_{d}"] = perplexity(model, texts[f"eval_{d}"])
        log(f"held-out {d} perplexity (bytes) {metrics[f'ppl_{d}']:.3f}")
    save_checkpoint(model.cpu(), a.out, {"train_log.txt": "\n".join(log_lines) + "\n",
                                        "metrics.json": json.dumps(metrics, indent=1) + "\n"})
    print(f"saved to {a.out}")


if __name__ == "__main__":
    main()
