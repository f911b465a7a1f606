"""Synthetic HF checkpoints of real MoE architectures at reduced width, written tensor by tensor.

`make_checkpoint` builds the architecture's transformers config, reads the tensor names, shapes and dtypes
from a model built on the meta device, and writes random values shard by shard with the names a Hugging
Face checkpoint uses on disk (transformers 5 fuses routed experts in memory, `experts.gate_up_proj
[E, 2I, H]`; its checkpoints and `save_pretrained` keep them one by one, `experts.{e}.gate_proj.weight`).
Only one tensor is in host memory at a time, so it can write checkpoints far larger than RAM. With
`fp8=True` the decoder layers' Linear weights are stored as DeepSeek-V3 does: float8_e4m3fn plus a float32
`weight_scale_inv` per 128x128 block (see torchforge.io.fp8).
"""
from __future__ import annotations

import json
import math
import os
import zlib

import torch

from torchforge.export.naming import to_checkpoint_name
from torchforge.io.checkpoint import SAFE_WEIGHTS_INDEX_NAME
from torchforge.io.save import (_fsync_dir, _fsync_file, _lock_folder, _plan_shards, _temp_path, _unlink_quiet,
                                _unlock_folder, atomic_write_json)

__all__ = ["make_checkpoint", "make_config", "ARCHS", "DEEPSEEK_V3_ATTENTION", "FP8_BLOCK"]

FP8_BLOCK = (128, 128)
_FP8_MAX = 448.0  # largest finite float8_e4m3fn value

# DeepSeek-V3's own MLA dimensions (for benchmarks at real layer width).
DEEPSEEK_V3_ATTENTION = dict(num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

_COMMON = dict(tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
               max_position_embeddings=4096)


def _deepseek_groups(e: int) -> dict:
    n_group = 4 if e % 4 == 0 and e >= 8 else 1
    topk_group = max(1, n_group // 2)
    top_k = min(8, max(2, e // 4), topk_group * e // n_group)
    return dict(n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k)


def _deepseek_v3(h, e, moe_i, heads):
    return dict(moe_intermediate_size=moe_i, intermediate_size=4 * moe_i, n_routed_experts=e, n_shared_experts=1,
                first_k_dense_replace=1, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=h // 2,
                kv_lora_rank=h // 4, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, **_deepseek_groups(e))


def _deepseek_v2(h, e, moe_i, heads):
    return dict(_deepseek_v3(h, e, moe_i, heads), topk_method="group_limited_greedy", q_lora_rank=None)


def _qwen3_moe(h, e, moe_i, heads):
    return dict(moe_intermediate_size=moe_i, intermediate_size=4 * moe_i, num_experts=e,
                num_experts_per_tok=min(4, e), num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                head_dim=h // heads, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _mixtral(h, e, moe_i, heads):
    return dict(intermediate_size=moe_i, num_local_experts=e, num_experts_per_tok=2, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 2), head_dim=h // heads)


def _olmoe(h, e, moe_i, heads):
    return dict(intermediate_size=moe_i, num_experts=e, num_experts_per_tok=min(4, e), num_attention_heads=heads,
                num_key_value_heads=heads)


# arch (= config.model_type) -> (transformers config class, reduced-width settings(hidden, E, moe_I, heads))
ARCHS = {
    "deepseek_v3": ("DeepseekV3Config", _deepseek_v3),
    "deepseek_v2": ("DeepseekV2Config", _deepseek_v2),
    "qwen3_moe": ("Qwen3MoeConfig", _qwen3_moe),
    "mixtral": ("MixtralConfig", _mixtral),
    "olmoe": ("OlmoeConfig", _olmoe),
}


def make_config(arch: str = "deepseek_v3", *, num_layers: int = 8, hidden_size: int = 256, n_routed_experts: int = 16,
                moe_intermediate_size: int = 128, vocab_size: int = 512, **config_overrides):
    """The transformers config of `arch` at reduced width; `config_overrides` are config keys and win."""
    if arch not in ARCHS:
        raise ValueError(f"make_checkpoint: unknown arch {arch!r}; known: {sorted(ARCHS)}")
    import transformers

    cls_name, settings = ARCHS[arch]
    heads = max(1, hidden_size // 64)
    kw = {**_COMMON, "vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_layers,
          "initializer_range": 0.02, **settings(hidden_size, n_routed_experts, moe_intermediate_size, heads),
          **config_overrides}
    return getattr(transformers, cls_name)(**kw)


def _router_attr(arch: str) -> str:
    from torchforge.calibration.router_stats import ROUTERS

    return ROUTERS.get(arch, ("mlp.gate", None))[0]


def _disk_tensors(cfg, dtype: torch.dtype, fp8: bool):
    """[(checkpoint name, shape, stored dtype, kind)] in checkpoint order, from a meta-device model.
    kind: "fp8" (quantized weight, its scale follows), "scale", or "plain"."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    keep_fp32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    router_weight = f".{_router_attr(cfg.model_type)}.weight"
    out = []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        stored = torch.float32 if any(k in name for k in keep_fp32) else t.dtype
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # fused in memory, per expert on disk
            prefix, proj = name.rsplit(".", 1)
            E, rows, cols = t.shape
            if proj == "gate_up_proj":
                parts = [("gate_proj", rows // 2), ("up_proj", rows // 2)]
            else:
                parts = [("down_proj", rows)]
            pieces = [(f"{prefix}.{e}.{p}.weight", (r, cols)) for e in range(E) for p, r in parts]
        else:
            pieces = [(name, tuple(t.shape))]
        for piece, shape in pieces:
            quantized = (fp8 and name.startswith("model.layers.") and len(shape) == 2 and piece.endswith(".weight")
                         and not name.endswith(router_weight))
            disk = to_checkpoint_name(piece, cfg.model_type)
            if quantized:
                out.append((disk, shape, torch.float8_e4m3fn, "fp8"))
                out.append((disk + "_scale_inv", tuple(math.ceil(s / b) for s, b in zip(shape, FP8_BLOCK)),
                            torch.float32, "scale"))
            else:
                out.append((disk, shape, stored, "plain"))
    return out, type(model).__name__


def _random(name: str, shape, seed: int, device) -> torch.Tensor:
    """fp32 values, seeded by (seed, name) so that they do not depend on order or sharding. Matrices get
    std 1/sqrt(fan_in) (activations stay O(1) at any width), norms 1 + noise, biases small noise."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if "embed_tokens" in name:
        return t
    if len(shape) >= 2:
        return t.mul_(shape[-1] ** -0.5)
    if name.endswith("norm.weight"):
        return t.mul_(0.1).add_(1.0)
    return t.mul_(0.05)


def quantize_fp8_block(w: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek block FP8: (float8_e4m3fn weight, float32 scale_inv = block amax / 448) of a 2-D tensor."""
    m, n = w.shape
    bm, bn = block
    gm, gn = math.ceil(m / bm), math.ceil(n / bn)
    padded = torch.zeros(gm * bm, gn * bn, dtype=torch.float32, device=w.device)
    padded[:m, :n] = w
    blocks = padded.view(gm, bm, gn, bn)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / _FP8_MAX).clamp_min(1e-12)
    q = (blocks / scale_inv[:, None, :, None]).view(gm * bm, gn * bn)[:m, :n].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv


def _values(entries, seed: int, device):
    """Yields (name, tensor as stored) one at a time; an fp8 weight's scale comes right after it."""
    pending_scale = None
    for name, shape, dtype, kind in entries:
        if kind == "scale":
            yield name, pending_scale.cpu()
            pending_scale = None
            continue
        t = _random(name, shape, seed, device)
        if kind == "fp8":
            t, pending_scale = quantize_fp8_block(t)
        yield name, t.to(dtype).cpu()


_ST_CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def _write_shard(path: str, entries, values) -> None:
    """A safetensors file written as a stream: header from the shapes, then each tensor's bytes in turn."""
    header, offset = {}, 0
    for name, shape, dtype, _ in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for (name, shape, dtype, _), (vname, t) in zip(entries, values):
            assert vname == name and tuple(t.shape) == tuple(shape) and t.dtype == dtype, (name, vname)
            f.write(t.contiguous().view(torch.uint8).numpy().data)


def make_checkpoint(path, arch: str = "deepseek_v3", *, num_layers: int = 8, hidden_size: int = 256,
                    n_routed_experts: int = 16, moe_intermediate_size: int = 128, vocab_size: int = 512,
                    dtype: torch.dtype = torch.bfloat16, fp8: bool = False, shard_size_bytes: int = 2 * 2**30,
                    seed: int = 0, device: str | torch.device = "cpu", **config_overrides):
    """Writes a sharded safetensors checkpoint of `arch` (a transformers model_type: deepseek_v3, deepseek_v2,
    qwen3_moe, mixtral, olmoe) with random weights into the new or empty folder `path`; returns `path`.

    config.json comes from `make_config` (`config_overrides` are config keys, e.g. first_k_dense_replace=1,
    q_lora_rank=1536). Shards are `model-XXXXX-of-YYYYY.safetensors` of at most `shard_size_bytes` (a
    bigger tensor gets its own), listed by `model.safetensors.index.json`, which is written last. Floating
    tensors are `dtype` (DeepSeek's e_score_correction_bias: float32). With `fp8`, config.json gets
    DeepSeek-V3's `quantization_config` and every 2-D Linear weight of the decoder layers (routers excepted)
    is float8_e4m3fn with its float32 `weight_scale_inv` [ceil(out/128), ceil(in/128)]. `device`: where the
    random values are drawn and quantized (a GPU is much faster for big checkpoints); values depend on
    `seed` and the tensor name only.
    """
    path = os.fspath(path)
    if os.path.exists(path) and os.listdir(path):
        raise FileExistsError(f"make_checkpoint: {path} is not empty; pass a new or empty folder")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"make_checkpoint: dtype must be bfloat16, float16 or float32, got {dtype}")
    cfg = make_config(arch, num_layers=num_layers, hidden_size=hidden_size, n_routed_experts=n_routed_experts,
                      moe_intermediate_size=moe_intermediate_size, vocab_size=vocab_size, **config_overrides)
    entries, model_class = _disk_tensors(cfg, dtype, fp8)
    os.makedirs(path, exist_ok=True)

    by_name = {e[0]: e for e in entries}
    sizes = {name: math.prod(shape) * dt.itemsize for name, shape, dt, _ in entries}
    plan = _plan_shards(sizes, shard_size_bytes)
    for i in range(len(plan) - 1):  # an fp8 weight goes in the shard of its scale (written right after it)
        if plan[i] and by_name[plan[i][-1]][3] == "fp8":
            plan[i + 1].insert(0, plan[i].pop())
    plan = [p for p in plan if p]
    names = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]

    config = json.loads(cfg.to_json_string(use_diff=False))
    config["architectures"] = [model_class]
    config["dtype"] = str(dtype).removeprefix("torch.")
    if fp8:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": list(FP8_BLOCK)}

    # its temporaries have save_sharded's names, which a save into the folder removes as stale unless locked
    lock = _lock_folder(path)
    try:
        temps = []
        try:
            for fname, shard in zip(names, plan):
                shard_entries = [by_name[n] for n in shard]
                tmp = _temp_path(os.path.join(path, fname))
                temps.append(tmp)
                _write_shard(tmp, shard_entries, _values(shard_entries, seed, torch.device(device)))
                _fsync_file(tmp)
            for tmp, fname in zip(temps, names):
                os.replace(tmp, os.path.join(path, fname))
        except BaseException:
            for tmp in temps:
                _unlink_quiet(tmp)
            raise
        _fsync_dir(path)
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: fname for fname, shard in zip(names, plan) for n in shard}}
        atomic_write_json(os.path.join(path, SAFE_WEIGHTS_INDEX_NAME), index, sort_keys=True)
    finally:
        _unlock_folder(lock)
    atomic_write_json(os.path.join(path, "config.json"), config)  # last, as the exports: a failed write leaves none
    return path

