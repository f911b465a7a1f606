"""Tiny HF models of every supported architecture, built from configs (no hub access)."""
from __future__ import annotations

import torch

# Dims are multiples of 32 so group_size=32 divides every quantized input dim.
COMMON = dict(vocab_size=96, hidden_size=64, num_attention_heads=2, max_position_embeddings=64,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def deepseek_v3(**kw):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**COMMON, **dict(
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, rope_scaling=None, initializer_range=0.05), **kw})
    m = DeepseekV3ForCausalLM(cfg)
    for layer in m.model.layers[cfg.first_k_dense_replace:]:  # non-trivial group-limited routing
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return m


def deepseek_v2(**kw):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(**{**COMMON, **dict(
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        topk_method="group_limited_greedy", num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, initializer_range=0.05), **kw})
    return DeepseekV2ForCausalLM(cfg)


def qwen3_moe(**kw):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**COMMON, **dict(
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_experts=8,
        num_experts_per_tok=2, num_key_value_heads=1, head_dim=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], initializer_range=0.05), **kw})
    return Qwen3MoeForCausalLM(cfg)


def mixtral(**kw):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**{**COMMON, **dict(
        intermediate_size=64, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        num_key_value_heads=1, head_dim=32, initializer_range=0.05), **kw})
    return MixtralForCausalLM(cfg)


def llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**COMMON, **dict(intermediate_size=128, num_hidden_layers=2, num_key_value_heads=1,
                                            head_dim=32, initializer_range=0.05), **kw})
    return LlamaForCausalLM(cfg)


def qwen3(**kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{**COMMON, **dict(intermediate_size=128, num_hidden_layers=2, num_key_value_heads=1,
                                            head_dim=32, initializer_range=0.05), **kw})
    return Qwen3ForCausalLM(cfg)


def phimoe(**kw):
    """A MoE whose block names its router `router` (an nn.Linear subclass): ForgeMoE cannot wrap it, so it is not in
    ALL_BUILDERS; the tests check that quantize refuses its experts up front and never quantizes the router."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    cfg = PhimoeConfig(**{**COMMON, **dict(
        intermediate_size=32, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        num_key_value_heads=1, head_dim=32, initializer_range=0.05), **kw})
    torch.manual_seed(0)
    return PhimoeForCausalLM(cfg).eval()


MOE_BUILDERS = {"deepseek_v3": deepseek_v3, "deepseek_v2": deepseek_v2, "qwen3_moe": qwen3_moe, "mixtral": mixtral}
DENSE_BUILDERS = {"llama": llama, "qwen3": qwen3}
ALL_BUILDERS = {**MOE_BUILDERS, **DENSE_BUILDERS}


def build(name: str, seed: int = 0, dtype=torch.float32, **kw):
    """Builds in fp32, then casts like transformers' loading does: RoPE inv_freq and `_keep_in_fp32_modules`
    (e.g. DeepSeek-V3's e_score_correction_bias) stay fp32."""
    torch.manual_seed(seed)
    model = ALL_BUILDERS[name](**kw).eval()
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for mod_name, mod in model.named_modules():
        for b_name, b in list(mod.named_buffers(recurse=False)) + list(mod.named_parameters(recurse=False)):
            full = f"{mod_name}.{b_name}"
            if b.is_floating_point() and "inv_freq" not in b_name and not any(k in full for k in keep):
                b.data = b.data.to(dtype)
    return model


def moe_blocks(model):
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "experts") and hasattr(m, "gate")]
