"""The project's trained fixture: a tiny DeepSeek-V3-architecture MoE over bytes (no tokenizer), trained by
`examples/train_tiny_moe.py` on generated math, stdlib docstrings (prose) and stdlib source (code).

The checkpoint is a standard HF folder (config.json + model.safetensors, per-expert tensor names as
`save_pretrained` writes them), so stock `from_pretrained` loads it too. Held-out evaluation text per domain
and a math calibration slice sit beside it.
"""
from __future__ import annotations

import math
import os

import torch

TINY_MOE_DIR = os.path.join(os.path.dirname(__file__), "data", "tiny_moe")
DOMAINS = ("math", "prose", "code")


def tiny_moe_config(**overrides):
    """1 dense + 4 MoE layers, 32 routed experts (top-4 of 4 groups, 2 groups picked), 1 shared expert, MLA.
    Every Linear input dim is a multiple of 64, so group-64 4-bit schemes apply to all of them."""
    from transformers import DeepseekV3Config

    cfg = dict(vocab_size=256, hidden_size=256, intermediate_size=768, moe_intermediate_size=64,
               num_hidden_layers=5, first_k_dense_replace=1, n_routed_experts=32, n_shared_experts=1,
               num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128,
               qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, max_position_embeddings=512,
               rope_scaling=None, tie_word_embeddings=False, initializer_range=0.02,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    return DeepseekV3Config(**cfg)


def load_tiny_moe(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", path: str | None = None):
    """The trained tiny MoE as a `DeepseekV3ForCausalLM` in eval mode (e_score_correction_bias stays fp32)."""
    from transformers import AutoModelForCausalLM

    path = path or TINY_MOE_DIR
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"tiny MoE checkpoint not found in {path}: train it with "
                                "`python examples/train_tiny_moe.py --out {path}` on a GPU")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def load_text(name: str, path: str | None = None) -> str:
    """Committed text beside the checkpoint: 'eval_{math,prose,code}' or 'calib_{math,prose,code}'."""
    file = os.path.join(path or TINY_MOE_DIR, f"{name}.txt")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} is missing: `python examples/train_tiny_moe.py --write-text-only` "
                                "writes the evaluation and calibration text")
    with open(file, encoding="ascii") as f:
        return f.read()


def encode(text: str) -> torch.Tensor:
    """Bytes as token ids (vocab 256)."""
    return torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping [N, seq_len] windows (the tail that does not fill a window is dropped)."""
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"text of {ids.numel()} tokens is shorter than one window of seq_len={seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def perplexity(model, text_or_ids, seq_len: int = 256, batch_size: int = 16) -> float:
    """exp(mean next-byte NLL) over non-overlapping windows; every window is scored from its own start."""
    ids = encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    w = windows(ids, seq_len)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, w.shape[0], batch_size):
        x = w[i: i + batch_size].to(device)
        logits = model(input_ids=x).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                reduction="sum")
        total += nll.item()
        count += x[:, 1:].numel()
    return math.exp(total / count)
