"""bench/decode_read_ceiling.py's read kernels (Triton, interpreted on CPU): each word read exactly once, the
decode-order read with rounds that run past a column block's last item and slices that get fewer rounds."""
import os
import sys

import pytest
import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import decode_read_ceiling as rc  # noqa: E402


def _wrapped(t):  # the kernels' int32 sums wrap
    return int(t.sum()) % 2**32


@pytest.mark.parametrize("n, block, iters", [(10_000, 1024, 2), (4096, 1024, 4), (1, 1024, 1)])
def test_streaming_read_reads_every_word_once(n, block, iters):
    grid = triton.cdiv(n, block * iters)
    out = torch.empty(grid, dtype=torch.int32)
    rc._read_kernel[(grid,)](torch.ones(n, dtype=torch.int32), out, n, BLOCK=block, ITERS=iters)
    assert int(out.sum()) == n
    src = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32)
    rc._read_kernel[(grid,)](src, out, n, BLOCK=block, ITERS=iters)
    assert _wrapped(out) == _wrapped(src)


@pytest.mark.parametrize("items, splits, warps", [(7, 3, 2), (12, 2, 2), (5, 1, 4)])
def test_decode_order_read_reads_every_word_once(items, splits, warps):
    n_cb, item = 3, 1024
    rounds = triton.cdiv(items, splits * warps)
    out = torch.empty(n_cb * splits, dtype=torch.int32)
    run = lambda src: rc._read_decode_order_kernel[(n_cb * splits,)](  # noqa: E731
        src, out, n_cb, items * item, items, SPLITS=splits, W=warps, ITEM=item, ROUNDS=rounds)
    run(torch.ones(n_cb, items * item, dtype=torch.int32))
    assert int(out.sum()) == n_cb * items * item
    src = torch.randint(-2**31, 2**31 - 1, (n_cb, items * item), dtype=torch.int32)
    run(src)
    assert _wrapped(out) == _wrapped(src)
