"""AWQ W4 format: packing and round-to-nearest quantization, bit-exact against independent references.

The references here are written from the format description (vLLM / AutoAWQ) with plain Python and
numpy loops; they share no code with torchforge.ops.
"""
import numpy as np
import pytest
import torch

from torchforge.ops import AWQ_PACK_ORDER, awq_pack, awq_quantize, awq_unpack

# Nibble k (bits 4k..4k+3) of a word holds column ORDER[k] of its 8 columns (vLLM awq_triton.py).
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
SYM_ZERO_WORD = -2004318072  # 0x88888888 as a signed int32


# ------------------------------------------------------------------------ independent references
def pack_loop(codes: np.ndarray) -> np.ndarray:
    """codes [IC, OC] ints 0..15 -> signed int32 words [IC, OC // 8], one word at a time."""
    ic, oc = codes.shape
    out = np.zeros((ic, oc // 8), dtype=np.int64)
    for i in range(ic):
        for c in range(oc // 8):
            word = 0
            for k in range(8):
                word |= int(codes[i, 8 * c + ORDER[k]]) << (4 * k)
            if word >= 2**31:
                word -= 2**32
            out[i, c] = word
    return out.astype(np.int32)


def unpack_loop(words: np.ndarray) -> np.ndarray:
    ic, ocp = words.shape
    out = np.zeros((ic, ocp * 8), dtype=np.uint8)
    for i in range(ic):
        for c in range(ocp):
            u = int(words[i, c]) & 0xFFFFFFFF
            for k in range(8):
                out[i, 8 * c + ORDER[k]] = (u >> (4 * k)) & 0xF
    return out


def quantize_loop(weight: torch.Tensor, group_size: int, symmetric: bool):
    """weight [OC, IC] -> (codes [IC, OC] uint8, scales fp16 [IC//G, OC], zeros [IC//G, OC] uint8)."""
    w = weight.float().numpy()
    oc, ic = w.shape
    ng = ic // group_size
    codes = np.zeros((ic, oc), dtype=np.uint8)
    scales = np.zeros((ng, oc), dtype=np.float16)
    zeros = np.zeros((ng, oc), dtype=np.uint8)
    f32 = np.float32
    for o in range(oc):
        for g in range(ng):
            vals = w[o, g * group_size : (g + 1) * group_size].astype(np.float32)
            if symmetric:
                amax = f32(np.max(np.abs(vals)))
                if amax == 0:
                    s = f32(1.0)
                else:
                    s = max(f32(amax / f32(7.0)), f32(2.0**-24))  # documented floor for underflowing groups
                s16 = np.float16(s)
                sq = f32(s16)
                q = np.clip(np.round(vals / sq), -8, 7) + 8
                z = 8
            else:
                mx, mn = f32(np.max(vals)), f32(np.min(vals))
                s = f32(max(f32(mx - mn), f32(1e-5)) / f32(15.0))
                s16 = np.float16(s)
                sq = f32(s16)
                z = int(np.clip(np.round(-mn / sq), 0, 15))
                q = np.clip(np.round(vals / sq) + z, 0, 15)
            codes[g * group_size : (g + 1) * group_size, o] = q.astype(np.uint8)
            scales[g, o] = s16
            zeros[g, o] = z
    return codes, scales, zeros


def _hex_words(words: torch.Tensor) -> str:
    return " ".join(f"{int(v) & 0xFFFFFFFF:08x}" for v in words.flatten().tolist())


# ----------------------------------------------------------------------------------- packing
def test_pack_order_constant():
    assert tuple(AWQ_PACK_ORDER) == tuple(ORDER)


@pytest.mark.parametrize("shape", [(1, 8), (5, 16), (32, 72)])
def test_pack_unpack_match_loop_reference(shape):
    g = torch.Generator().manual_seed(sum(shape))
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=g)
    codes[0, :8] = 15  # all-ones word: 0xffffffff == -1
    packed = awq_pack(codes)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], shape[1] // 8)
    np.testing.assert_array_equal(packed.numpy(), pack_loop(codes.numpy()))
    assert int(packed[0, 0]) == -1
    assert (packed < 0).any()  # the signed wrap is exercised
    unpacked = awq_unpack(packed)
    assert unpacked.dtype == torch.uint8
    np.testing.assert_array_equal(unpacked.numpy(), codes.numpy())
    np.testing.assert_array_equal(unpack_loop(packed.numpy()), codes.numpy())


def test_pack_unpack_batched():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (2, 3, 4, 16), dtype=torch.uint8, generator=g)
    packed = awq_pack(codes)
    assert packed.shape == (2, 3, 4, 2)
    for a in range(2):
        for b in range(3):
            np.testing.assert_array_equal(packed[a, b].numpy(), pack_loop(codes[a, b].numpy()))
    assert torch.equal(awq_unpack(packed), codes)


def test_pack_pinned_words():
    expecttest = pytest.importorskip("expecttest")
    codes = torch.zeros(4, 16, dtype=torch.uint8)
    codes[0] = torch.arange(16)  # columns 0..15 hold their own index
    codes[1, 0] = 1  # single column 0 -> nibble 0
    codes[1, 9] = 1  # single column 9 (column 1 of word 1) -> nibble 4
    codes[2, 8:] = 8  # the symmetric zero point word
    codes[3, :8] = torch.tensor([15, 0, 0, 0, 0, 0, 0, 0])
    codes[3, 15] = 8  # column 7 -> nibble 7, sign bit set
    expecttest.assert_expected_inline(
        _hex_words(awq_pack(codes)),
        """75316420 fdb9eca8 00000001 00010000 00000000 88888888 0000000f 80000000""",
    )


def test_unpack_all_ones_and_sign_bit():
    words = torch.tensor([[-1, -2147483648, 0x12345678]], dtype=torch.int32)
    codes = awq_unpack(words)
    assert codes[0, :8].tolist() == [15] * 8
    assert codes[0, 8:16].tolist() == [0, 0, 0, 0, 0, 0, 0, 8]
    # 0x12345678: nibbles k=0..7 are 8,7,6,5,4,3,2,1; column ORDER[k] gets nibble k
    assert codes[0, 16:].tolist() == [8, 4, 7, 3, 6, 2, 5, 1]


# ---------------------------------------------------------------------------------- quantize
def _tie_weight(oc: int, ic: int, group_size: int, symmetric: bool, seed: int) -> torch.Tensor:
    """Random weight whose groups hit the rounding corner cases: exact ties (k + 0.5) * scale, all-zero
    groups, groups far from zero, tiny groups and plain random groups, all with negative values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(oc, ic, generator=g) * 0.05
    ng = ic // group_size
    for o in range(oc):
        for gi in range(ng):
            sl = slice(gi * group_size, (gi + 1) * group_size)
            kind = (o + 3 * gi) % 6
            if kind == 0:
                # stored scale 0.25 exactly; every value is a multiple of 0.125 -> many exact ties
                halves = torch.randint(-14, 15, (group_size,), generator=g).float() * 0.125
                if symmetric:
                    halves[0] = 1.75  # amax / 7 = 0.25
                else:
                    halves.clamp_(-1.625, 2.125)
                    halves[0], halves[1] = -1.625, 2.125  # (max - min) / 15 = 0.25, -min / s = 6.5 (tie)
                w[o, sl] = halves
            elif kind == 1:
                w[o, sl] = 0.0
            elif kind == 2:
                w[o, sl] = w[o, sl] + 3.0  # all positive (asym: zero point clamps to 0)
            elif kind == 3:
                w[o, sl] = -w[o, sl].abs() - 1.0  # all negative (asym: zero point clamps to 15)
            elif kind == 4:
                w[o, sl] = w[o, sl] * 1e-3
    return w


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64])
def test_quantize_matches_loop_reference(symmetric, dtype, group_size):
    oc, ic = 24, 128
    w = _tie_weight(oc, ic, group_size, symmetric, seed=group_size + 7 * symmetric).to(dtype)
    qweight, scales, qzeros = awq_quantize(w, group_size=group_size, symmetric=symmetric)
    codes, s_ref, z_ref = quantize_loop(w, group_size, symmetric)
    assert qweight.dtype == torch.int32 and qweight.shape == (ic, oc // 8)
    assert scales.dtype == torch.float16 and scales.shape == (ic // group_size, oc)
    assert qzeros.dtype == torch.int32 and qzeros.shape == (ic // group_size, oc // 8)
    np.testing.assert_array_equal(scales.numpy().view(np.uint16), s_ref.view(np.uint16))
    np.testing.assert_array_equal(awq_unpack(qweight).numpy(), codes)
    np.testing.assert_array_equal(qweight.numpy(), pack_loop(codes))
    np.testing.assert_array_equal(qzeros.numpy(), pack_loop(z_ref))
    if symmetric:
        assert (qzeros == SYM_ZERO_WORD).all()


def test_quantize_hand_checked_ties():
    # one group of 8 values, stored scale 1.75 / 7 = 0.25: w / s = 7, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -8
    w = torch.tensor([1.75, 0.125, 0.375, 0.625, -0.125, -0.375, -0.625, -2.0])
    w = w.reshape(1, 8).repeat(8, 1)  # OC = 8, IC = G = 8
    qweight, scales, qzeros = awq_quantize(w, group_size=8, symmetric=True)
    # amax is 2.0 here, so s = 2 / 7 (fp16 0.28564453125): recompute the codes by hand below
    assert float(scales[0, 0]) == float(torch.tensor(2.0 / 7).half())
    w2 = w.clone()
    w2[:, -1] = -1.75  # now amax = 1.75, s = 0.25 exactly
    qweight, scales, qzeros = awq_quantize(w2, group_size=8, symmetric=True)
    assert float(scales[0, 0]) == 0.25
    # round half to even: 7, 0, 2, 2, -0, -2, -2, -7 -> codes + 8
    assert awq_unpack(qweight)[:, 0].tolist() == [15, 8, 10, 10, 8, 6, 6, 1]
    assert int(qzeros[0, 0]) == SYM_ZERO_WORD


def test_quantize_asym_hand_checked():
    # min -1.625, max 2.125: s = 3.75 / 15 = 0.25, z = round(6.5) = 6 (half to even)
    w = torch.tensor([-1.625, 2.125, 0.0, 0.125, -0.125, 1.0, 0.375, -1.5]).reshape(1, 8).repeat(8, 1)
    qweight, scales, qzeros = awq_quantize(w, group_size=8, symmetric=False)
    assert float(scales[0, 0]) == 0.25
    assert awq_unpack(qzeros)[0].tolist() == [6] * 8
    # round(w / s) = -6.5->-6, 8.5->8, 0, 0.5->0, -0.5->-0, 4, 1.5->2, -6 ; + 6, clamp 0..15
    assert awq_unpack(qweight)[:, 0].tolist() == [0, 14, 6, 6, 6, 10, 8, 0]


def test_quantize_zero_group_scale_is_one():
    w = torch.zeros(8, 64)
    w[:, 32:] = torch.linspace(-1, 1, 32)
    _, scales, _ = awq_quantize(w, group_size=32, symmetric=True)
    assert scales[0].tolist() == [1.0] * 8


def test_quantize_tiny_group_does_not_divide_by_zero():
    w = torch.full((8, 32), 1e-9)
    w[0, 0] = -3e-9
    qweight, scales, _ = awq_quantize(w, group_size=32, symmetric=True)
    assert (scales > 0).all()
    assert awq_unpack(qweight).tolist() == [[8] * 8] * 32  # decodes to 0


def test_quantize_batched_equals_per_expert():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 16, 64, generator=g, dtype=torch.float32).to(torch.bfloat16)
    for symmetric in (True, False):
        qw, s, qz = awq_quantize(w, group_size=32, symmetric=symmetric)
        assert qw.shape == (3, 64, 2) and s.shape == (3, 2, 16) and qz.shape == (3, 2, 2)
        for e in range(3):
            qw_e, s_e, qz_e = awq_quantize(w[e], group_size=32, symmetric=symmetric)
            assert torch.equal(qw[e], qw_e) and torch.equal(s[e], s_e) and torch.equal(qz[e], qz_e)


# ------------------------------------------------------------------------------------ errors
def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match="not divisible by 8"):
        awq_pack(torch.zeros(4, 12, dtype=torch.uint8))
    with pytest.raises(TypeError, match="codes must be uint8"):
        awq_pack(torch.zeros(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="1 values above 15"):
        awq_pack(torch.tensor([[0] * 7 + [16]], dtype=torch.uint8))
    with pytest.raises(TypeError, match="qweight must be int32"):
        awq_unpack(torch.zeros(4, 2, dtype=torch.int64))


def test_quantize_rejects_bad_weights():
    with pytest.raises(ValueError, match="OC=12 output channels.*not divisible by 8"):
        awq_quantize(torch.randn(12, 64), group_size=32)
    with pytest.raises(ValueError, match="IC=100 input channels, not divisible by group_size=128"):
        awq_quantize(torch.randn(16, 100), group_size=128)
    with pytest.raises(TypeError, match="weight must be float32/float16/bfloat16"):
        awq_quantize(torch.zeros(16, 64, dtype=torch.int32), group_size=32)
    with pytest.raises(ValueError, match="group_size=0 must be positive"):
        awq_quantize(torch.randn(16, 64), group_size=0)
    w = torch.randn(16, 64)
    w[0, 0] = float("nan")
    w[3, 5] = float("inf")
    w[4, 6] = float("-inf")
    with pytest.raises(ValueError, match="weight contains 3 NaN/Inf values"):
        awq_quantize(w, group_size=32)
    with pytest.raises(ValueError, match="exceed the fp16 maximum"):
        awq_quantize(torch.full((8, 32), 1e6), group_size=32)
