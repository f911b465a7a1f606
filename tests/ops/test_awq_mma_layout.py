"""The mma layout (torchforge.ops.awq_mma_layout) and the awq_mma_linear op on CPU: exact round trips, the word
contract of csrc/awq_mma.cu checked element by element, and an emulation of the kernel's MMA fragments."""
import pytest
import torch

from torchforge.ops import awq_pack, awq_quantize, awq_unpack, w4a16_linear
from torchforge.ops._triton import can_launch
from torchforge.ops.awq_mma import awq_mma_linear
from torchforge.ops.awq_mma_layout import awq_to_mma_layout, mma_layout_to_awq


def _codes(ic, oc, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (ic, oc), generator=g, dtype=torch.uint8)  # [IC, OC] as awq_pack takes them


@pytest.mark.parametrize("ic,oc", [(64, 64), (128, 192), (448, 128)])
def test_round_trip_is_exact(ic, oc):
    qw = awq_pack(_codes(ic, oc, seed=ic + oc))
    mma = awq_to_mma_layout(qw)
    assert mma.dtype == torch.int32 and mma.shape == (oc // 64, ic * 8)
    assert torch.equal(mma_layout_to_awq(mma), qw)
    words = torch.randint(-2**31, 2**31, (oc // 64, ic * 8), dtype=torch.int64).to(torch.int32)  # sign bits too
    assert torch.equal(awq_to_mma_layout(mma_layout_to_awq(words)), words)


def test_word_contract_of_the_kernel():
    """Nibble p of the word (block cb, chunk c, step s, lane 4g + t, tile T) is the code of column
    64 cb + 16 T + g + 8 (p & 1) at row 64 c + 16 t + 4 s + 2 ((p >> 1) & 1) + (p >> 2), as csrc/awq_mma.cu reads it."""
    ic, oc = 192, 128
    codes = _codes(ic, oc, seed=3)
    mma = awq_to_mma_layout(awq_pack(codes))
    g = torch.Generator().manual_seed(4)
    for _ in range(200):
        cb, c, s, lane, tile, p = (int(torch.randint(0, n, (1,), generator=g)) for n in (oc // 64, ic // 64, 4, 32, 4, 8))
        word = int(mma[cb, ((c * 4 + s) * 32 + lane) * 4 + tile]) & 0xFFFFFFFF
        col = 64 * cb + 16 * tile + lane // 4 + 8 * (p & 1)
        row = 64 * c + 16 * (lane % 4) + 4 * s + 2 * ((p >> 1) & 1) + (p >> 2)
        assert (word >> (4 * p)) & 0xF == int(codes[row, col])


def _emulate_kernel_dot(mma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_k x[m, k] q[k, n] the way the kernel computes it: A fragments decoded from the words as registers
    (r: nibbles r, r + 4), B fragments from x with the kernel's k mapping, per PTX's m16n8k16 fragment layout."""
    oc, ic = mma.shape[0] * 64, mma.shape[1] // 8
    words = mma.reshape(oc // 64, ic // 64, 4, 32, 4).to(torch.int64) & 0xFFFFFFFF  # [cb, c, s, lane, T]
    nib = torch.stack([(words >> (4 * p)) & 0xF for p in range(8)], -1)             # [..., p]
    lane = torch.arange(32)
    gq, tq = lane // 4, lane % 4
    A = torch.zeros(oc // 64, ic // 64, 4, 4, 16, 16, dtype=torch.int64)          # [cb, c, s, T, row, kk]
    for r, (row_off, kk_off) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):     # register r of the fragment
        for half in range(2):                                                     # low / high 16 bits
            A[:, :, :, :, gq + row_off, 2 * tq + kk_off + half] = nib[:, :, :, :, :, r + 4 * half].permute(0, 1, 2, 4, 3)
    m = x.shape[0]
    total = torch.zeros(m, oc, dtype=torch.float64)
    for c in range(ic // 64):
        for s in range(4):
            kk = torch.arange(16)
            t, hi, second = (kk % 8) // 2, kk % 2, kk // 8
            rows = 64 * c + 16 * t + 4 * s + 2 * second + hi          # the kernel's k for MMA k-index kk
            B = x[:, rows].double().T                                 # [kk, m]
            C = torch.einsum("btrk,km->btrm", A[:, c, s].double(), B)  # [cb, T, 16 rows, m]
            total += C.permute(3, 0, 1, 2).reshape(m, oc)
    return total


def test_fragment_emulation_matches_the_plain_dot():
    ic, oc = 128, 128
    codes = _codes(ic, oc, seed=5)
    x = torch.randn(5, ic, dtype=torch.float64)
    got = _emulate_kernel_dot(awq_to_mma_layout(awq_pack(codes)), x)
    torch.testing.assert_close(got, x @ codes.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_cpu_equals_the_awq_op(dtype):
    torch.manual_seed(0)
    qw, s, z = awq_quantize(torch.randn(128, 256), 64, symmetric=False)
    x = torch.randn(2, 3, 256).to(dtype)
    b = torch.randn(128).to(dtype)
    out = awq_mma_linear(x, awq_to_mma_layout(qw), s, z, 64, b)
    assert out.shape == (2, 3, 128)
    assert torch.equal(out, w4a16_linear(x, qw, s, z, 64, b))
    torch.library.opcheck(torch.ops.torchforge.awq_mma_linear, (x, awq_to_mma_layout(qw), s, z, 64, b))


def test_linear_with_act_perm_reads_x_in_that_order():
    """act_perm: the op computes x[..., perm] @ W.T (bit for bit on CPU), opcheck passes, and the input gradient goes
    back through the permutation (against autograd through the explicit gather)."""
    torch.manual_seed(1)
    qw, s, z = awq_quantize(torch.randn(128, 256), 64, symmetric=False)
    mma = awq_to_mma_layout(qw)
    perm = torch.randperm(256).to(torch.int32)
    x = torch.randn(2, 3, 256, requires_grad=True)
    b = torch.randn(128)
    out = awq_mma_linear(x, mma, s, z, 64, b, act_perm=perm)
    assert torch.equal(out, awq_mma_linear(x.index_select(-1, perm), mma, s, z, 64, b))
    torch.library.opcheck(torch.ops.torchforge.awq_mma_linear, (x.detach(), mma, s, z, 64, b, None, perm))
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, g)
    w = w4a16_linear  # the same weight through the AWQ op, gathered x: autograd of index_select scatters back
    (expected,) = torch.autograd.grad(w(x.index_select(-1, perm), qw, s, z, 64, b), x, g)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="act_perm must be int32"):
        awq_mma_linear(x, mma, s, z, 64, b, act_perm=perm.long())
    with pytest.raises(ValueError, match=r"act_perm must be \[IC\] = \[256\] on cpu, got \(128,\)"):
        awq_mma_linear(x, mma, s, z, 64, b, act_perm=perm[:128])
    with pytest.raises(ValueError, match=r"act_perm has 1 values outside \[0, 256\); it must be a permutation"):
        awq_mma_linear(x, mma, s, z, 64, b, act_perm=torch.where(perm == 0, 256, perm).to(torch.int32))


def test_errors_name_the_tensor():
    qw, s, z = awq_quantize(torch.randn(96, 128), 64)
    with pytest.raises(ValueError, match="OC and IC to be multiples of 64.*OC=96"):
        awq_to_mma_layout(qw)
    with pytest.raises(ValueError, match="qweight must be an int32 AWQ tensor"):
        awq_to_mma_layout(qw.float())
    qw, s, z = awq_quantize(torch.randn(128, 128), 64)
    mma = awq_to_mma_layout(qw)
    with pytest.raises(ValueError, match=r"qweight_mma \(2, 1024\) is not \[OC / 64, IC \* 8\] for x with IC = 64"):
        awq_mma_linear(torch.randn(1, 64), mma, s, z, 64)
    with pytest.raises(ValueError, match="awq_mma_linear: scales has shape"):
        awq_mma_linear(torch.randn(1, 128), mma, s[:1], z, 64)
    assert torch.equal(awq_unpack(mma_layout_to_awq(mma)), awq_unpack(qw))


@pytest.mark.skipif(not can_launch(torch.empty(0)), reason="needs triton (CUDA, or the interpreter on CPU)")
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dequantize_kernel_equals_the_awq_one(G, dtype):
    """The Triton dequantization of the mma layout (awq_mma_linear's large-M path) writes every element the AWQ
    kernel writes, bit for bit, and within one rounding of the fp32 reference."""
    from torchforge.ops.awq_dequant_triton import launch_awq_dequantize_t
    from torchforge.ops.awq_mma_dequant_triton import launch_awq_mma_dequantize_t
    from torchforge.ops.awq_reference import awq_dequantize_ref

    torch.manual_seed(G)
    qw, s, z = awq_quantize(torch.randn(128, 256), G, symmetric=False)
    out = launch_awq_mma_dequantize_t(awq_to_mma_layout(qw), s, z, G, dtype)
    assert out.shape == (256, 128) and out.dtype == dtype
    assert torch.equal(out, launch_awq_dequantize_t(qw, s, z, G, dtype))
    ref = awq_dequantize_ref(qw, s.float(), z, G).t()
    torch.testing.assert_close(out.float(), ref, rtol=1e-3, atol=0)
    perm = torch.randperm(256).to(torch.int32)  # an act-order layer: stored row i is feature perm[i]
    permuted = launch_awq_mma_dequantize_t(awq_to_mma_layout(qw), s, z, G, dtype, perm)
    assert torch.equal(permuted[perm.long()], out)


def test_cuda_config_follows_the_sweep():
    """mma_cuda_config's choices on the swept shapes (pure function, no GPU needed)."""
    from torchforge.ops.awq_mma_cuda import mma_cuda_config

    assert mma_cuda_config(1, 7168, 18432, 128) == (1, 2)   # 288 tiles
    assert mma_cuda_config(64, 7168, 7168, 128) == (1, 2)   # 4 row blocks x 112
    assert mma_cuda_config(16, 4096, 1536, 128) == (4, 2)   # 24 tiles: 4 K slices
    assert mma_cuda_config(1, 4096, 576, 64) == (4, 1)      # groups of 64: items of one chunk
    assert mma_cuda_config(1, 4096, 576, 32) == (4, 1)      # groups of 32 too (the kernel takes no other)
    assert mma_cuda_config(1, 128, 576, 128) == (1, 2)      # one item: one slice


def test_mma_cuda_warps_rule():
    """4-warp blocks only where a few 8-warp ones would be left for a second wave (132 SMs)."""
    from torchforge.ops.awq_mma_cuda import mma_cuda_warps

    assert mma_cuda_warps(288, 132) == 4   # 18432x7168 up to 16 rows
    assert mma_cuda_warps(264, 132) == 8   # 16896x7168: one full wave of 8-warp blocks
    assert mma_cuda_warps(336, 132) == 4   # 7168x7168 at 48 rows (a tie on the H100)
    assert mma_cuda_warps(448, 132) == 8   # 7168x7168 at 64 rows
    assert mma_cuda_warps(576, 132) == 8   # 18432x7168 at 32 rows
    assert mma_cuda_warps(112, 132) == 8   # 7168x7168


def test_mma_cuda_launch_config_rules():
    """(splits, item_chunks, warps, prefetch) on 132 SMs: the prefetching loop where the grid is at most one 8-warp
    block per SM walking the whole K, but 2 plain K slices at 9-16 rows there; 3 K slices up to 16 rows on a 4-warp grid
    (one row: only where that grid fits two rounds of blocks); both with at least 48 items."""
    from torchforge.ops.awq_mma_cuda import mma_cuda_launch_config, mma_cuda_prefetch

    assert mma_cuda_prefetch(112, 132, 8, 2, 1)       # 7168x7168 up to 16 rows
    assert not mma_cuda_prefetch(96, 132, 8, 2, 4)    # 1536x4096 in 4 K slices
    assert not mma_cuda_prefetch(112, 132, 8, 1, 1)   # groups of 64: items of one chunk
    assert not mma_cuda_prefetch(224, 132, 8, 2, 1)   # 7168x7168 at 32 rows
    assert not mma_cuda_prefetch(288, 132, 4, 2, 1)   # 18432x7168
    cfg = lambda m, k, n, g=128: mma_cuda_launch_config(m, k, n, g, 132)  # noqa: E731
    # 7168x7168: the prefetching loop up to 8 rows, 2 plain K slices at 9-16 (56 items)
    assert [cfg(m, 7168, 7168) for m in (1, 8, 9, 16, 17)] == [(1, 2, 8, True), (1, 2, 8, True), (2, 2, 8, False),
                                                               (2, 2, 8, False), (1, 2, 8, False)]
    assert cfg(16, 1536, 6144) == (1, 2, 8, True)
    assert cfg(1, 4096, 1536) == (4, 2, 8, False)
    assert cfg(1, 7168, 7168, 64) == (1, 1, 8, False)
    # 18432x7168: 288 tiles of 4-warp blocks up to 16 rows, in 3 K slices
    assert [cfg(m, 7168, 18432) for m in (1, 8, 9, 16, 17)] == [(3, 2, 4, False), (3, 2, 4, False), (3, 2, 4, False),
                                                               (3, 2, 4, False), (1, 2, 8, False)]
    # 24576x7168: 384 tiles, 3 slices would take a third round of 4-warp blocks; one row takes 1 slice (the rest were
    # not swept)
    assert [cfg(m, 7168, 24576) for m in (1, 2, 16)] == [(1, 2, 4, False), (3, 2, 4, False), (3, 2, 4, False)]
    assert cfg(1, 7168, 22528) == (3, 2, 4, False)     # 352 tiles: exactly two rounds
    assert cfg(16, 4096, 18432) == (1, 2, 4, False)    # 32 items: too few for slices
    assert cfg(16, 7168, 16384) == (1, 2, 8, False)    # 256 tiles: a grid of 8-warp blocks
    # groups of 32: 8-warp blocks, the fewest K slices that fill 0.8 of the last wave of them (2 per SM)
    assert cfg(1, 7168, 18432, 32) == (3, 1, 8, False)  # 288 tiles: 1.09, 2.18, 3.27 waves
    assert cfg(16, 7168, 7168, 32) == (2, 1, 8, False)  # 112 tiles: 0.42, 0.85 waves
    assert cfg(1, 2048, 512, 32) == (4, 1, 8, False)    # 8 tiles: never 0.8 of a wave, the fullest of 1-4 slices
    assert cfg(1, 64, 512, 32) == (1, 1, 8, False)      # one chunk: one slice
    assert cfg(64, 7168, 18432, 32) == (1, 1, 8, False)  # 1152 tiles: 4.36 waves


def test_wgmma_config_follows_the_sweep():
    """wgmma_cuda_config's choices (the time model of awq_wgmma_cost; its table is pinned in test_awq_wgmma_cost),
    and the dispatch range."""
    from torchforge.ops.awq_mma_cuda import (WGMMA_MAX_M, WGMMA_MIN_ROWS, wgmma_cuda_config, wgmma_cuda_ok,
                                             wgmma_rows_ok)

    assert (WGMMA_MIN_ROWS, WGMMA_MAX_M) == (32, 512)
    # every configuration WS; 72 tiles of (64, 2) at 64 rows: stream-K on one block per SM (splits 0); 7168x7168 at
    # 64 rows: every tile's 4 K slices as one cluster (stream-K would cut each tile in 4.7 parts)
    assert wgmma_cuda_config(64, 7168, 18432) == (64, 2, 0, 8, True, 0, False)
    assert wgmma_cuda_config(64, 7168, 7168) == (64, 2, 4, 8, True, 0, True)
    assert wgmma_cuda_config(128, 7168, 18432) == (128, 2, 0, 8, True, 0, False)
    # 7168x7168 at 256 rows: (256, 1) in 2 K slices, 0.056 ms against 0.080 whole (twenty-sixth session), as clusters
    # 0.051 (thirty-third)
    assert wgmma_cuda_config(256, 7168, 7168) == (256, 1, 2, 8, True, 0, True)
    # 288 blocks of (256, 1) at 512 rows: the 24 past two rounds of 132 in 4 K slices each
    assert wgmma_cuda_config(512, 7168, 18432) == (256, 1, 4, 8, True, 264, False)
    # the rows taken: within WGMMA_MIN_ROWS..WGMMA_MAX_M where the model has the kernel faster
    assert [wgmma_rows_ok(m, 7168, 18432) for m in (32, 48, 512, 513)] == [False, True, True, False]
    # 7168x7168 from 33 rows since the clusters (thirty-third session, ms): 0.026 at 48 rows against the decode
    # kernel's 0.033 (whose time steps up past 32 rows, 0.021 there), 0.033 at 72 against its 0.048
    assert ([wgmma_rows_ok(m, 7168, 7168) for m in (32, 33, 48, 64, 72, 128, 129, 384, 512)]
            == [False, True, True, True, True, True, True, True, True])
    # 4096x4096: (192, 1) in 4 K slices at 129-192 rows (twenty-sixth session: 0.027-0.028 ms against dequantize +
    # cuBLAS's 0.031-0.033), 2 K slices in one round of blocks at 321-512 (twenty-seventh session: 0.034 against 0.037
    # at 384 rows); 217-256 and 276-320 since the cuBLAS estimate's K walk (twenty-eighth: 0.033 against 0.035-0.036)
    assert ([wgmma_rows_ok(m, 4096, 4096) for m in (64, 129, 192, 256, 320, 384, 512)]
            == [False, True, True, True, True, True, True])
    # 3072x7168 (twenty-eighth session): the kernel at 193-256 rows, 0.039-0.040 ms against cuBLAS's 0.050-0.052,
    # which the estimate without the K walk had sent them to
    assert [wgmma_rows_ok(m, 7168, 3072) for m in (193, 256, 384)] == [True, True, True]
    assert not wgmma_rows_ok(31, 64, 1 << 20)  # below WGMMA_MIN_ROWS whatever the model says
    # the SM count enters: on 288 SMs, the 288 blocks of (192, 1) no longer need 3 rounds on 18432 columns at 256 rows
    from torchforge.ops.awq_wgmma_cost import best_wgmma_shape
    assert best_wgmma_shape(256, 7168, 18432)[0] == (256, 1)
    assert best_wgmma_shape(256, 7168, 18432, sms=288)[0] == (192, 1)
    x = torch.randn(200, 64)
    qw, s, z = awq_quantize(torch.randn(64, 64), 64)
    assert not wgmma_cuda_ok(x, awq_to_mma_layout(qw), s, z, 64, None)  # CPU tensors: never


def test_dispatch_checks_are_trace_safe():
    """The kernels' dispatch checks run inside triton_op bodies, which torch.compile traces with functional / fake
    tensors: they must not need a data pointer (a data_ptr() alignment check broke compiling awq_mma_linear once)."""
    from torchforge.ops.awq_mma_cuda import _aligned16, mma_cuda_ok, wgmma_cuda_ok

    @torch.library.triton_op("torchforge_test::aligned16", mutates_args=())
    def probe(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ok = _aligned16(x, s) and not mma_cuda_ok(x, x, s, s, 128, None) and not wgmma_cuda_ok(x, x, s, s, 128, None)
        return x + 1 if ok else x - 1

    x = torch.zeros(8, 64)
    s = torch.zeros(64, dtype=torch.float16)
    torch.testing.assert_close(torch.compile(probe, fullgraph=True)(x, s), x + 1)
    assert not _aligned16(s[4:])  # 8 bytes in
