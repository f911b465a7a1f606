"""GPTQ solver: the reference against an independent float64 GPTQ (explicit H^-1 with the OBS downdate,
no Cholesky, no blocks), the fast batched solver (Triton kernel under TRITON_INTERPRET=1, and the
torch path) against the reference, GPTQ against RTN on correlated activations, and bad input."""
import numpy as np
import pytest
import torch

from torchforge.gptq import accumulate_hessian, inverse_hessian_factor, solve, solve_batched
from torchforge.ops._triton import can_launch
from torchforge.ops.qmeta4 import qmeta4_build, qmeta4_decode, qmeta4_effective_scale

HAS_KERNELS = can_launch(torch.empty(0))
BACKENDS = ["torch"] + (["triton"] if HAS_KERNELS else [])


def correlated(t, ic, seed, dead=()):
    """Activations with a decaying spectrum and strongly correlated channels (like LLM hidden states)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(ic, ic, generator=g) * torch.logspace(0, -2, ic).unsqueeze(1)
    x = torch.randn(t, ic, generator=g) @ mix + 0.05 * torch.randn(t, ic, generator=g)
    x[:, list(dead)] = 0.0
    return x


def weight(oc, ic, seed, b=None):
    g = torch.Generator().manual_seed(seed + 1000)
    shape = (oc, ic) if b is None else (b, oc, ic)
    return torch.randn(shape, generator=g) * 0.02


def out_err(x, w, w_hat):
    return float((x @ (w - w_hat).T).norm() / (x @ w.T).norm())


def rtn(w, group_size, bits=4, symmetric=True):
    q = qmeta4_build(w, group_size, bits, symmetric)
    s = qmeta4_effective_scale(q).repeat_interleave(group_size, -1)
    _, z, _ = qmeta4_decode(q)
    z = z.float().repeat_interleave(group_size, -1)
    return (torch.clamp(torch.round(w / s) + z, 0, 2**bits - 1) - z) * s


def gptq_obs_float64(w, h, group_size, bits, symmetric, damp):
    """Unblocked GPTQ straight from the paper, in float64: explicit H^-1, and after each column the
    Gaussian-elimination (OBS) downdate of H^-1 instead of a Cholesky factor. Group parameters come from
    the error-updated weights at each group's first column, through qmeta4_build (tested on its own)."""
    w = w.double().clone().numpy()
    h = h.double().clone().numpy()
    oc, ic = w.shape
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * np.mean(np.diag(h)) * np.eye(ic)
    hinv = np.linalg.inv(h)
    maxq = 2**bits - 1
    codes = np.zeros((oc, ic), dtype=np.int64)
    what = np.zeros((oc, ic))
    for c in range(ic):
        if c % group_size == 0:
            q = qmeta4_build(torch.from_numpy(w[:, c:c + group_size]).float(), group_size, bits, symmetric)
            s = qmeta4_effective_scale(q).double().numpy()[:, 0]
            z = qmeta4_decode(q)[1].double().numpy()[:, 0]
        q = np.clip(np.round(w[:, c] / s) + z, 0, maxq)
        codes[:, c] = q
        what[:, c] = (q - z) * s
        err = (w[:, c] - what[:, c]) / hinv[c, c]
        w[:, c + 1:] -= np.outer(err, hinv[c, c + 1:])
        hinv = hinv - np.outer(hinv[:, c], hinv[c, :]) / hinv[c, c]
    return codes, what


# ------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("symmetric, bits", [(True, 4), (False, 4), (False, 3)])
def test_reference_matches_independent_float64_gptq(symmetric, bits):
    x = correlated(512, 64, seed=0, dead=(7,))
    w = weight(24, 64, seed=0)
    h, _ = accumulate_hessian(x, 64)
    res = solve(w, h, bits=bits, group_size=16, symmetric=symmetric, block_size=32)
    codes64, what64 = gptq_obs_float64(w, h, 16, bits, symmetric, 0.01)
    agree = (res.codes.numpy() == codes64).mean()
    assert agree > 0.97, agree  # fp32 vs fp64 rounding flips a few codes, which then steer later columns
    e_ref, e64 = out_err(x, w, res.dequantize()), out_err(x, w, torch.from_numpy(what64).float())
    assert abs(e_ref - e64) / e64 < 0.02, (e_ref, e64)


def test_result_layout_and_exported_scale():
    x = correlated(256, 64, seed=1)
    w = weight(16, 64, seed=1).half()
    res = solve(w, accumulate_hessian(x, 64)[0], group_size=32)
    assert res.codes.shape == (16, 64) and res.codes.dtype == torch.uint8 and int(res.codes.max()) <= 15
    assert res.scales.shape == (16, 2) and res.scales.dtype == torch.float16
    assert res.zeros.shape == (16, 2) and (res.zeros == 8).all() and res.qmeta.dtype == torch.int32
    # the scale the codes were computed with is the qmeta decoded and rounded to fp16, i.e. the export
    assert torch.equal(res.scales, qmeta4_decode(res.qmeta)[0].half())
    s = res.scales.float().repeat_interleave(32, -1)
    assert torch.equal(res.dequantize(), (res.codes.float() - 8) * s)


def test_block_size_does_not_change_the_result():
    x = correlated(512, 96, seed=2)
    w = weight(16, 96, seed=2)
    h, _ = accumulate_hessian(x, 96)
    a = solve(w, h, group_size=32, block_size=16)  # groups span blocks
    b = solve(w, h, group_size=32, block_size=96)  # groups start inside blocks
    assert (a.codes == b.codes).float().mean() > 0.99
    assert abs(out_err(x, w, a.dequantize()) - out_err(x, w, b.dequantize())) < 1e-3


def test_gptq_beats_rtn_on_correlated_activations():
    x = correlated(2048, 128, seed=3)
    w = weight(64, 128, seed=3)
    h, _ = accumulate_hessian(x, 128)
    e_rtn = out_err(x, w, rtn(w, 32))
    e_gptq = out_err(x, w, solve(w, h, group_size=32).dequantize())
    e_mse = out_err(x, w, solve(w, h, group_size=32, mse=True).dequantize())
    e_static = out_err(x, w, solve(w, h, group_size=32, static_groups=True).dequantize())
    assert e_gptq < 0.6 * e_rtn, (e_gptq, e_rtn)
    assert e_static < 0.6 * e_rtn and e_mse < 0.6 * e_rtn, (e_static, e_mse, e_rtn)


def test_dead_channels_and_identity_hessian_is_rtn():
    w = weight(16, 64, seed=4)
    x = correlated(256, 64, seed=4, dead=(0, 33))
    res = solve(w, accumulate_hessian(x, 64)[0], group_size=32)
    assert torch.isfinite(res.dequantize()).all()
    assert (res.codes[:, [0, 33]] == 8).all()  # dead columns quantize the zeroed weight: the zero point
    # H = I: nothing to propagate (U is diagonal), GPTQ is round to nearest on the same grid
    eye = solve(w, torch.eye(64), group_size=32)
    assert torch.equal(eye.dequantize(), rtn(w, 32))


def test_inverse_hessian_factor():
    x = correlated(256, 48, seed=5)
    h, _ = accumulate_hessian(x, 48)
    u = inverse_hessian_factor(h, damp=0.05).double()
    assert torch.equal(u, u.triu())
    hd = h.double() + 0.05 * h.diagonal().double().mean() * torch.eye(48, dtype=torch.float64)
    torch.testing.assert_close(u.T @ u @ hd, torch.eye(48, dtype=torch.float64), atol=2e-3, rtol=0)


# ------------------------------------------------------------------------------------ fast solver
CONFIGS = [
    dict(group_size=32, block_size=64),
    dict(group_size=32, block_size=64, static_groups=True, mse=True),
    dict(group_size=64, block_size=32, symmetric=False),  # groups longer than blocks
    dict(group_size=16, block_size=64, bits=3, symmetric=False, mse=True, mse_norm=2.0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_fast_solver_matches_reference(backend, cfg):
    ic = 128
    xs = [correlated(384, ic, seed=10 + b, dead=(3,) if b == 1 else ()) for b in range(2)]
    w = weight(16, ic, seed=10, b=2)
    h = torch.stack([accumulate_hessian(x, ic)[0] for x in xs])
    if cfg.get("mse"):
        cfg = {**cfg, "mse_grid": torch.linspace(1.0, 0.8, 6)}
    fast = solve_batched(w, h, backend=backend, **cfg)
    assert fast.codes.shape == (2, 16, ic) and fast.scales.shape == (2, 16, ic // cfg["group_size"])
    for b in range(2):
        ref = solve(w[b], h[b], **cfg)
        e_ref, e_fast = out_err(xs[b], w[b], ref.dequantize()), out_err(xs[b], w[b], fast.dequantize()[b])
        assert abs(e_fast - e_ref) <= 0.01 * e_ref, (e_fast, e_ref)
        assert (fast.codes[b] == ref.codes).float().mean() > 0.99


@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_solver_block_diagonal_hessian(backend):
    ic = 96
    x = correlated(512, ic, seed=20)
    w = weight(16, ic, seed=20)
    hb, _ = accumulate_hessian(x, ic, block_size=64)  # 2 blocks, the last one half padding
    ref = solve(w, hb, group_size=32)
    fast = solve_batched(w[None], hb[None], group_size=32, backend=backend)
    e_ref, e_fast = out_err(x, w, ref.dequantize()), out_err(x, w, fast.dequantize()[0])
    assert abs(e_fast - e_ref) <= 0.01 * e_ref and (fast.codes[0] == ref.codes).float().mean() > 0.99
    e_full = out_err(x, w, solve(w, accumulate_hessian(x, ic)[0], group_size=32).dequantize())
    assert e_full < e_ref < out_err(x, w, rtn(w, 32))  # block-diagonal H: between full GPTQ and RTN


def test_chunks_and_inplace():
    ic = 64
    xs = [correlated(256, ic, seed=30 + b) for b in range(3)]
    w = weight(8, ic, seed=30, b=3)
    h = torch.stack([accumulate_hessian(x, ic)[0] for x in xs])
    whole = solve_batched(w, h, group_size=32, backend="torch")
    hc = h.clone()
    chunked = solve_batched(w, hc, group_size=32, backend="torch", chunk_size=2, inplace=True)
    assert all(torch.equal(a, b) for a, b in zip(whole[:4], chunked[:4]))
    assert not torch.equal(hc, h) and torch.equal(hc[0], hc[0].triu())  # factored in place: U


# ---------------------------------------------------------------------------------------- errors
def test_bad_inputs():
    w = weight(8, 64, seed=0)
    h = torch.eye(64)
    with pytest.raises(ValueError, match=r"hessian has shape \(64, 32\): not square"):
        solve(w, torch.ones(64, 32), group_size=32)
    with pytest.raises(ValueError, match=r"hessian has shape \(48, 48\) but weight \(8, 64\) has IC=64"):
        solve(w, torch.eye(48), group_size=32)
    with pytest.raises(ValueError, match=r"block-diagonal hessian has shape \(3, 16, 16\) but weight"):
        solve(w, torch.eye(16).repeat(3, 1, 1), group_size=32)
    bad = h.clone()
    bad[3, 4] = float("nan")
    with pytest.raises(ValueError, match="hessian contains 1 NaN/Inf"):
        solve(w, bad, group_size=32)
    wn = w.clone()
    wn[0, 0] = float("inf")
    with pytest.raises(ValueError, match="weight contains 1 NaN/Inf"):
        solve_batched(wn[None], h[None], group_size=32)
    with pytest.raises(ValueError, match="group_size=48 does not divide IC=64"):
        solve(w, h, group_size=48)
    with pytest.raises(ValueError, match=r"weight must be \[B, OC, IC\]"):
        solve_batched(w, h, group_size=32)
    with pytest.raises(ValueError, match="bits=9"):
        solve(w, h, bits=9, group_size=32)
    with pytest.raises(ValueError, match="not positive definite.*increase damp"):
        solve(w, -h, group_size=32, damp=0.0)


# ------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("cfg", [dict(), dict(mse=True), dict(static_groups=True, symmetric=False)])
def test_cuda_fast_solver_matches_reference(cfg):
    ic, oc = 512, 256
    xs = [correlated(2048, ic, seed=40 + b) for b in range(4)]
    w = weight(oc, ic, seed=40, b=4)
    h = torch.stack([accumulate_hessian(x, ic)[0] for x in xs])
    fast = solve_batched(w.cuda(), h.cuda(), **cfg)
    for b in range(4):
        ref = solve(w[b], h[b], **cfg)
        e_ref = out_err(xs[b], w[b], ref.dequantize())
        e_fast = out_err(xs[b], w[b], fast.dequantize()[b].cpu())
        assert abs(e_fast - e_ref) <= 0.01 * e_ref, (b, e_fast, e_ref)
    ref_cuda = solve(w[0].cuda(), h[0].cuda(), **cfg)  # the reference loop runs on the GPU too (the bench times it)
    e_ref = out_err(xs[0], w[0], solve(w[0], h[0], **cfg).dequantize())
    assert abs(out_err(xs[0], w[0], ref_cuda.dequantize().cpu()) - e_ref) <= 0.01 * e_ref
    hb = torch.stack([accumulate_hessian(x, ic, block_size=128)[0] for x in xs])
    fb = solve_batched(w.cuda(), hb.cuda(), **cfg)
    rb = solve(w[0], hb[0], **cfg)
    assert abs(out_err(xs[0], w[0], fb.dequantize()[0].cpu()) - out_err(xs[0], w[0], rb.dequantize())) <= 0.01 * \
        out_err(xs[0], w[0], rb.dequantize())


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_weight_too_large_for_fp16_scales_is_named(symmetric):
    """A finite weight whose fp16 group scale overflows was reported as 'weight contains NaN/Inf values'."""
    from torchforge.nn import ForgeGPTQLinear

    w = torch.randn(32, 64)
    w[3, 5] = 1e6
    for call in (lambda: solve(w, torch.eye(64), group_size=32, symmetric=symmetric),
                 lambda: solve_batched(w[None], torch.eye(64)[None], group_size=32, symmetric=symmetric)):
        with pytest.raises(ValueError, match="1 group scales would exceed the torch.float16 maximum 65504"):
            call()
    lin = torch.nn.Linear(64, 32)
    lin.weight.data.copy_(w)
    with pytest.raises(ValueError, match="too large for torch.float16 GPTQ scales"):
        ForgeGPTQLinear.from_linear(lin, group_size=32, symmetric=symmetric)
    solve(w, torch.eye(64), group_size=32, symmetric=symmetric, scale_dtype=torch.float32)  # fp32 scales hold it
