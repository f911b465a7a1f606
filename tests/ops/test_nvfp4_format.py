"""NVFP4 format: quantization bit-exact against a reference written here from NVIDIA ModelOpt's rules
(modelopt/torch/quantization/qtensor/nvfp4_tensor.py), element by element in numpy float32 / Python floats;
it shares no code with torchforge.ops. Hand-made vectors pin the packed and fp8 scale bytes (expecttest).

Rules (ModelOpt NVFP4QTensor, HEAD 2026-06):
  weight_scale_2 = fp32(amax) / fp32(6 * 448)
  block scale    = fp8_e4m3(clamp(fp32(block_amax) / fp32(6 * weight_scale_2), 2**-9, 448)), 1.0 for all-zero blocks
  code           = E2M1 nearest to x = w / fp32(scale * weight_scale_2), ties to the even code, saturating at 6,
                   sign bit (bit 3) iff x < 0; byte = code[2j] | code[2j + 1] << 4
  value          = E2M1[code] * scale * weight_scale_2
"""
import unittest

import numpy as np
import pytest
import torch

from torchforge.ops import (
    nvfp4_dequantize,
    nvfp4_fake_quantize_activation,
    nvfp4_quantize,
    nvfp4_quantize_activation,
    nvfp4_swizzle_scales,
    nvfp4_unswizzle_scales,
)

try:
    import expecttest
except ImportError:  # pragma: no cover
    expecttest = None

F32 = np.float32
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ------------------------------------------------------------------------ independent references
def _e4m3_values():
    """All finite non-negative float8_e4m3fn values with their mantissa bits: (value, m)."""
    out = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:  # NaN
                continue
            v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            out.append((v, m))
    return out


E4M3 = _e4m3_values()


def fp8_round(v: float) -> float:
    """Round a non-negative float to the nearest e4m3 value, ties to the even mantissa."""
    best = min(E4M3, key=lambda t: (abs(t[0] - v), t[1] % 2))
    return best[0]


def e2m1_code(x) -> int:
    """Nearest E2M1 magnitude (ties to the even code index), saturating; sign bit iff x < 0."""
    a = abs(float(x))
    if a >= 6:
        mag = 7
    else:
        mag = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))
    return mag | (8 if x < 0 else 0)


def quantize_loop(w: np.ndarray, g=None):
    """w [N, K] float32 -> (bytes [N, K/2] uint8, scales [N, K/16] float, g float32)."""
    n, k = w.shape
    if g is None:
        amax = F32(np.max(np.abs(w)))
        g = F32(amax / F32(6.0 * 448.0))
    g = F32(g)
    six_g = F32(F32(6.0) * g)
    scales = np.zeros((n, k // 16), dtype=np.float64)
    codes = np.zeros((n, k), dtype=np.uint8)
    for i in range(n):
        for b in range(k // 16):
            blk = w[i, 16 * b:16 * b + 16]
            s = F32(F32(np.max(np.abs(blk))) / six_g)
            if s == 0:
                s = F32(1.0)
            s = fp8_round(min(max(float(s), 2.0**-9), 448.0))
            scales[i, b] = s
            denom = F32(F32(s) * g)
            for j in range(16):
                codes[i, 16 * b + j] = e2m1_code(F32(blk[j]) / denom)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scales, g


def dequantize_loop(packed: np.ndarray, scales: np.ndarray, g) -> np.ndarray:
    n, kp = packed.shape
    out = np.zeros((n, 2 * kp), dtype=np.float32)
    for i in range(n):
        for j in range(kp):
            for h, c in enumerate((packed[i, j] & 0xF, packed[i, j] >> 4)):
                v = E2M1[c & 7] * (-1 if c & 8 else 1)
                col = 2 * j + h
                out[i, col] = F32(F32(F32(v) * F32(scales[i, col // 16])) * F32(g))
    return out


def check_bit_exact(w: torch.Tensor, g=None):
    packed, scales, gs = nvfp4_quantize(w, None if g is None else torch.tensor(g, dtype=torch.float32))
    rp, rs, rg = quantize_loop(w.float().numpy(), g)
    assert gs.dtype == torch.float32 and gs.shape == ()
    assert float(gs) == float(rg)
    np.testing.assert_array_equal(scales.float().numpy(), rs)
    np.testing.assert_array_equal(packed.numpy(), rp)
    np.testing.assert_array_equal(nvfp4_dequantize(packed, scales, gs).numpy(), dequantize_loop(rp, rs, rg))
    return packed, scales, gs


# ------------------------------------------------------------------------------------- bit-exact
def test_ties_saturation_and_signs_bit_exact():
    # With weight_scale_2 = 1 and a block amax of 6 the block scale is exactly 1, so x = w.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    near = [0.2499, 0.2501, 0.7499, 0.7501, 2.4999, 2.5001, 4.9999, 5.0001, -0.1, -0.0, 0.0, 1e-8, -1e-8,
            5.5, 5.9, -6.0]
    sat = [6.2, -6.1, 1.0, 0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]  # amax 6.2 -> scale fp8(1.0333) = 1.0
    w = torch.tensor([ties, near, sat], dtype=torch.float32)
    packed, scales, _ = check_bit_exact(w, g=1.0)
    assert scales.float().flatten().tolist() == [1.0, 1.0, 1.0]
    codes = [(b & 0xF, b >> 4) for b in packed[0].tolist()]
    assert [c for pair in codes for c in pair] == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]
    # -0.1 rounds to zero but keeps its sign (code 8); an exact -0.0 is code 0 (ModelOpt's `weight < 0`)
    row1 = [c for b in packed[1].tolist() for c in (b & 0xF, b >> 4)]
    assert row1[8:13] == [8, 0, 0, 0, 8]
    row2 = [c for b in packed[2].tolist() for c in (b & 0xF, b >> 4)]
    assert row2[:4] == [7, 15, 2, 1]  # 6.2 and -6.1 saturate


def test_random_bit_exact_default_global_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g) * torch.logspace(-3, 1, 64)  # blocks of very different ranges
    w[2, 16:32] = 0  # an all-zero block gets scale 1.0
    w[4, :16] *= 1e-7  # a tiny block: its scale clamps to 2**-9 instead of underflowing to 0
    packed, scales, _ = check_bit_exact(w)
    assert float(scales[2, 1].float()) == 1.0
    assert float(scales[4, 0].float()) == 2.0**-9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_bit_exact(dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(4, 48, generator=g) * 3).to(dtype)
    check_bit_exact(w)


def test_given_global_scale_and_saturating_block_scales():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 32, generator=g)
    check_bit_exact(w, g=1e-3)  # block amax / (6 * 1e-3) > 448: block scales clamp at 448, codes saturate
    packed, scales, _ = nvfp4_quantize(w, torch.tensor(1e-3))
    assert scales.float().max() == 448.0


def test_batched_matches_per_expert():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 8, 32, generator=g)
    w[1] *= 100
    packed, scales, gs = nvfp4_quantize(w)
    assert packed.shape == (3, 8, 16) and scales.shape == (3, 8, 2) and gs.shape == (3,)
    for e in range(3):
        p, s, g2 = nvfp4_quantize(w[e])
        assert torch.equal(packed[e], p) and torch.equal(scales[e].view(torch.uint8), s.view(torch.uint8))
        assert float(gs[e]) == float(g2)
    deq = nvfp4_dequantize(packed, scales, gs)
    assert torch.equal(deq[1], nvfp4_dequantize(packed[1], scales[1], gs[1]))
    shared = gs.max().expand(3).contiguous()
    p2, s2, g3 = nvfp4_quantize(w, shared)
    assert torch.equal(g3, shared)


def test_all_zero_weight():
    packed, scales, g = nvfp4_quantize(torch.zeros(2, 32))
    assert float(g) == 1.0  # ModelOpt would compute 0/0 here; torchforge uses 1.0
    assert packed.eq(0).all() and scales.float().eq(1.0).all()
    assert nvfp4_dequantize(packed, scales, g).eq(0).all()


def test_error_bound_random():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 256, generator=g)
    deq = nvfp4_dequantize(*nvfp4_quantize(w))
    rel = ((deq - w).norm() / w.norm()).item()
    assert 0.05 < rel < 0.15, rel  # 4-bit float with block-16 fp8 scales on Gaussian weights


# ------------------------------------------------------------------------------------ bad input
def test_bad_inputs():
    with pytest.raises(ValueError, match="K=40 input channels .* not divisible by 16"):
        nvfp4_quantize(torch.randn(4, 40))
    w = torch.randn(4, 32)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="1 NaN/Inf values"):
        nvfp4_quantize(w)
    w[1, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        torch.ops.torchforge.nvfp4_quantize(w, None)  # the op itself checks too
    with pytest.raises(ValueError, match="weight_scale_2 must be positive and finite"):
        nvfp4_quantize(torch.randn(4, 32), torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"weight_scale_2 has shape \(2,\), expected \(\)"):
        nvfp4_quantize(torch.randn(4, 32), torch.ones(2))
    with pytest.raises(TypeError, match="weight must be float32/float16/bfloat16"):
        nvfp4_quantize(torch.ones(4, 32, dtype=torch.int32))
    p, s, g = nvfp4_quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"scales has shape \(4, 1\)"):
        nvfp4_dequantize(p, s[:, :1], g)
    with pytest.raises(TypeError, match="scales must be float8_e4m3fn"):
        nvfp4_dequantize(p, s.float(), g)


def test_meta_weights_give_meta_outputs():
    # the NaN/Inf check read a value of the meta weight ("Tensor.item() cannot be called on meta tensors"), so a
    # module built on meta could not be packed there (awq_quantize gives the shapes)
    p, s, g = nvfp4_quantize(torch.empty(3, 8, 48, device="meta", dtype=torch.bfloat16))
    assert [(tuple(t.shape), t.dtype, t.device.type) for t in (p, s, g)] == [
        ((3, 8, 24), torch.uint8, "meta"), ((3, 8, 3), torch.float8_e4m3fn, "meta"), ((3,), torch.float32, "meta")]
    with pytest.raises(ValueError, match="K=40 input channels"):  # the shape checks still run
        nvfp4_quantize(torch.empty(4, 40, device="meta"))


# ------------------------------------------------------------------------------ pinned bytes
@unittest.skipIf(expecttest is None, "expecttest is not installed")
class TestPinnedBytes(expecttest.TestCase if expecttest is not None else unittest.TestCase):
    @staticmethod
    def hexdump(packed, scales, g):
        return (f"packed {packed.numpy().tobytes().hex(' ')}\n"
                f"scales {scales.view(torch.uint8).numpy().tobytes().hex(' ')}\n"
                f"weight_scale_2 {float(g).hex()}")

    # Both expectations were checked by hand. Ramp: amax 2688 -> weight_scale_2 = 1.0; block 0 amax 7.5 ->
    # scale 1.25 (0x3a), x = w / 1.25 = 0 .4 -.4 .8 1.2 -1.6 2.4 3.2 -6 4.8 .24 -.24 2.08 2.96 -4.08 1.52 ->
    # codes 0 1 9 2 2 b 4 5 f 6 0 8 4 5 e 3; row 1: 2688 / 448 = 6 -> code 7, scale 448 (0x7e).
    # Ties (scale 1.0 = 0x38): .25 .75 1.25 1.75 2.5 3.5 5 6 -> codes 0 2 2 4 4 6 6 7 (ties to even), negated
    # -> 8 a a c c e e f; the all-zero block gets scale 1.0.
    def test_ramp(self):
        w = torch.tensor([[0.0, 0.5, -0.5, 1.0, 1.5, -2.0, 3.0, 4.0, -7.5, 6.0, 0.3, -0.3, 2.6, 3.7, -5.1, 1.9],
                          [2688.0] + [0.0] * 15])
        self.assertExpectedInline(self.hexdump(*nvfp4_quantize(w)), """\
packed 10 29 b2 54 6f 80 54 3e 07 00 00 00 00 00 00 00
scales 3a 7e
weight_scale_2 0x1.0000000000000p+0""")

    def test_ties_and_zero_block(self):
        w = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                           -6.0] + [0.0] * 16])
        self.assertExpectedInline(self.hexdump(*nvfp4_quantize(w, torch.tensor(1.0))), """\
packed 20 42 64 76 a8 ca ec fe 00 00 00 00 00 00 00 00
scales 38 38
weight_scale_2 0x1.0000000000000p+0""")


# ------------------------------------------------------------------------------------ swizzle
def swizzle_loop(scales: np.ndarray) -> np.ndarray:
    """CUTLASS/FlashInfer 128x4 atoms: row r, col c of the zero-padded [Mp, Kp] matrix sits at byte
    (r // 128 * Kp / 4 + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4."""
    m, kb = scales.shape
    mp, kp = -(-m // 128) * 128, -(-kb // 4) * 4
    out = np.zeros(mp * kp, dtype=scales.dtype)
    for r in range(m):
        for c in range(kb):
            off = (r // 128 * (kp // 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
            out[off] = scales[r, c]
    return out.reshape(mp, kp)


@pytest.mark.parametrize("shape", [(130, 6), (128, 4), (5, 1), (2, 256, 3)])
def test_swizzle_layout_and_inverse(shape):
    g = torch.Generator().manual_seed(5)
    scales = (torch.rand(*shape, generator=g) * 4).to(torch.float8_e4m3fn)
    sw = nvfp4_swizzle_scales(scales)
    if scales.dim() == 2:
        np.testing.assert_array_equal(sw.view(torch.uint8).numpy(), swizzle_loop(scales.view(torch.uint8).numpy()))
    else:
        for e in range(shape[0]):
            np.testing.assert_array_equal(sw[e].view(torch.uint8).numpy(),
                                          swizzle_loop(scales[e].view(torch.uint8).numpy()))
    back = nvfp4_unswizzle_scales(sw, shape[-2], shape[-1])
    assert back.dtype == torch.float8_e4m3fn
    assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))
    with pytest.raises(ValueError, match="do not fit the padded shape"):
        nvfp4_unswizzle_scales(sw, shape[-2] + 128, shape[-1])


# -------------------------------------------------------------------------------- activations
def act_loop(x: np.ndarray, input_scale: float):
    """vLLM ref_nvfp4_quant with global_scale = 1 / input_scale, element by element: (codes, scales)."""
    gs = F32(F32(1.0) / F32(input_scale))
    inv_gs = F32(F32(1.0) / gs)
    m, k = x.shape
    codes = np.zeros((m, k), dtype=np.uint8)
    scales = np.zeros((m, k // 16))
    for i in range(m):
        for b in range(k // 16):
            blk = x[i, 16 * b:16 * b + 16].astype(np.float32)
            s = F32(gs * F32(F32(np.max(np.abs(blk))) * F32(1.0 / 6.0)))
            s = F32(fp8_round(min(float(s), 448.0)))
            scales[i, b] = s
            prod = F32(s * inv_gs)
            out_scale = F32(F32(1.0) / (prod if prod != 0 else F32(1e8)))
            for j in range(16):
                v = F32(blk[j] * out_scale)
                codes[i, 16 * b + j] = e2m1_code(min(max(v, F32(-6.0)), F32(6.0)))
    return codes, scales


def test_activation_quantization_matches_vllm_rules():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, generator=g) * torch.logspace(-2, 1, 64)
    x[3, 16:32] = 0
    input_scale = torch.tensor(float(x.abs().max()) / (6 * 448) * 0.5)  # half the amax: some scales clamp at 448
    packed, scales = nvfp4_quantize_activation(x, input_scale)
    rc, rs = act_loop(x.numpy(), float(input_scale))
    np.testing.assert_array_equal(scales.float().numpy(), rs)
    np.testing.assert_array_equal(packed.numpy(), (rc[:, 0::2] | (rc[:, 1::2] << 4)).astype(np.uint8))
    fq = nvfp4_fake_quantize_activation(x, input_scale)
    vals = np.array([[E2M1[c & 7] * (-1 if c & 8 else 1) for c in row] for row in rc], dtype=np.float32)
    expected = vals * np.repeat(rs, 16, axis=1).astype(np.float32) * np.float32(input_scale)
    np.testing.assert_array_equal(fq.numpy(), expected.astype(np.float32))
    with pytest.raises(ValueError, match="input_scale must be positive"):
        nvfp4_fake_quantize_activation(x, torch.tensor(0.0))
    with pytest.raises(ValueError, match="input_scale must be a scalar"):
        nvfp4_quantize_activation(x, torch.ones(2))
