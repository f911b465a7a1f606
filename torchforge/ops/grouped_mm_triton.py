"""Grouped GEMM in fp32 over rows sorted by expert: out[r] = rows[r] @ weight[e] for the rows of expert e, which lie in
rows[offs[e - 1]:offs[e]]. What `torch._grouped_mm` does for bf16 on Hopper, for the fp32 that the quantized MoE
backward (ops/moe_autograd.py) computes in for fp16 and fp32 activations: PyTorch's own grouped GEMM takes those dtypes
through a fallback that copies the offsets to the host and runs one mm per expert. Here the row tiles are found on the
device (each expert's rows in tiles of BM, the tile starts a prefix sum over the experts), so there is no host sync and
no loop over experts; products in IEEE fp32 (not TF32), accumulated in fp32.
"""
import torch
from torch import Tensor

from torchforge.ops._triton import HAS_TRITON, tl, triton

__all__ = ["launch_grouped_rows_mm"]

if HAS_TRITON:

    @triton.jit
    def _grouped_rows_mm_kernel(a_ptr, w_ptr, offs_ptr, tile_start_ptr, out_ptr, E, A, B,
                                stride_ar, stride_aa, stride_we, stride_wa, stride_wb, stride_or,
                                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m >= tl.load(tile_start_ptr + E):  # the grid holds cdiv(R, BM) + E tiles: an upper bound
            return
        # the expert of this tile: the largest e with tile_start[e] <= pid_m (experts without rows have no tiles)
        lo = 0
        hi = E
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tl.load(tile_start_ptr + mid) <= pid_m:
                lo = mid
            else:
                hi = mid
        e = lo
        row_end = tl.load(offs_ptr + e)
        row_begin = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        rows = row_begin + (pid_m - tl.load(tile_start_ptr + e)) * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        mask_r = rows < row_end
        mask_c = cols < B
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        for k0 in range(0, A, BK):
            ks = k0 + tl.arange(0, BK)
            mask_k = ks < A
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_ar + ks[None, :] * stride_aa,
                        mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_base + ks.to(tl.int64)[:, None] * stride_wa + cols[None, :] * stride_wb,
                        mask=mask_k[:, None] & mask_c[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :], acc,
                 mask=mask_r[:, None] & mask_c[None, :])


def launch_grouped_rows_mm(rows: Tensor, weight: Tensor, offs: Tensor, block_m: int = 64,
                           precision: str = "ieee") -> Tensor:
    """rows fp32 [R, A] sorted by expert, weight fp32 [E, A, B] (any strides), offs int32 [E] (the end of each expert's
    rows, offs[E - 1] == R) -> fp32 [R, B]."""
    if not HAS_TRITON:
        raise RuntimeError("torchforge grouped GEMM kernel needs triton")
    r, a = rows.shape
    e, _, b = weight.shape
    out = torch.empty((r, b), dtype=torch.float32, device=rows.device)
    if r == 0 or b == 0:
        return out
    offs = offs.to(torch.int32)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    tile_start = torch.cat([offs.new_zeros(1), torch.cumsum(-(-counts // block_m), 0, dtype=torch.int32)])
    bn, bk = 64, 32
    grid = (-(-r // block_m) + e, triton.cdiv(b, bn))
    torch.library.wrap_triton(_grouped_rows_mm_kernel)[grid](
        rows, weight, offs, tile_start, out, e, a, b, rows.stride(0), rows.stride(1), weight.stride(0),
        weight.stride(1), weight.stride(2), out.stride(0), BM=block_m, BN=bn, BK=bk, PRECISION=precision,
        num_warps=4)
    return out
