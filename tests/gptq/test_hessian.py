"""accumulate_hessian against a float64 dense X^T X / N built from the concatenated activations."""
import numpy as np
import pytest
import torch

from torchforge.gptq import HessianAccumulator, accumulate_hessian


def _batches(seed=0, d=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, d, generator=g), torch.randn(2, 5, d, generator=g).half(),
            torch.randn(1, 3, d, generator=g, dtype=torch.float64).to(torch.bfloat16), torch.randn(11, d, generator=g)]


def _dense(batches, limit=None):
    x = np.concatenate([b.float().reshape(-1, b.shape[-1]).numpy().astype(np.float64) for b in batches])
    x = x[:limit] if limit else x
    return x.T @ x / x.shape[0], x.shape[0]


def test_full_matches_dense():
    b = _batches()
    h, n = accumulate_hessian(iter(b), 40)
    ref, nref = _dense(b)
    assert n == nref == 7 + 10 + 3 + 11 and h.dtype == torch.float32 and h.shape == (40, 40)
    np.testing.assert_allclose(h.numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bs", [8, 16, 12, 64])
def test_blocks_equal_dense_blocks(bs):
    b = _batches(1)
    hb, n = accumulate_hessian(b, 40, block_size=bs)
    ref, _ = _dense(b)
    nb = -(-40 // bs)
    assert hb.shape == (nb, bs, bs) and n == 31
    for g in range(nb):
        lo, hi = g * bs, min(40, (g + 1) * bs)
        np.testing.assert_allclose(hb[g, : hi - lo, : hi - lo].numpy(), ref[lo:hi, lo:hi], rtol=1e-5, atol=1e-6)
        # last block: zero padding outside the real channels
        assert torch.count_nonzero(hb[g, hi - lo:, :]) == 0 and torch.count_nonzero(hb[g, :, hi - lo:]) == 0


def test_max_tokens_uses_first_rows_and_stops_consuming():
    b = _batches(2)
    consumed = []

    def gen():
        for x in b:
            consumed.append(x)
            yield x

    h, n = accumulate_hessian(gen(), 40, max_tokens=12)
    ref, _ = _dense(b, limit=12)
    assert n == 12 and len(consumed) == 2  # 7 + 10 rows reach the cap: the rest is never produced
    np.testing.assert_allclose(h.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_single_tensor_and_empty():
    x = torch.randn(3, 4, 8)
    h, n = accumulate_hessian(x, 8)
    assert n == 12
    torch.testing.assert_close(h, (x.reshape(-1, 8).T @ x.reshape(-1, 8)) / 12)
    h0, n0 = accumulate_hessian([], 8, block_size=4)
    assert n0 == 0 and h0.shape == (2, 4, 4) and not h0.any()


def test_accumulator_streams():
    acc = HessianAccumulator(16, block_size=8)
    xs = [torch.randn(5, 16) for _ in range(4)]
    for x in xs:
        assert acc.add(x) == 5
    h, n = acc.finalize()
    full, _ = accumulate_hessian(xs, 16)
    torch.testing.assert_close(h[1], full[8:, 8:])


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"shape \(4, 9\); its last dim must be in_features=8"):
        accumulate_hessian([torch.randn(4, 9)], 8)
    with pytest.raises(TypeError, match="floating point, got torch.int64"):
        accumulate_hessian([torch.ones(4, 8, dtype=torch.long)], 8)
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        accumulate_hessian([x], 8)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        accumulate_hessian([x], 8, block_size=0)


@pytest.mark.cuda
def test_cuda_matches_cpu():
    b = _batches(3)
    hc, n = accumulate_hessian([x.cuda() for x in b], 40, block_size=16)
    h, _ = accumulate_hessian(b, 40, block_size=16)
    assert hc.is_cuda and n == 31
    torch.testing.assert_close(hc.cpu(), h, rtol=1e-5, atol=1e-6)
