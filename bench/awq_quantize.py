"""Benchmark of the fused AWQ quantize+pack kernel (torch.ops.torchforge.awq_quantize_cuda).

For each shape: the minimum bytes the op must move (weight read + qweight/scales/qzeros written),
a device-to-device copy of the same byte count measured in the same run (its time is the floor),
the kernel's median time, achieved GB/s and % of copy bandwidth, and a naive PyTorch pipeline
(quantize, permute, pack as separate passes) as a second baseline.

    python bench/awq_quantize.py [--fp16] [--group-size 128] [--no-naive]

Exits 0 with a message when no CUDA device / extension is available.
"""
import argparse
import sys

import torch

SHAPES = [(18432, 7168), (7168, 16384), (256, 2048, 7168)]
_NIBBLE_OF_COL = [0, 4, 1, 5, 2, 6, 3, 7]  # packing order [0, 2, 4, 6, 1, 3, 5, 7]


def _bench(fn, warmup_ms=100, rep_ms=500):
    """Median time in ms (triton.testing.do_bench when available, CUDA events otherwise)."""
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    except ImportError:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        return times[len(times) // 2]


def op_bytes(shape, dtype, group_size):
    *lead, oc, ic = shape
    e = 1
    for d in lead:
        e *= d
    elem = torch.empty((), dtype=dtype).element_size()
    w = e * oc * ic * elem
    qweight = e * ic * (oc // 8) * 4
    scales = e * (ic // group_size) * oc * 2
    qzeros = e * (ic // group_size) * (oc // 8) * 4
    return w + qweight + scales + qzeros


def naive_awq(w: torch.Tensor, group_size: int, symmetric: bool):
    """The unfused pipeline: quantize in fp32, permute to [IC, OC], pack with shifts."""
    *lead, oc, ic = w.shape
    x = w.float().reshape(*lead, oc, ic // group_size, group_size)
    if symmetric:
        amax = x.abs().amax(dim=-1, keepdim=True)
        s = torch.where(amax == 0, torch.ones_like(amax), amax / 7)
        s16 = s.half()
        sf = s16.float()
        q = torch.clamp(torch.round(x / sf), -8, 7) + 8
        z = torch.full_like(sf, 8.0)
    else:
        mx = x.amax(dim=-1, keepdim=True)
        mn = x.amin(dim=-1, keepdim=True)
        s16 = (torch.clamp(mx - mn, min=1e-5) / 15).half()
        sf = s16.float()
        z = torch.clamp(torch.round(-mn / sf), 0, 15)
        q = torch.clamp(torch.round(x / sf) + z, 0, 15)
    q = q.to(torch.int32).reshape(*lead, oc, ic).transpose(-1, -2).contiguous()  # [.., IC, OC]

    def pack(t):
        t = t.reshape(*t.shape[:-1], t.shape[-1] // 8, 8)
        out = torch.zeros(t.shape[:-1], dtype=torch.int32, device=t.device)
        for j in range(8):
            out |= t[..., j] << (4 * _NIBBLE_OF_COL[j])
        return out

    qweight = pack(q)
    scales = s16.squeeze(-1).transpose(-1, -2).contiguous()
    qzeros = pack(z.squeeze(-1).to(torch.int32).transpose(-1, -2).contiguous())
    return qweight, scales, qzeros


def naive_chunked(w, group_size, symmetric, max_elems=1 << 29):
    """The naive pipeline needs ~12 bytes of fp32/int32 temporaries per weight element: run the
    batched MoE shape a slice of experts at a time (same passes, same total traffic)."""
    if w.dim() == 2 or w.numel() <= max_elems:
        return naive_awq(w, group_size, symmetric)
    per = max(1, max_elems // (w.shape[1] * w.shape[2]))
    outs = [naive_awq(w[i : i + per], group_size, symmetric) for i in range(0, w.shape[0], per)]
    return tuple(torch.cat(parts) for parts in zip(*outs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp16", action="store_true", help="also run float16 weights")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--no-naive", action="store_true", help="skip the naive PyTorch baseline")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("awq_quantize bench: no CUDA device, nothing to measure")
        return 0
    sys.path.insert(0, ".")
    from torchforge.ops._ext import has_cuda_ext

    if not has_cuda_ext():
        print("awq_quantize bench: torchforge._C not built (pip install -e . on a CUDA machine)")
        return 0

    G = args.group_size
    dtypes = [torch.bfloat16] + ([torch.float16] if args.fp16 else [])
    dev = torch.cuda.get_device_properties(0)
    print(f"device: {dev.name}, {dev.multi_processor_count} SMs, L2 {dev.L2_cache_size / 2**20:.0f} MiB")
    rows = []
    for dtype in dtypes:
        for shape in SHAPES:
            nbytes = op_bytes(shape, dtype, G)
            # inputs are >= 260 MB, far over the 50 MB L2: no rotation needed
            g = torch.Generator(device="cuda").manual_seed(0)
            w = (torch.randn(shape, device="cuda", generator=g, dtype=torch.float32) * 0.02).to(dtype)
            half = nbytes // 2  # a copy of half the bytes reads + writes `nbytes`
            src = torch.empty(half, dtype=torch.uint8, device="cuda").random_(0, 255)
            dst = torch.empty_like(src)
            t_copy = _bench(lambda dst=dst, src=src: dst.copy_(src))
            del src, dst
            copy_bw = 2 * half / (t_copy * 1e-3)
            for sym in (True, False):
                fn = lambda w=w, sym=sym: torch.ops.torchforge.awq_quantize_cuda(w, G, sym)  # noqa: E731
                t = _bench(fn)
                t_naive, same = float("nan"), ""
                if not args.no_naive:
                    try:
                        out = fn()
                        ref = naive_chunked(w, G, sym)
                        same = "yes" if all(torch.equal(a, b) for a, b in zip(out, ref)) else "NO"
                        del out, ref
                        t_naive = _bench(lambda w=w, sym=sym: naive_chunked(w, G, sym), warmup_ms=50, rep_ms=300)
                    except torch.OutOfMemoryError:
                        same = "oom"
                    torch.cuda.empty_cache()
                rows.append(
                    dict(
                        shape="x".join(map(str, shape)),
                        dtype=str(dtype).split(".")[-1],
                        mode="sym" if sym else "asym",
                        bytes=nbytes,
                        copy_bw=copy_bw,
                        floor_us=t_copy * 1e3,
                        t_us=t * 1e3,
                        gbs=nbytes / (t * 1e-3) / 1e9,
                        pct=100 * t_copy / t,
                        naive_us=t_naive * 1e3,
                        speedup=t_naive / t,
                        same=same,
                    )
                )
                r = rows[-1]
                print(
                    f"{r['shape']:>16} {r['dtype']:>8} {r['mode']:>4}: {r['t_us']:8.1f} us "
                    f"{r['gbs']:7.0f} GB/s ({r['pct']:.0f}% of copy {r['copy_bw'] / 1e9:.0f} GB/s); "
                    f"naive {r['naive_us']:.0f} us",
                    flush=True,
                )
            del w, fn  # fn holds w as a default argument
            torch.cuda.empty_cache()

    print()
    print(f"group_size={G}; bytes = weight read + qweight + scales + qzeros written; floor = a "
          f"device-to-device copy moving the same bytes (read + write), measured in this run")
    print()
    print("| shape | dtype | mode | bytes (MB) | copy GB/s | floor us | kernel us | GB/s | % of copy "
          "| naive us | speedup | naive == kernel |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['dtype']} | {r['mode']} | {r['bytes'] / 1e6:.1f} | "
            f"{r['copy_bw'] / 1e9:.0f} | {r['floor_us']:.1f} | {r['t_us']:.1f} | {r['gbs']:.0f} | "
            f"{r['pct']:.0f}% | {r['naive_us']:.0f} | {r['speedup']:.1f}x | {r['same']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
