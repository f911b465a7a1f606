"""The grouped W4A16 GEMV (MoE decode path) under TRITON_INTERPRET=1 on CPU (or on CUDA), and awq_moe_gemm's dispatch.

Tolerances: the kernel never rounds the dequantized weight to the activation dtype (exact-scale fp32 sums), so
it is compared with an fp64 dequantization that does not round either, and the tolerance is the output cast's
rounding (like test_awq_gemv.py): fp32 1e-6 (fp32 accumulation order), fp16 1e-3, bf16 4e-3. The reference op
(awq_grouped_linear_ref) rounds the weight to x.dtype, i.e. it is itself ~2^-9 (bf16) off this oracle. Under the
interpreter the final fp32 -> bf16 cast truncates instead of rounding (numpy has no bf16), about twice the
error: 8e-3 there.
"""
import pytest
import torch

from torchforge.ops import awq_quantize, awq_unpack
from torchforge.ops._triton import can_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not can_launch(torch.empty(0, device=DEVICE)),
                                reason="needs triton (CUDA, or the interpreter on CPU)")
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3 if DEVICE == "cuda" else 8e-3}


def _weights(E, K, N, G, sym=False, seed=0):
    torch.manual_seed(seed)
    return tuple(t.to(DEVICE) for t in awq_quantize(torch.randn(E, N, K) * 3, G, symmetric=sym))


def _expected(x, ids, qw, s, z, G, div):
    """fp64, from unpacked nibbles, weight not rounded; NaN rows for ids outside [0, E)."""
    E = qw.shape[0]
    rows = []
    for r, e in enumerate(ids.tolist()):
        if not 0 <= e < E:
            rows.append(torch.full((s.shape[-1],), float("nan"), dtype=torch.float64))
            continue
        codes = awq_unpack(qw[e].cpu()).double()
        zeros = awq_unpack(z[e].cpu()).double().repeat_interleave(G, 0)
        w = (codes - zeros) * s[e].cpu().double().repeat_interleave(G, 0)  # [K, N]
        rows.append(x[r // div].cpu().double() @ w)
    return torch.stack(rows)


def _rel(out, expected):
    return ((out.cpu().double() - expected).norm() / expected.norm()).item()


# (T, x_row_div) -> R = T * div routed rows; (K, N, G, block_w, block_k, split): N / 8 words not a multiple of block_w
CASES = [
    ((1, 1), (128, 24, 32, 2, 32, 2)),    # R = 1, tail word block (3 words in blocks of 2)
    ((3, 1), (128, 72, 64, 4, 64, 1)),    # R = 3, SPLIT_K = 1 writes the output directly; 9 words in blocks of 4
    ((1, 3), (128, 40, 32, 8, 16, 4)),    # R = 3 read from one x row (x_row_div = top_k)
    ((17, 1), (64, 24, 32, 4, 32, 2)),    # R = 17 over 5 experts: duplicates
    ((4, 4), (64, 56, 32, 8, 32, 1)),     # R = 16, x_row_div = 4
]


@pytest.mark.parametrize("rows,shape", CASES, ids=[f"T{t}xdiv{d}" for (t, d), _ in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_moe_gemv_matches_independent_dequant(rows, shape, dtype):
    from torchforge.ops.awq_moe_gemv_triton import launch_awq_moe_gemv

    (T, div), (K, N, G, bw, bk, split) = rows, shape
    E = 5
    qw, s, z = _weights(E, K, N, G, sym=T % 2 == 0, seed=T * div)
    x = torch.randn(T, K, device=DEVICE).to(dtype)
    ids = torch.randint(0, E, (T * div,), device=DEVICE)
    out = launch_awq_moe_gemv(x, ids, qw, s, z, G, x_row_div=div, block_w=bw, block_k=bk, split_k=split)
    assert out.shape == (T * div, N) and out.dtype == dtype
    assert _rel(out, _expected(x, ids, qw, s, z, G, div)) < TOL[dtype]


def test_moe_gemv_default_config_duplicates_and_int32_ids():
    from torchforge.ops.awq_moe_gemv_triton import launch_awq_moe_gemv, moe_gemv_config

    E, K, N, G = 4, 64, 48, 32
    assert moe_gemv_config(6, K, N, G) == (128, 2, 2, 1, 5)  # 6 programs: one group per K slice
    qw, s, z = _weights(E, K, N, G)
    x = torch.randn(2, K, device=DEVICE, dtype=torch.float16)
    ids = torch.tensor([3, 3, 3, 1, 3, 1], device=DEVICE, dtype=torch.int32)  # the same expert many times
    out = launch_awq_moe_gemv(x, ids, qw, s, z, G, x_row_div=3)
    assert _rel(out, _expected(x, ids, qw, s, z, G, 3)) < TOL[torch.float16]
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])  # same x row, same expert: bitwise


@pytest.mark.parametrize("bad", [5, -1, 1 << 40])
def test_moe_gemv_out_of_range_id_gives_nan_row(bad):
    from torchforge.ops.awq_moe_gemv_triton import launch_awq_moe_gemv

    E, K, N, G = 5, 64, 24, 32
    qw, s, z = _weights(E, K, N, G)
    x = torch.randn(2, K, device=DEVICE, dtype=torch.float16)
    ids = torch.tensor([0, bad, 4, 2], device=DEVICE)
    out = launch_awq_moe_gemv(x, ids, qw, s, z, G, x_row_div=2, block_w=2, block_k=16, split_k=2)
    assert bool(out[1].isnan().all())
    good = [0, 2, 3]
    assert not bool(out[good].isnan().any())
    assert _rel(out[good], _expected(x, ids, qw, s, z, G, 2)[good]) < TOL[torch.float16]


def test_moe_gemv_rejects_bad_config_and_handles_no_rows():
    from torchforge.ops.awq_moe_gemv_triton import launch_awq_moe_gemv

    qw, s, z = _weights(3, 128, 16, 64)
    x = torch.randn(1, 128, device=DEVICE, dtype=torch.float16)
    ids = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="split_k=3 must divide the 2 groups"):
        launch_awq_moe_gemv(x, ids, qw, s, z, 64, split_k=3)
    with pytest.raises(ValueError, match="powers of two"):
        launch_awq_moe_gemv(x, ids, qw, s, z, 64, block_w=3)
    empty = launch_awq_moe_gemv(x[:0], ids[:0], qw, s, z, 64)
    assert empty.shape == (0, 16)


def test_moe_gemv_config_deepseek_v3_shapes():
    from torchforge.ops.awq_moe_gemv_triton import moe_gemv_config

    # gate_up [7168 -> 4096] / down [2048 -> 7168], group 128, at M = 1 and 8 tokens x top-8
    assert moe_gemv_config(8, 7168, 4096, 128) == (128, 2, 28, 1, 5)    # 8 x 4 x 28 = 896 programs
    assert moe_gemv_config(8, 2048, 7168, 128) == (128, 2, 16, 1, 5)    # 8 x 7 x 8 = 448 < 768: one group
    assert moe_gemv_config(64, 2048, 7168, 128) == (128, 2, 8, 1, 5)


def test_use_moe_gemv_rule():
    from torchforge.ops.awq_moe import use_moe_gemv

    assert use_moe_gemv(8, 256) and use_moe_gemv(128, 256) and use_moe_gemv(256, 256)  # DeepSeek-V3 up to 32 tokens
    assert not use_moe_gemv(257, 256) and not use_moe_gemv(512, 256)
    assert use_moe_gemv(16, 8) and not use_moe_gemv(17, 8)  # few experts: only up to 16 rows


@pytest.mark.parametrize("T,k,E,path", [(2, 4, 5, "gemv"), (6, 3, 5, "gemm"), (6, 4, 64, "gemv")])
def test_awq_moe_gemm_dispatch(monkeypatch, T, k, E, path):
    """The op body (as on CUDA) picks the GEMV by shape; both paths agree with the oracle."""
    import torchforge.ops.awq_moe as awq_moe
    import torchforge.ops.awq_moe_gemv_triton as gemv_triton

    called = []
    for name in ("launch_awq_moe_gemv", "launch_awq_moe_gemm"):
        orig = getattr(awq_moe, name)
        monkeypatch.setattr(awq_moe, name, lambda *a, _o=orig, _n=name, **kw: called.append(_n) or _o(*a, **kw))
    monkeypatch.setattr(awq_moe, "use_triton", can_launch)
    # few tiles for the interpreter (the default BLOCK_K is 2)
    monkeypatch.setattr(gemv_triton, "moe_gemv_config", lambda R, k, n, g: (128, 16, k // g, 1, 1))
    K, N, G = 64, 16, 32
    qw, s, z = _weights(E, K, N, G)
    x = torch.randn(T, K, device=DEVICE, dtype=torch.float32)
    ids = torch.randint(0, E, (T * k,), device=DEVICE)
    out = awq_moe.awq_moe_gemm(x, ids, qw, s, z, G, k)
    assert called == [f"launch_awq_moe_{path}"]
    assert _rel(out, _expected(x, ids, qw, s, z, G, k)) < 1e-5


@pytest.mark.parametrize("partials", [False, True])
def test_zero_experts_are_nan_rows(partials):
    """E = 0: every id is out of range. The per-row kernels read "expert 0" for a bad id, which does not exist
    here (an empty tensor, data pointer 0: the interpreter segfaulted, a GPU faults); the rows must be NaN."""
    from torchforge.ops.awq_moe_gemv_triton import launch_awq_moe_gemv
    from torchforge.ops.awq_triton import launch_awq_grouped_linear

    K, N, G = 32, 16, 32
    qw = torch.zeros(0, K, N // 8, dtype=torch.int32, device=DEVICE)
    s = torch.zeros(0, K // G, N, dtype=torch.float16, device=DEVICE)
    z = torch.zeros(0, K // G, N // 8, dtype=torch.int32, device=DEVICE)
    x = torch.randn(3, K, device=DEVICE)
    ids = torch.tensor([0, 1, -1], device=DEVICE)
    out = launch_awq_moe_gemv(x, ids, qw, s, z, G, partials=partials)
    assert out.shape == ((1, 3, N) if partials else (3, N)) and bool(out.isnan().all())
    if not partials:
        out = launch_awq_grouped_linear(x, ids, qw, s, z, G)
        assert out.shape == (3, N) and bool(out.isnan().all())
