"""Putting one module's checkpoint tensors onto a device, into a skeleton built on the meta device.

Checkpoints store routed experts one by one (`mlp.experts.{e}.gate_proj.weight`); transformers 5 fuses them
in memory (`mlp.experts.gate_up_proj [E, 2I, H]`, gate rows first, and `down_proj [E, H, I]`): each expert's
tensor is copied into its slice of the fused parameter on the device, so no stacked copy is ever made.
DeepSeek block-FP8 weights travel to the device as float8 (half the bytes of bf16) and are dequantized there.
"""
from __future__ import annotations

import torch
from torch import nn

from torchforge.export.naming import EXPERT_KEY, from_checkpoint_name
from torchforge.io import CheckpointError, dequantize_fp8_block, iter_checkpoint
from torchforge.io.fp8 import check_scale_inv, expected_scale_shape, is_fp8_dtype

_SCALE_INV = "_scale_inv"


def read_host(model_path: str, prefixes: list[str], pin: bool) -> dict[str, torch.Tensor]:
    """The checkpoint tensors whose names start with one of `prefixes`, as stored (float8 weights and their
    scales apart), in host memory, page-locked when `pin` so that host-to-device copies can run asynchronously."""
    out = {}
    for name, t in iter_checkpoint(model_path, prefixes):
        out[name] = t.pin_memory() if pin else t
    return out


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(name == s or name.startswith(s + ".") for s in skip)


def _own_tensors(module: nn.Module, skip: tuple[str, ...]):
    """(submodule, "parameter"|"buffer", name, tensor) of every tensor of `module` outside the submodules `skip`."""
    for name, sub in module.named_modules():
        if _skipped(name, skip):
            continue
        for pname, p in sub._parameters.items():
            if p is not None:
                yield sub, "parameter", pname, p
        for bname, b in sub._buffers.items():
            if b is not None:
                yield sub, "buffer", bname, b


def nbytes(module: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Bytes of the parameters and buffers of `module` outside the submodules `skip` (works on the meta device)."""
    return sum(t.numel() * t.element_size() for *_, t in _own_tensors(module, skip))


def materialize(module: nn.Module, device, skip: tuple[str, ...] = ()) -> int:
    """Gives every parameter and buffer of `module` uninitialized storage on `device`, except those under the
    submodules `skip` (which stay on meta); returns the bytes allocated."""
    total = 0
    for sub, kind, name, t in list(_own_tensors(module, skip)):
        if kind == "parameter":
            sub._parameters[name] = nn.Parameter(torch.empty_like(t, device=device), requires_grad=False)
        else:
            sub._buffers[name] = torch.empty_like(t, device=device)
        total += t.numel() * t.element_size()
    return total


def free(module: nn.Module) -> None:
    """Back to the meta device: the device memory is released once nothing else refers to it."""
    module.to_empty(device="meta")


def _destination(module: nn.Module, name: str) -> tuple[torch.Tensor, str]:
    """The tensor (a parameter, a buffer or a slice of fused experts) that checkpoint tensor `name` (in-memory
    naming, relative to `module`) fills, and the parameter's name."""
    try:
        return module.get_parameter(name), name
    except AttributeError:
        pass
    try:
        return module.get_buffer(name), name
    except AttributeError:
        pass
    m = EXPERT_KEY.match(name)
    if m is None or m["kind"] != "weight":
        raise KeyError(name)
    experts, e, proj = module.get_submodule(m["module"]), int(m["e"]), m["proj"]
    if proj == "down_proj":
        return experts.down_proj[e], f"{m['module']}.down_proj"
    half = experts.gate_up_proj.shape[1] // 2
    rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
    return experts.gate_up_proj[e, rows], f"{m['module']}.gate_up_proj"


def _dequantize_into(dest: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block, name: str, path: str) -> None:
    """`dest.copy_(dequantize_fp8_block(w, scale, block))` a few row blocks at a time, so that the fp32
    temporaries (three fp32 chunks of ~4M elements) stay small next to the layer (the same arithmetic: fp32 product, then one cast)."""
    want = expected_scale_shape(w.shape, block)
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{name + _SCALE_INV!r} of {path} has shape {list(scale.shape)}, but {name!r} of shape "
                              f"{list(w.shape)} with {block[0]}x{block[1]} blocks needs {list(want)}: check "
                              "weight_block_size in config.json")
    try:  # the chunks below cast with float(): raw uint8 exponents would pass as 127.0, NaN/Inf as NaN weights
        check_scale_inv(scale)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{name + _SCALE_INV!r} of {path} cannot dequantize {name!r}: {e}") from None
    if w.dim() != 2:
        dest.copy_(dequantize_fp8_block(w, scale, block, dtype=dest.dtype))
        return
    bm, bn = block
    m, n = w.shape
    step = max(1, (1 << 22) // max(1, n * bm)) * bm  # rows per chunk: a multiple of the block, ~4M elements
    for r in range(0, m, step):
        part = w[r:r + step].float()
        s = scale[r // bm:(r + step) // bm].float().repeat_interleave(bm, dim=0)[:part.shape[0]]
        dest[r:r + step].copy_(part.mul_(s.repeat_interleave(bn, dim=1)[:, :n]))


def _persistent(module: nn.Module):
    """(name, tensor) of the parameters and persistent buffers; refuses non-persistent buffers, which checkpoints
    do not hold and `materialize` leaves uninitialized."""
    out = list(module.named_parameters())
    for mod_name, sub in module.named_modules():
        for b_name, b in sub._buffers.items():
            full = f"{mod_name}.{b_name}" if mod_name else b_name
            if b is None:
                continue
            if b_name in sub._non_persistent_buffers_set:
                raise NotImplementedError(f"{type(module).__name__} has the non-persistent buffer {full}, which no "
                                          "checkpoint holds; streaming this architecture layer by layer is not "
                                          "supported")
            out.append((full, b))
    return out


@torch.no_grad()
def load_into(module: nn.Module, prefix: str, host: dict[str, torch.Tensor], *, model_type: str | None,
              model_path: str, fp8_block=(128, 128)) -> None:
    """Copies the checkpoint tensors `host` (checkpoint names, all starting with `prefix` once renamed to
    transformers' in-memory names) into `module`, materialized by `materialize`; float8 weights are dequantized
    with their `*_scale_inv` on the module's device. Every materialized parameter and buffer must be filled;
    tensors whose destination is still on the meta device (skipped by `materialize`) are passed over."""
    filled: dict[str, int] = {}
    for ck_name, t in host.items():
        if ck_name.endswith(_SCALE_INV) and is_fp8_dtype(host.get(ck_name[: -len(_SCALE_INV)], t).dtype):
            continue  # applied to its weight below
        name = from_checkpoint_name(ck_name, model_type)[len(prefix):]
        try:
            dest, pname = _destination(module, name)
        except (KeyError, AttributeError):
            raise CheckpointError(f"checkpoint tensor {ck_name!r} of {model_path} has no place in "
                                  f"{type(module).__name__} {prefix.rstrip('.')}: the checkpoint does not belong to "
                                  "this config.json, or its naming is not one torchforge knows") from None
        if dest.device.type == "meta":
            continue  # skipped by materialize
        if tuple(dest.shape) != tuple(t.shape):
            raise CheckpointError(f"checkpoint tensor {ck_name!r} of {model_path} has shape {list(t.shape)}, but "
                                  f"{prefix}{name} needs {list(dest.shape)}: config.json and the weights disagree")
        if is_fp8_dtype(t.dtype):
            scale = host.get(ck_name + _SCALE_INV)
            if scale is None:
                raise CheckpointError(f"float8 tensor {ck_name!r} of {model_path} has no {ck_name + _SCALE_INV!r}: "
                                      "only DeepSeek-style block-FP8 checkpoints (weight_scale_inv) can be read")
            _dequantize_into(dest, t.to(dest.device, non_blocking=True), scale.to(dest.device, non_blocking=True),
                             fp8_block, ck_name, model_path)
        else:
            dest.copy_(t, non_blocking=True)
        filled[pname] = filled.get(pname, 0) + t.numel()
    missing = [n for n, p in _persistent(module) if p.device.type != "meta" and filled.get(n, 0) != p.numel()]
    if missing:
        raise CheckpointError(f"{model_path} lacks tensors for {prefix}{missing[0]}"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: the checkpoint is "
                              "incomplete or does not belong to this config.json")
