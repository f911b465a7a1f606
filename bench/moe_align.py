"""The MoE row sort (`moe_align`) three ways: the one-program Triton kernel, the chunked Triton kernels (three
launches, chunks of `--chunks` rows) and the torch ops (`moe_align_ref`), at the row counts of decode batches and
prefills (tokens x 9 routed rows: top-8 + the shared expert) over 65 experts (the end-to-end model: 64 + shared) and
257 (DeepSeek-V3).

Each cell: GPU microseconds from a CUDA graph (what a compiled decode step pays), and host microseconds per eager
call back to back (what an eager prefill pays, when it exceeds the GPU time). The kernels launch as they do inside
torchforge's ops: a triton_op's eager body launches directly, not through torch's triton HOP (`wrap_triton`), which
costs far more host time outside an op (torch's note: ~1 ms; the first run of this script, 300-600 us a call). `same`: every kernel's result equals
the torch ops' bit for bit. `dispatched`: what `torchforge.ops.moe_align.moe_align` runs for that row count.

    python3 bench/moe_align.py [--tokens 1,16,57,128,512,1820,7282] [--chunks 64,128,256,512] [--calls 500]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_line, direct_triton_launches, markdown_table  # noqa: E402
from op_host_overhead import graph_us, per_call_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,16,57,128,512,1820,7282")
    ap.add_argument("--experts", default="65,257")
    ap.add_argument("--chunks", default="64,128,256,512", help="rows per program of the chunked kernels")
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/moe_align.py: needs a CUDA device")
        return 0
    from torchforge.ops import moe_align as dispatch
    from torchforge.ops.awq_mma_cuda import moe_sorted_block_rows
    from torchforge.ops.moe_align_triton import launch_moe_align_chunked, launch_moe_align_triton

    direct = direct_triton_launches()  # kept referenced until the end
    print(f"eager launches: {'direct, as inside an op' if direct else 'through wrap_triton (HOP)'}")
    chunks = [int(c) for c in args.chunks.split(",")]
    rows_out = []
    for experts in (int(e) for e in args.experts.split(",")):
        for tokens in (int(t) for t in args.tokens.split(",")):
            ids = torch.randint(0, experts, (tokens, 9), device="cuda", dtype=torch.int64)
            R = ids.numel()
            bm = moe_sorted_block_rows(R, experts)
            ways = {"one program": lambda: launch_moe_align_triton(ids, experts, bm),
                    **{f"chunks of {c}": (lambda c=c: launch_moe_align_chunked(ids, experts, bm, c)) for c in chunks},
                    "torch ops": lambda: dispatch.moe_align_ref(ids, experts, bm)}
            ref = ways["torch ops"]()
            same = all(all(torch.equal(a, b) for a, b in zip(fn(), ref)) for fn in ways.values())
            cells = [f"{graph_us(fn):.1f} / {per_call_us(fn, args.calls):.1f}" for fn in ways.values()]
            if R <= dispatch.MOE_ALIGN_TRITON_MAX_ROWS:
                which = "one program"
            else:
                which = f"chunks of {dispatch.moe_align_chunk_rows(R)}"
            rows_out.append([R, experts, bm, *cells, which, "yes" if same else "NO"])
            print(f"rows {R}, experts {experts}: done", flush=True)
    print(f"\n{device_line()}\n\nGPU us (CUDA graph) / host us per eager call:\n")
    print(markdown_table(["rows", "experts", "block rows", "one program", *[f"chunks of {c}" for c in chunks],
                          "torch ops", "dispatched", "same"], rows_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
