"""Shared timing helpers for the bench/ scripts (CUDA only)."""
from __future__ import annotations

import torch


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median milliseconds of `fn()` timed with CUDA events, launched eagerly (includes launch overhead
    when the GPU work is shorter than the host's)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def bench_graph_ms(fn, rep_ms: int = 200) -> float:
    """Median milliseconds of `fn()` replayed from a CUDA graph: the GPU time without host launch gaps."""
    from triton.testing import do_bench_cudagraph

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


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
