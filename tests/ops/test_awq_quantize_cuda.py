"""torch.ops.torchforge.awq_quantize_cuda (csrc/awq_quantize.cu) against an independent plain-torch
reference: bit-exact (`torch.equal`) on qweight, scales and qzeros."""
import pytest
import torch

from torchforge.ops._ext import has_cuda_ext

pytestmark = pytest.mark.cuda

# nibble position of logical output column j inside a packed int32 (packing order [0,2,4,6,1,3,5,7])
_NIBBLE_OF_COL = [0, 4, 1, 5, 2, 6, 3, 7]


def _need_ext():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not has_cuda_ext():
        pytest.skip("torchforge._C is not built (pip install -e . with a CUDA build of torch and nvcc)")


def _pack_cols(t: torch.Tensor) -> torch.Tensor:
    """[..., N, C] integer codes 0..15 -> [..., N, C // 8] int32, 8 consecutive columns per word."""
    t = t.to(torch.int64).reshape(*t.shape[:-1], t.shape[-1] // 8, 8)
    word = torch.zeros(t.shape[:-1], dtype=torch.int64)
    for j in range(8):
        word |= t[..., j] << (4 * _NIBBLE_OF_COL[j])
    word = torch.where(word >= 2**31, word - 2**32, word)  # reinterpret as signed int32
    return word.to(torch.int32)


def reference(weight: torch.Tensor, group_size: int, symmetric: bool):
    """Plain torch on CPU, fp32 math, round half to even, codes from the fp16-rounded scale."""
    w = weight.detach().cpu().float()
    *lead, oc, ic = w.shape
    x = w.reshape(*lead, oc, ic // group_size, group_size)
    if symmetric:
        amax = x.abs().amax(dim=-1, keepdim=True)
        s = amax / 7
        # clamp at the smallest fp16 subnormal: a tiny nonzero group never gets a zero scale
        s = torch.where(amax == 0, torch.ones_like(s), s.clamp_min(2.0**-24))
        s16 = s.to(torch.float16)
        sf = s16.float()
        q = torch.clamp(torch.round(x / sf), -8, 7) + 8
        z = torch.full_like(sf, 8.0)
    else:
        mx = x.amax(dim=-1, keepdim=True)
        mn = x.amin(dim=-1, keepdim=True)
        s = torch.clamp(mx - mn, min=1e-5) / 15
        s16 = s.to(torch.float16)
        sf = s16.float()
        z = torch.clamp(torch.round(-mn / sf), 0, 15)
        q = torch.clamp(torch.round(x / sf) + z, 0, 15)
    q = q.reshape(*lead, oc, ic).to(torch.int32)
    qweight = _pack_cols(q.transpose(-1, -2))  # [..., IC, OC // 8]
    scales = s16.squeeze(-1).transpose(-1, -2).contiguous()  # [..., IC // G, OC]
    qzeros = _pack_cols(z.squeeze(-1).to(torch.int32).transpose(-1, -2))  # [..., IC // G, OC // 8]
    return qweight, scales, qzeros


def _run(weight, group_size, symmetric):
    return torch.ops.torchforge.awq_quantize_cuda(weight, group_size, symmetric)


def _check(weight, group_size, symmetric, finite_scales=True):
    ref = reference(weight, group_size, symmetric)
    # Poison the caching allocator with two different patterns: an output element the kernel
    # never writes would keep the poison, which cannot match the reference under both.
    outs = []
    for fill in (0x00, 0xA5):
        nbytes = weight.numel() * 2 + (1 << 20)
        junk = torch.full((nbytes,), fill, dtype=torch.uint8, device=weight.device)
        del junk
        outs.append([t.cpu() for t in _run(weight, group_size, symmetric)])
    torch.cuda.synchronize()
    names = ("qweight", "scales", "qzeros")
    for out in outs:
        for name, got, exp in zip(names, out, ref):
            assert got.dtype == exp.dtype, (name, got.dtype, exp.dtype)
            assert got.shape == exp.shape, (name, got.shape, exp.shape)
            if not torch.equal(got, exp):
                bad = (got != exp).nonzero()
                raise AssertionError(
                    f"{name}: {bad.shape[0]} of {got.numel()} elements differ, first at "
                    f"{bad[0].tolist()}: got {got[tuple(bad[0])].item()} expected {exp[tuple(bad[0])].item()}"
                )
    if finite_scales:
        assert torch.isfinite(outs[0][1].float()).all()
    return outs[0]


def _weights(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    # a few outliers, some all-positive / all-negative / constant / zero regions
    w.view(-1)[torch.randint(0, w.numel(), (max(1, w.numel() // 500),), generator=g)] *= 40
    flat = w.reshape(-1, shape[-1])
    flat[1::7, :64] = flat[1::7, :64].abs() + 0.01
    flat[3::11, 32:96] = -flat[3::11, 32:96].abs() - 0.5
    flat[5::13, :32] = 0.125
    flat[2::9, :] = 0.0
    return w.to(dtype).cuda()


DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [
    (8 * 37, 128 * 3),  # many tiles in neither dim; OC tail of 40 rows, IC tail for G=32/64
    (256, 128),  # exactly one tile
    (8, 256),  # a single 8-row block
    (520, 1024),
    (3, 8 * 37, 128 * 3),  # batched experts, one launch
    (2, 264, 64 * 5),
]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype, group_size, symmetric):
    _need_ext()
    if shape[-1] % group_size:
        pytest.skip("IC not a multiple of G")
    w = _weights(shape, dtype, seed=hash((shape, group_size)) % 1000)
    qw, sc, qz = _check(w, group_size, symmetric)
    if symmetric:
        assert bool((qz == torch.tensor(0x88888888 - 2**32, dtype=torch.int32)).all())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_ties_round_half_to_even(dtype, symmetric):
    """Values exactly at (k + 0.5) * scale must round to even, as torch.round does."""
    _need_ext()
    G = 32
    oc, ic = 64, 128
    w = torch.empty(oc, ic)
    g = torch.Generator().manual_seed(7)
    for r in range(oc):
        for gi in range(ic // G):
            if symmetric:
                # amax 3.5 -> s = 0.5 exactly (fp32 and fp16); w / s = k + 0.5
                k = torch.randint(-7, 7, (G,), generator=g).float()  # |k + 0.5| <= 6.5
                vals = (k + 0.5) * 0.5
                vals[0] = 3.5 if (r + gi) % 2 else -3.5
            else:
                # mn = -1.5, mx = 6.0 -> s = 0.5, z = 3 (odd: the rounding must happen before
                # adding z); w / s = k + 0.5
                k = torch.randint(-3, 12, (G,), generator=g).float()
                vals = (k + 0.5) * 0.5
                vals[0], vals[1] = -1.5, 6.0
            w[r, gi * G : (gi + 1) * G] = vals[torch.randperm(G, generator=g)]
    qw, sc, qz = _check(w.to(dtype).cuda(), G, symmetric)
    assert bool((sc == 0.5).all())


def _round_up_row(group_size: int, dtype, seed: int) -> torch.Tensor:
    """One asymmetric group [group_size] whose maximum's code rounds up to 16 before the clamp:
    min = -a sf, max = b sf with a, b just above k + 0.5, so rint(max / sf) + z = 16 once
    (max - min) / 15 rounds to the same fp16 sf. Drawn until the reference says so."""
    g = torch.Generator().manual_seed(seed)
    while True:
        sf0 = float(torch.empty(()).uniform_(0.004, 0.03, generator=g).half())
        ab = torch.empty(2).uniform_(7.5, 7.56, generator=g)
        mn = torch.tensor(-float(ab[0]) * sf0).to(dtype).float()
        mx = torch.tensor(float(ab[1]) * sf0).to(dtype).float()
        sf = (torch.clamp(mx - mn, min=1e-5) / 15).half().float()
        z = torch.clamp(torch.round(-mn / sf), 0, 15)
        if torch.round(mx / sf) + z > 15:
            break
    row = (mn + (mx - mn) * torch.rand(group_size, generator=g)).to(dtype).float()
    row[torch.randperm(group_size, generator=g)[:2]] = torch.stack([mn, mx])
    return row


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_asym_round_up_at_max(dtype, group_size):
    """The asymmetric kernel skips the clamp on rows whose codes stay in [0, 15]; rows where the
    maximum rounds up to 16 must still clamp. They are mixed with ordinary rows inside one
    thread's 8 rows and across the lanes of a warp, so both paths run side by side."""
    _need_ext()
    oc, ic = 64, 256
    w = _weights((oc, ic), torch.float32, seed=13).cpu()
    for r in range(0, oc, 3):  # every third row: two of its groups round up
        g0 = (r // 3) % (ic // group_size)
        w[r, g0 * group_size : (g0 + 1) * group_size] = _round_up_row(group_size, dtype, seed=r)
        g1 = (g0 + 1) % (ic // group_size)
        w[r, g1 * group_size : (g1 + 1) * group_size] = _round_up_row(group_size, dtype, seed=1000 + r)
    w = w.to(dtype)
    # the case under test is there: unclamped codes would reach 16 in some groups
    x = w.float().reshape(oc, ic // group_size, group_size)
    mx, mn = x.amax(-1), x.amin(-1)
    sf = (torch.clamp(mx - mn, min=1e-5) / 15).half().float()
    z = torch.clamp(torch.round(-mn / sf), 0, 15)
    assert int((torch.round(mx / sf) + z > 15).sum()) >= oc // 3
    _check(w.cuda(), group_size, False)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_zero_and_tiny_groups(symmetric):
    _need_ext()
    w = torch.zeros(64, 256)
    w[8:16] = 1e-7  # asym: scale clamps at 1e-5 / 15 (an fp16 subnormal)
    w[16:24, :128] = -3e-4
    w[24:32, 64:128] = 1e-8  # sym: amax / 7 under 2^-25 -> the scale clamps at 2^-24
    w[32:40, :64] = torch.linspace(-2e-7, 3e-7, 64)  # fp16-subnormal scales
    _check(w.cuda(), 128, symmetric)
    _check(w.to(torch.bfloat16).cuda(), 64, symmetric)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_huge_values(dtype, symmetric):
    """Out-of-range weights (the Python wrapper rejects them; the kernel must still agree with the
    reference): fp16-overflowing scales, quotients beyond fp32, wide clamps."""
    _need_ext()
    w = _weights((64, 256), torch.float32, seed=11).cpu()
    w[8:16] = 1e35  # constant rows: asym quotient overflows fp32, sym scale overflows fp16
    w[16:24, :128] = 3e38 * (torch.arange(128) % 3 - 1.0)  # max - min overflows fp32
    w[24:32, 128:] = 5e5  # amax / 7 > 65504: fp16 scale is inf
    w[32:40, :128] = 1000.0
    w[32:40, 5] = 1000.0 + 2 ** -3  # asym: tiny range, huge quotients
    _check(w.to(dtype).cuda(), 128, symmetric, finite_scales=False)


@pytest.mark.slow
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_large_batched(symmetric):
    """Enough tiles that every block runs several grid-stride iterations."""
    _need_ext()
    w = _weights((8, 2048, 1024), torch.bfloat16, seed=3)
    _check(w, 128, symmetric)


def test_repeatable_and_stream():
    _need_ext()
    w = _weights((4, 512, 768), torch.bfloat16, seed=5)
    a = _run(w, 128, False)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        b = _run(w, 128, False)
    s.synchronize()
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_empty():
    _need_ext()
    qw, sc, qz = _run(torch.empty(0, 256, dtype=torch.float16, device="cuda"), 128, True)
    assert qw.shape == (256, 0) and sc.shape == (2, 0) and qz.shape == (2, 0)


@pytest.mark.parametrize(
    "make, group_size, match",
    [
        (lambda: torch.zeros(16, 128, dtype=torch.float64, device="cuda"), 128, "dtype"),
        (lambda: torch.zeros(12, 128, dtype=torch.float16, device="cuda"), 128, "multiple of 8"),
        (lambda: torch.zeros(16, 96, dtype=torch.float16, device="cuda"), 64, "multiple of group_size"),
        (lambda: torch.zeros(16, 128, dtype=torch.float16, device="cuda"), 48, "group_size"),
        (lambda: torch.zeros(128, 16, dtype=torch.float16, device="cuda").t(), 128, "contiguous"),
        (lambda: torch.zeros(16, dtype=torch.float16, device="cuda"), 128, r"\[OC, IC\]"),
    ],
)
def test_validation(make, group_size, match):
    _need_ext()
    with pytest.raises(RuntimeError, match=match):
        _run(make(), group_size, True)


def test_cpu_tensor_rejected():
    _need_ext()
    # the op has only a CUDA kernel: a CPU tensor must not reach it
    with pytest.raises((RuntimeError, NotImplementedError)):
        _run(torch.zeros(16, 128, dtype=torch.float16), 128, True)
