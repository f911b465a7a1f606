"""Layer-by-layer calibration streamer (seed 000 sections 1.1-1.4): router statistics of a checkpoint far larger
than GPU memory, one decoder layer on the device at a time.

The model is a transformers skeleton on the meta device, built from config.json. The embedding is loaded
first to embed the calibration batches; then for each decoder layer: its tensors are read from the shards
(only the ones the safetensors index lists for it) into host memory - page-locked on CUDA - by a
background thread while the previous layer computes, materialized on the device (FP8 dequantized there),
run on every batch, and sent back to the meta device before the next layer is materialized. Hidden states
stay on the host between layers and are spilled to `offload_dir` beyond `host_budget_bytes`
(`torchforge.calibration.activations`).

Each decoder layer runs in two stages by default (`split_layers`): first its attention half (every tensor but the
MLP block's) on all batches, then its MLP half (every tensor but the attention's), each stage loaded, run and
freed before the next. The layer's own forward runs both times, with the other half replaced by a stub that
returns zeros, so `h + attn(norm(h))` and then `h + mlp(norm(h))` are computed exactly as in one pass (adding
a zero is exact); the hidden states between the two stages go through the host like those between layers.
The device then never holds a whole layer: its peak is the larger half plus that half's working set (MLA
attention on 1024-token sequences alone needs ~350 MB at DeepSeek-V3 width), below one layer's weights.

Statistics are those of `collect_router_stats` (same hooks and probability code, `router_stats.router_sums`):
hit_map[L, E] sums the router's sigmoid probabilities (never turned into a softmax) or, for softmax routers,
their softmax; top-k counts and routed weight come from the router's own picks. Dense layers (DeepSeek's
first_k_dense_replace) are run and contribute no row. Batches are parsed as there (`router_stats._batch`):
input_ids [B, S] or a tokenizer's output with an attention_mask; padded positions get the model's own
causal+padding mask (transformers' create_causal_mask, as the whole model builds it) and generate()'s
position ids, and are left out of every statistic and of `tokens`, in both modes.

Modes:
- "exact": every layer runs in full; the result equals `collect_router_stats` on the whole model.
- "approx": seed 000 section 1.4's sparse forward. Attention, residuals, norms and shared experts run; the
  router runs (for the statistics) but the routed experts are skipped, so the MoE block's output is the
  shared experts' output only (zero for models without them). The routed experts' weights are then never
  read from disk nor put on the device, which is most of a DeepSeek-V3 layer.
"""
from __future__ import annotations

import functools
import inspect
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from torchforge.export.folder import restore_fp32
from torchforge.calibration import layer_loader
from torchforge.calibration.activations import ActivationStore, check_offload_dir
from torchforge.calibration.router_stats import (ROUTERS, RouterStats, _batch, add_sums, new_stats, position_ids,
                                                  router_sums)
from torchforge.io import CheckpointError, checkpoint_tensor_names

MODES = ("exact", "approx")


@functools.lru_cache(maxsize=None)
def _cache_kwarg(fn) -> str:
    """The name of a transformers mask function's cache argument: `cache` since transformers 5.24 (`past_key_values`
    is renamed there, with a FutureWarning, until the shim goes), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _read_config(model_path: str):
    cfg_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"LayerwiseStreamer: {model_path} has no config.json; pass the folder of a Hugging Face "
                              "checkpoint (config.json plus its safetensors shards and index)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"LayerwiseStreamer: transformers cannot read {cfg_path}: {e}") from e


def _fp8_block(qc: dict, model_path: str):
    """Block size of a DeepSeek-style FP8 checkpoint, None for an unquantized one."""
    if not qc:
        return None
    if qc.get("quant_method") != "fp8":
        raise CheckpointError(f"LayerwiseStreamer: {model_path} is quantized with quant_method="
                              f"{qc.get('quant_method')!r}; it reads bf16/fp16/fp32 checkpoints and DeepSeek's block "
                              "FP8 (quant_method 'fp8'): calibrate on the original checkpoint")
    return tuple(qc.get("weight_block_size") or (128, 128))


class LayerwiseStreamer:
    """`LayerwiseStreamer(model_path, offload_dir=None, ...)`: see the module docstring.

    device: where layers run (default cuda when available); dtype: compute dtype of the layers (FP8 weights are
    dequantized to it); router_attr / prob: router path inside a decoder layer and 'sigmoid' | 'softmax', for
    architectures the registry (router_stats.ROUTERS) does not know; host_budget_bytes: hidden states held in
    host memory beyond which batches go to `offload_dir` (a temporary folder when None); attn_implementation:
    forwarded to transformers ('sdpa' by default); moe_chunk_tokens: exact mode runs each MoE block on at most
    this many tokens at a time (None: whole batches); split_layers: run the attention and MLP halves of each
    decoder layer as separate stages (default: on for the registered architectures, whose decoder layers are
    all `h + self_attn(norm(h))` then `h + mlp(norm(h))`; pass True for another architecture of that form).

    After a run: `stats` (RouterStats), `peak_gpu_bytes` (torch.cuda.max_memory_allocated above what was
    allocated when the run started, None off CUDA; cuBLAS allocates its workspace, 32 MiB on Hopper, through
    the caching allocator on the first matmul of a process, so run one matmul first to keep it out),
    `largest_layer_bytes` (the weights of the largest layer the mode reads, both halves), `largest_stage_bytes`
    (the most weight bytes on the device at once), `peak_host_activation_bytes`, `max_chunk_bytes`, `spills`, `layer_seconds`.
    """

    def __init__(self, model_path, offload_dir=None, *, device=None, dtype: torch.dtype = torch.bfloat16,
                 router_attr: str | None = None, prob: str | None = None, host_budget_bytes: int | None = None,
                 attn_implementation: str | None = None, moe_chunk_tokens: int | None = 256,
                 split_layers: bool | None = None):
        self.model_path = os.fspath(model_path)
        self.offload_dir = offload_dir
        self.host_budget_bytes = host_budget_bytes
        if offload_dir is not None:  # checked now, not at the first spill after the embedding and some layers ran
            check_offload_dir(offload_dir)
            if host_budget_bytes is None:
                warnings.warn("LayerwiseStreamer: offload_dir without host_budget_bytes is never used (every batch's "
                              "hidden states stay in host memory); pass host_budget_bytes to spill past it",
                              stacklevel=2)
        if moe_chunk_tokens is not None and moe_chunk_tokens < 1:
            raise ValueError(f"LayerwiseStreamer: moe_chunk_tokens must be >= 1 or None, got {moe_chunk_tokens}")
        self.moe_chunk_tokens = moe_chunk_tokens
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        config = _read_config(self.model_path)
        self.tensor_files = checkpoint_tensor_names(self.model_path)  # checks the index and that every shard exists
        qc = getattr(config, "quantization_config", None)
        qc = qc if isinstance(qc, dict) or qc is None else qc.to_dict()
        self.fp8_block = _fp8_block(qc, self.model_path)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # transformers' own quantizers stay out: FP8 is dequantized here
        self.config = config
        self.model_type = config.model_type
        self.model = self._skeleton(config, attn_implementation)
        self.layer_prefix, self.decoder_layers = self._find_layers()
        self.router_attr, self.prob = self._resolve_router(router_attr, prob)
        self.moe_layers = [i for i, layer in enumerate(self.decoder_layers) if self._router(layer) is not None]
        if not self.moe_layers:
            raise ValueError(f"LayerwiseStreamer: no decoder layer of {self.model_path} has a module "
                             f"'{self.router_attr}'; pass router_attr= the router's path inside a decoder layer")
        self.num_experts = self._router(self.decoder_layers[self.moe_layers[0]]).weight.shape[0]
        self.split_layers = self._resolve_split(split_layers)
        self.stats: RouterStats | None = None
        self.peak_gpu_bytes: int | None = None
        self.largest_layer_bytes = 0
        self.largest_stage_bytes = 0
        self.peak_host_activation_bytes = 0
        self.max_chunk_bytes = 0
        self.spills = 0
        self.layer_seconds: list[float] = []

    # ----------------------------------------------------------------------------------------------- setup

    def _skeleton(self, config, attn_implementation):
        from transformers import AutoModelForCausalLM

        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, **kw)
        restore_fp32(model)  # as from_pretrained keeps them (DeepSeek's e_score_correction_bias)
        return model.eval()

    def _find_layers(self):
        n = self.config.num_hidden_layers
        for name, mod in self.model.named_modules():
            if isinstance(mod, nn.ModuleList) and name.endswith("layers") and len(mod) == n:
                return name + ".", mod
        raise ValueError(f"LayerwiseStreamer: no ModuleList of {n} decoder layers in {type(self.model).__name__}")

    def _resolve_router(self, router_attr, prob):
        if router_attr is None:
            if self.model_type not in ROUTERS:
                raise ValueError(f"LayerwiseStreamer: no router registered for model_type {self.model_type!r} (known: "
                                 f"{sorted(ROUTERS)}); pass router_attr='mlp.gate' (its path inside a decoder layer) "
                                 "and prob='sigmoid'|'softmax'")
            router_attr, default = ROUTERS[self.model_type]
            prob = prob or default
        elif prob is None and self.model_type in ROUTERS:
            prob = ROUTERS[self.model_type][1]
        if prob not in ("sigmoid", "softmax"):
            raise ValueError(f"LayerwiseStreamer: pass prob='sigmoid' or 'softmax' (how the router at {router_attr!r} "
                             f"turns logits into probabilities), got {prob!r}")
        return router_attr, prob

    def _router(self, layer):
        try:
            return layer.get_submodule(self.router_attr)
        except AttributeError:
            return None

    def _mlp_path(self) -> str:
        return self.router_attr.split(".")[0]

    def _resolve_split(self, split_layers):
        halves = ("." in self.router_attr and all(
            isinstance(getattr(layer, "self_attn", None), nn.Module)
            and isinstance(getattr(layer, self._mlp_path(), None), nn.Module) for layer in self.decoder_layers))
        if split_layers and not halves:
            raise ValueError(f"LayerwiseStreamer: split_layers=True needs decoder layers with a 'self_attn' module and "
                             f"the router's block '{self._mlp_path()}' as children; pass split_layers=False")
        return halves and (split_layers if split_layers is not None else self.model_type in ROUTERS)

    def _experts_path(self) -> str:
        return (self.router_attr.rpartition(".")[0] + ".experts").lstrip(".")

    # -------------------------------------------------------------------------------------------- loading

    def _names(self, prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
        from torchforge.export.naming import from_checkpoint_name

        out = []
        for n in self.tensor_files:
            mem = from_checkpoint_name(n, self.model_type)
            if mem.startswith(prefix) and not any(mem.startswith(prefix + s + ".") for s in skip):
                out.append(n)
        return out

    def _read(self, idx: int, skip: tuple[str, ...]):
        prefix = f"{self.layer_prefix}{idx}."
        names = self._names(prefix, skip)
        if not names:
            raise CheckpointError(f"{self.model_path} has no tensors for decoder layer {idx} "
                                  f"({prefix}*): the checkpoint is incomplete or not this config's")
        if not skip and all(n.startswith(prefix) for n in names):
            names = [prefix]  # one prefix instead of thousands of names (iter_checkpoint matches every one)
        return layer_loader.read_host(self.model_path, names, pin=self.device.type == "cuda")

    def _load(self, module: nn.Module, prefix: str, host: dict, skip: tuple[str, ...] = ()) -> int:
        nbytes = layer_loader.materialize(module, self.device, skip)
        try:
            layer_loader.load_into(module, prefix, host, model_type=self.model_type, model_path=self.model_path,
                                   fp8_block=self.fp8_block or (128, 128))
        except BaseException:
            self._free(module)
            raise
        return nbytes

    def _free(self, module: nn.Module) -> None:
        layer_loader.free(module)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _stages(self, routed_experts: bool, split: bool) -> list[tuple[int, str | None, tuple[str, ...]]]:
        """(layer, stage, submodules left on meta) in run order; stage None is the whole layer."""
        experts = () if routed_experts else (self._experts_path(),)
        self.largest_layer_bytes = max(layer_loader.nbytes(layer, experts) for layer in self.decoder_layers)
        self.largest_stage_bytes = 0
        out = []
        for i in range(len(self.decoder_layers)):
            if split:
                out += [(i, "attn", (self._mlp_path(),)), (i, "mlp", ("self_attn",) + experts)]
            else:
                out.append((i, None, experts))
        return out

    def _stream(self, stages):
        """Yields (layer_idx, stage, module on the device) for each stage: load, yield, free. The next stage's
        tensors are read from disk while the caller works on the current one."""
        self.layer_seconds = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchforge-prefetch") as pool:
            future = pool.submit(self._read, stages[0][0], stages[0][2])
            seconds = 0.0
            for n, (i, stage, skip) in enumerate(stages):
                host = future.result()
                future = pool.submit(self._read, stages[n + 1][0], stages[n + 1][2]) if n + 1 < len(stages) else None
                start = time.perf_counter()
                layer = self.decoder_layers[i]
                self.largest_stage_bytes = max(self.largest_stage_bytes,
                                               self._load(layer, f"{self.layer_prefix}{i}.", host, skip))
                del host
                try:
                    yield i, stage, layer
                finally:
                    self._free(layer)
                    seconds += time.perf_counter() - start
                    if n + 1 == len(stages) or stages[n + 1][0] != i:
                        self.layer_seconds.append(seconds)
                        seconds = 0.0

    def layers(self, *, routed_experts: bool = True):
        """Yields (layer_idx, decoder layer on the device) for every layer: load, yield, free (seed 000 1.2.2).
        The next layer's tensors are read from disk while the caller works on the current one; the caller must
        not keep references to a layer after the next iteration starts. routed_experts=False leaves the
        routed experts of MoE layers on the meta device (unread), as the "approx" mode needs."""
        for i, _, layer in self._stream(self._stages(routed_experts, split=False)):
            yield i, layer

    stream_layers = layers  # the seed's name

    # ------------------------------------------------------------------------------------------- running

    def _embed(self, batches: list[torch.Tensor], store: ActivationStore) -> None:
        emb = self.model.get_input_embeddings()
        prefix = next(n for n, m in self.model.named_modules() if m is emb) + "."
        host = layer_loader.read_host(self.model_path, self._names(prefix), pin=False)
        self._load(emb, prefix, host)
        if batches:  # every layer's hidden states are [B, S, H] in the embedding's dtype: reserve the largest
            store.expect(max(ids.numel() for ids in batches) * emb.weight.shape[1] * emb.weight.element_size())
        try:
            for b, ids in enumerate(batches):
                store.put(b, emb(ids.to(self.device)).to("cpu"), layer=0)
        finally:
            self._free(emb)

    def _rotary(self):
        rot = getattr(getattr(self.model, "model", self.model), "rotary_emb", None)
        if rot is None:
            raise ValueError(f"LayerwiseStreamer: {type(self.model).__name__} has no model.rotary_emb")
        with torch.device(self.device):  # rotary __init__ signatures differ across models; all take the config
            return type(rot)(rot.config)

    def _mask(self, idx: int, h: torch.Tensor, position_ids: torch.Tensor, padding: torch.Tensor | None = None):
        """Layer `idx`'s attention mask for one batch, built by transformers' mask functions from the batch's 2-D
        padding mask (None: no padding) exactly as the model's forward builds it."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        types = getattr(self.config, "layer_types", None)
        if types:
            sliding = types[idx] == "sliding_attention"
        else:
            sliding = getattr(self.config, "sliding_window", None) is not None
        fn = create_sliding_window_causal_mask if sliding else create_causal_mask
        return fn(config=self.config, inputs_embeds=h, attention_mask=padding, position_ids=position_ids,
                  **{_cache_kwarg(fn): None})

    @staticmethod
    def _token_chunked_forward(moe: nn.Module, chunk: int):
        """The MoE block run on at most `chunk` tokens at a time (tokens are independent in an MoE block), so its
        working set (routed copies of the tokens, expert intermediates: top-k x the chunk) stays small next to
        the layer's weights whatever the calibration batch size."""
        run = type(moe).forward

        def forward(hidden_states):
            flat = hidden_states.reshape(1, -1, hidden_states.shape[-1])
            if flat.shape[1] <= chunk:
                return run(moe, hidden_states)
            parts = [run(moe, flat[:, i:i + chunk]) for i in range(0, flat.shape[1], chunk)]
            return torch.cat(parts, dim=1).reshape(hidden_states.shape)
        return forward

    def _approx_forward(self, moe: nn.Module, router: nn.Module):
        """seed 000 1.4: the MoE block's output without its routed experts (the router still runs)."""
        def forward(hidden_states):
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            router(flat)
            if getattr(moe, "shared_experts", None) is not None:
                return moe.shared_experts(hidden_states)
            if getattr(moe, "shared_expert", None) is not None:  # Qwen2-MoE: sigmoid-gated shared expert
                out = moe.shared_expert(flat)
                if getattr(moe, "shared_expert_gate", None) is not None:
                    out = torch.sigmoid(moe.shared_expert_gate(flat)) * out
                return out.reshape(hidden_states.shape)
            return torch.zeros_like(hidden_states)
        return forward

    @torch.no_grad()
    def collect_router_stats(self, batches, mode: str = "exact", *, max_tokens: int | None = None) -> RouterStats:
        """RouterStats of `batches` in "exact" or "approx" mode (see the module docstring); in exact mode the same
        result as `collect_router_stats` on the whole model.

        Each batch is an integer input_ids tensor [B, S], or a mapping with `input_ids` and an optional
        `attention_mask` [B, S] of 0/1 (a tokenizer's BatchEncoding; other keys are ignored). Padded positions
        (mask 0, left or right) are masked in attention as the model masks them, positions count real tokens
        only (as generate() numbers them), and padding is left out of every statistic and of `tokens`, in both
        modes (`max_tokens` counts real tokens too). A mask of another shape, with values other than 0/1 or with
        a row of padding only raises ValueError."""
        if mode not in MODES:
            raise ValueError(f"LayerwiseStreamer: mode must be one of {MODES}, got {mode!r}")
        batches, masks = self._take(batches, max_tokens)
        names = [f"{self.layer_prefix}{i}.{self.router_attr}" for i in self.moe_layers]
        row = {layer: r for r, layer in enumerate(self.moe_layers)}
        stats = new_stats(len(names), self.num_experts, names, {
            "prob": self.prob, "mode": mode, "router_attr": self.router_attr, "model_path": self.model_path,
            "model_type": self.model_type, "dtype": str(self.dtype), "fp8": self.fp8_block is not None,
            "batches": len(batches), "max_tokens": max_tokens, "streamer": True})
        stats.tokens = sum(int(ids.numel() if m is None else m.sum()) for ids, m in zip(batches, masks))
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            start_bytes = torch.cuda.memory_allocated(self.device)
        self.layer_seconds = []
        store = ActivationStore(self.host_budget_bytes, self.offload_dir)
        try:
            self._embed(batches, store)
            rotary = self._rotary()
            for i, stage, layer in self._stream(self._stages(mode == "exact", self.split_layers)):
                sums = self._run_layer(i, stage, layer, masks, store, rotary, mode)
                if sums is not None:
                    add_sums(stats, row[i], sums)
        finally:
            self.peak_host_activation_bytes = store.peak_host_bytes
            self.max_chunk_bytes = store.max_chunk_bytes
            self.spills = store.spills
            store.close()
            if on_cuda:
                self.peak_gpu_bytes = torch.cuda.max_memory_allocated(self.device) - start_bytes
        self.stats = stats
        return stats

    @staticmethod
    def _zero_attention(*args, **kwargs):
        """Stands in for self_attn in the MLP stage: the layer adds zero to the residual stream."""
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return torch.zeros_like(h), None

    def _run_layer(self, i: int, stage: str | None, layer: nn.Module, masks: list, store: ActivationStore,
                   rotary, mode: str):
        """Runs every batch through stage `stage` of decoder layer `i` (None: the whole layer), replacing its
        hidden states in `store`; returns the layer's router sums (on the device), None for a dense layer or
        the attention stage. `masks[b]` is batch b's [B, S] padding mask (None: no padding)."""
        router = None if stage == "attn" else self._router(layer)
        parent = self.router_attr.rpartition(".")[0]
        if router is not None and mode == "approx" and not parent:
            raise ValueError(f"LayerwiseStreamer: approx mode needs the router inside an MoE block "
                             f"(router_attr like 'mlp.gate'), got {self.router_attr!r}")
        acc: list = [None]
        keep: list = [None, 0]  # the current batch's [B * S] real-token mask (None: no padding), tokens hooked so far
        handle, patched = None, []
        tag = f"{i}_mid" if stage == "attn" else i + 1  # spill files: input of layer i's MLP half, of layer i + 1
        try:  # every patch below is undone in `finally`: the skeleton is shared by all later runs
            if stage == "attn":
                mlp = layer.get_submodule(self._mlp_path())
                mlp.forward = torch.zeros_like  # instance attribute: shadows the class's forward
                patched.append(mlp)
            elif stage == "mlp":
                layer.self_attn.forward = self._zero_attention
                patched.append(layer.self_attn)
            if router is not None:
                def hook(mod, inputs, output):
                    part = None
                    if keep[0] is not None:  # the router may see a batch in token chunks, in flat [B * S] order
                        n = inputs[0].numel() // mod.weight.shape[1]
                        part, keep[1] = keep[0][keep[1]:keep[1] + n], keep[1] + n
                    s = router_sums(mod, inputs[0], output, self.prob, part)
                    acc[0] = s if acc[0] is None else tuple(x + y for x, y in zip(acc[0], s))
                handle = router.register_forward_hook(hook)
                if mode == "approx":
                    moe = layer.get_submodule(parent)
                    moe.forward = self._approx_forward(moe, router)
                    patched.append(moe)
                elif parent and self.moe_chunk_tokens is not None:
                    moe = layer.get_submodule(parent)
                    moe.forward = self._token_chunked_forward(moe, self.moe_chunk_tokens)
                    patched.append(moe)
            for b, pad in enumerate(masks):
                h = store.get(b).to(self.device, non_blocking=True)
                if pad is None:
                    pos = torch.arange(h.shape[1], device=self.device).unsqueeze(0)
                else:  # as the whole model gets them in collect_router_stats: generate()'s positions, and the mask
                    pos, pad = position_ids(pad).to(self.device), pad.to(self.device)
                keep[:] = [None if pad is None else pad.reshape(-1) != 0, 0]
                attn = stage != "mlp"  # the MLP stage's stub attention needs no mask nor rotary embedding
                out = layer(h, attention_mask=self._mask(i, h, pos, pad) if attn else None, position_ids=pos,
                            position_embeddings=rotary(h, pos) if attn else None, use_cache=False)
                if keep[0] is not None and router is not None and keep[1] != keep[0].numel():
                    raise ValueError(f"LayerwiseStreamer: the router of layer {i} saw {keep[1]} tokens of batch {b}, "
                                     f"which has {keep[0].numel()}; cannot tell its padding apart")
                out = out[0] if isinstance(out, tuple) else out
                store.put(b, out.to("cpu"), layer=tag)
                del h, out  # else held while the next batch is read: host peak over the budget on device="cpu"
        finally:
            if handle is not None:
                handle.remove()
            for m in patched:
                del m.forward
        return acc[0]

    @staticmethod
    def _take(batches, max_tokens):
        """([input_ids [B, S]], [padding mask [B, S] or None]) of the batches used: parsed and checked as
        `collect_router_stats` parses them, up to `max_tokens` real tokens."""
        ids_out, masks, tokens = [], [], 0
        for item in batches:
            if max_tokens is not None and tokens >= max_tokens:
                break
            ids, mask = _batch(item, "LayerwiseStreamer")
            ids_out.append(ids)
            masks.append(mask)
            tokens += ids.numel() if mask is None else int(mask.sum())
        if not ids_out:
            raise ValueError("LayerwiseStreamer: no calibration batches")
        return ids_out, masks
