"""Shared timing helpers for the bench/ scripts (CUDA only)."""
from __future__ import annotations

import torch


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median milliseconds of `fn()` timed with CUDA events, launched eagerly (includes launch overhead
    when the GPU work is shorter than the host's)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


class L2Rotation:
    """Weights cycled through copies between the calls that `bench_graph_ms` times, while the rotation is active.

    A graph of back-to-back calls on one weight that fits the L2 cache (50 MB on the H100: 7168x7168 in int4 is 27 MB)
    measures the cache, not the DRAM reads a model makes (each layer's weights are read once per step). So the
    registered tensors are swapped in place (`Tensor.set_`, outside the graph: each captured launch keeps the copy it
    was captured with) through enough copies that a copy comes back only after twice the L2 size of other reads.
    Activations are not rotated: a model's come hot from the previous op.

        with L2Rotation(working_set_bytes) as rot:
            rot.add(qweight, scales, ...)   # every tensor the timed functions read as weights
            t = bench_graph_ms(fn)
    """
    active: "L2Rotation | None" = None

    def __init__(self, working_set_bytes: int):
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        ws = max(1, int(working_set_bytes))
        self.copies = 1 if ws >= 2 * l2 else 1 + -(-2 * l2 // ws)  # (copies - 1) * ws >= 2 * l2
        self.entries: list = []
        self.index = 0

    def add(self, *tensors: torch.Tensor) -> None:
        if self.copies > 1:
            self.entries += [(t, [t.detach()] + [t.detach().clone() for _ in range(self.copies - 1)]) for t in tensors]

    def drop(self, *tensors: torch.Tensor) -> None:
        """Stop rotating these (restored to their own storage), freeing their copies."""
        for t in tensors:
            for i, (u, views) in enumerate(self.entries):
                if u is t:
                    t.set_(views[0])
                    del self.entries[i]
                    break

    def advance(self) -> None:
        self.index = (self.index + 1) % self.copies
        for t, views in self.entries:
            t.set_(views[self.index])

    def restore(self) -> None:
        self.index = self.copies - 1
        self.advance()

    @staticmethod
    def start(working_set_bytes: int, *tensors: torch.Tensor) -> "L2Rotation":
        """Ends the active rotation, if any, and activates one over `tensors` (a bench's next weight)."""
        L2Rotation.stop()
        rot = L2Rotation(working_set_bytes).__enter__()
        rot.add(*tensors)
        return rot

    @staticmethod
    def stop() -> None:
        if L2Rotation.active is not None:
            L2Rotation.active.__exit__()

    def __enter__(self) -> "L2Rotation":
        L2Rotation.active = self
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
        self.entries.clear()
        L2Rotation.active = None


def bench_graph_ms(fn, rep_ms: int = 200) -> float:
    """Median milliseconds of `fn()` replayed from a CUDA graph: the GPU time without host launch gaps. Within an
    `L2Rotation`, consecutive calls read different copies of the registered weights."""
    from triton.testing import do_bench_cudagraph

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    rot = L2Rotation.active
    if rot is None or not rot.entries:
        return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))

    def rotating():
        rot.advance()
        return fn()

    try:
        return float(do_bench_cudagraph(rotating, rep=rep_ms, return_mode="median"))
    finally:
        rot.restore()


def copy_bandwidth_gbs(nbytes: int) -> float:
    """Measured device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def markdown_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def device_line() -> str:
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, CUDA {torch.version.cuda}"


def deepseek_v3_hf_experts(num_experts: int, hidden: int = 7168, intermediate: int = 2048, top_k: int = 8,
                           copies: int = 1):
    """`copies` transformers DeepseekV3Experts modules in bf16 on CUDA with N(0, 0.02) weights, using HF's fastest
    experts path (`grouped_mm`, or the default where this transformers lacks it). Returns (modules, impl)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    cfg = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=intermediate, n_routed_experts=num_experts,
                           num_experts_per_tok=top_k)
    impl = "grouped_mm"
    try:
        cfg._experts_implementation = impl
    except Exception:  # noqa: BLE001
        impl = "default"
    torch.set_default_dtype(torch.bfloat16)  # build the bf16 experts directly, not via fp32 (2x the memory)
    try:
        with torch.device("cuda"):
            mods = [DeepseekV3Experts(cfg) for _ in range(copies)]
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        mods[0].gate_up_proj.normal_(0, 0.02)
        mods[0].down_proj.normal_(0, 0.02)
    return mods, impl


def quantize_experts_chunked(make, hf, chunk: int = 16):
    """Quantize `hf`'s fused experts `chunk` experts at a time (bounds the quantizers' temporaries; the
    formats are per expert, so the result is the same as one call). `make(n)` builds an empty experts
    module of n experts with `pack_weights(gate_up, down)`; every buffer has the expert dim first."""
    E = hf.gate_up_proj.shape[0]
    out = make(E)
    with torch.no_grad():
        parts = [make(min(chunk, E - i)).pack_weights(hf.gate_up_proj[i:i + chunk], hf.down_proj[i:i + chunk])
                 for i in range(0, E, chunk)]
        for name, _ in list(out.named_buffers()):
            setattr(out, name, torch.cat([p.get_buffer(name) for p in parts]))
    return out


def direct_triton_launches():
    """Make eager Triton launches go straight to the kernel, as they do inside a torchforge op (a triton_op's eager
    body turns torch's `wrap_triton` HOP off), rather than through the HOP, which costs hundreds of microseconds of
    host time per launch. Returns the context (keep it referenced: closing it restores the HOP), or None on a torch
    without the switch."""
    from torch._library import triton as torch_triton

    switch = getattr(torch_triton, "set_wrap_triton_enabled", None)
    if switch is None:
        return None
    ctx = switch(False)
    ctx.__enter__()
    return ctx
