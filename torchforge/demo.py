"""`torchforge demo`: quantize a small DeepSeek-V3-architecture model end to end on whatever device is here."""
from __future__ import annotations

import copy
import os
import tempfile
import time

import torch


def tiny_deepseek_v3_config(**overrides):
    """A small DeepSeek-V3 (MLA, sigmoid group-limited router, shared expert) whose dims suit group 128."""
    from transformers import DeepseekV3Config

    kw = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
              num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
              num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
              max_position_embeddings=512, rope_scaling=None, tie_word_embeddings=False, initializer_range=0.02,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def run_demo(out_dir: str | None = None, device: str | None = None, seed: int = 0, new_tokens: int = 24) -> dict:
    import torchforge
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    # from_config with a dtype, as loading a checkpoint would: RoPE tables and the router bias stay fp32.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(), dtype=torch.bfloat16).eval()
    # Random routers would route near-uniformly; give experts distinct preferences like a trained model.
    for layer in model.model.layers[model.config.first_k_dense_replace:]:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.02)
    ref = copy.deepcopy(model)
    prompt = "Q: What is 12 * 7? A:"
    ids = torch.tensor([list(prompt.encode())], device=device)
    with torch.no_grad():
        ref_logits = ref(ids).logits.float()
        t1 = time.perf_counter()
        torchforge.quantize(model, "w4a16-rtn")
        t_quant = time.perf_counter() - t1
        q_logits = model(ids).logits.float()
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    text = bytes(gen[0, ids.shape[1]:].tolist()).decode("utf-8", errors="replace")
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="torchforge-demo-")
        out_dir = tmp.name
    torchforge.save_quantized(model, out_dir)
    reloaded = torchforge.load_quantized(out_dir, device=device)
    with torch.no_grad():
        r_logits = reloaded(ids).logits.float()
    bf16_bytes = sum(p.numel() * 2 for p in ref.parameters())
    q_bytes = _dir_bytes(out_dir)
    err = (q_logits - ref_logits).abs().max().item()
    rel = ((q_logits - ref_logits).norm() / ref_logits.norm()).item()
    result = {
        "device": device,
        "params": sum(p.numel() for p in ref.parameters()),
        "bf16 bytes": bf16_bytes,
        "w4a16 checkpoint bytes": q_bytes,
        "compression": bf16_bytes / q_bytes,
        "max |logit error| vs bf16": err,
        "relative logit error": rel,
        "mean weight rel. error": _mean_weight_error(ref, model),
        "top-1 agreement": (q_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
        "reload matches": bool(torch.equal(r_logits, q_logits)),
        "quantize seconds": t_quant,
        "total seconds": time.perf_counter() - t0,
        "generated": text,
        "out_dir": out_dir if tmp is None else "(temporary)",
    }
    if tmp is not None:
        tmp.cleanup()
    return result


def _mean_weight_error(ref, quantized) -> float:
    """Mean over quantized layers of ||W - dequant(Q)|| / ||W|| (random Gaussian weights: about 0.1 at group 128)."""
    from torchforge.nn import ForgeAWQExperts, ForgeAWQLinear

    errs = []
    for name, mod in quantized.named_modules():
        if isinstance(mod, ForgeAWQLinear):
            w = ref.get_submodule(name).weight.float()
            errs.append(((mod.dequantized_weight() - w).norm() / w.norm()).item())
        elif isinstance(mod, ForgeAWQExperts):
            hf = ref.get_submodule(name)
            for dq, w in zip(mod.dequantized_weights(), (hf.gate_up_proj.float(), hf.down_proj.float())):
                errs.append(((dq - w).norm() / w.norm()).item())
    return sum(errs) / len(errs)


def format_table(result: dict) -> str:
    rows = []
    for k, v in result.items():
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, int) and not isinstance(v, bool) and v > 10_000:
            v = f"{v:,}"
        rows.append((k, repr(v) if k == "generated" else str(v)))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k.ljust(w)} | {v} |" for k, v in rows)
