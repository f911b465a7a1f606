"""awq_moe_gate_up_silu / awq_moe_down_combine: both ops against an fp64 oracle,
the fused decode path (grouped GEMV + epilogue reduce kernel, TRITON_INTERPRET=1 on CPU) against the same
GEMV followed by the unfused epilogue, opcheck, and bad input."""
import pytest
import torch
import torch.nn.functional as F

from torchforge.ops import (
    awq_moe_down_combine,
    awq_moe_gate_up_silu,
    awq_moe_gemm,
    awq_quantize,
    awq_unpack,
)
from torchforge.ops._triton import can_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I, G = 6, 64, 32, 32


def _experts(seed=0):
    torch.manual_seed(seed)
    gu = awq_quantize(torch.randn(E, 2 * I, H) * 0.2, G, symmetric=False)
    down = awq_quantize(torch.randn(E, H, I) * 0.2, G, symmetric=True)
    return [t.to(DEVICE) for t in gu], [t.to(DEVICE) for t in down]


def _unfused(x, ids, w, gu, down, k):
    """ForgeAWQExperts' epilogue written out: chunk, SiLU * up, weighted fp32 sum over the k picks."""
    gate, up = awq_moe_gemm(x, ids, *gu, G, k).chunk(2, dim=-1)
    h = F.silu(gate) * up
    d = awq_moe_gemm(h, ids, *down, G, 1)
    return h, (d.view(x.shape[0], k, -1).float() * w.unsqueeze(-1).float()).sum(1).to(x.dtype)


def _routing(T, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T * k,), generator=g).to(DEVICE)
    w = torch.rand(T, k, generator=g).to(DEVICE)
    return ids, w


def _oracle(x, ids, w, gu, down, k, group_size=G):
    """fp64 from unpacked nibbles (awq_unpack, not the reference dequantizer): h = SiLU(x Wg^T) * (x Wu^T),
    out[t] = sum_j w[t, j] h[t k + j] Wd^T."""
    def deq(qw, s, z):
        codes, zeros = awq_unpack(qw).double(), awq_unpack(z).double().repeat_interleave(group_size, -2)
        return ((codes - zeros) * s.double().repeat_interleave(group_size, -2)).transpose(-1, -2)  # [E, OC, IC]

    wgu, wd = deq(*gu)[ids], deq(*down)[ids]
    xr = x.double().repeat_interleave(k, 0)
    gate, up = (wgu @ xr.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    h = F.silu(gate) * up
    d = (wd @ h.unsqueeze(-1)).squeeze(-1)
    return h, (d.view(x.shape[0], k, -1) * w.double().unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("T,k", [(1, 4), (5, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ops_match_fp64_oracle(T, k, dtype):
    """Both ops (reference path on CPU, the CUDA dispatch on a GPU) against an fp64 computation from the
    unpacked codes; tolerance: the roundings of x.dtype (the weight, the GEMM outputs, SiLU, the product)."""
    gu, down = _experts()
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    ids, w = _routing(T, k, seed=T)
    h_ref, out_ref = _oracle(x.cpu(), ids.cpu(), w.cpu(), [t.cpu() for t in gu], [t.cpu() for t in down], k)
    h = awq_moe_gate_up_silu(x, ids, *gu, G, k)
    out = awq_moe_down_combine(h, ids, w, *down, G)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert ((h.cpu().double() - h_ref).norm() / h_ref.norm()) < tol
    assert ((out.cpu().double() - out_ref).norm() / out_ref.norm()) < tol


@pytest.mark.skipif(not can_launch(torch.empty(0, device=DEVICE)), reason="needs triton (CUDA or the interpreter)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,k,split", [(1, 4, 2), (3, 2, 1)])
def test_fused_decode_path_matches_gemv_then_epilogue(monkeypatch, dtype, T, k, split):
    """The op bodies as on CUDA (GEMV path forced on CPU tensors under the interpreter): fused reduce kernels
    against the same GEMV's reduced output followed by the PyTorch epilogue."""
    import torchforge.ops.awq_moe_fused as fused
    import torchforge.ops.awq_moe_gemv_triton as gemv
    from torchforge.ops import awq_moe

    monkeypatch.setattr(fused, "use_triton", can_launch)
    monkeypatch.setattr(awq_moe, "use_triton", can_launch)
    monkeypatch.setattr(gemv, "moe_gemv_config", lambda R, kk, n, g: (4, 16, min(split, kk // g), 1, 1))  # small tiles
    gu, down = _experts(seed=T)
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    ids, w = _routing(T, k, seed=10 + T)
    h_ref, out_ref = _unfused(x, ids, w, gu, down, k)  # awq_moe_gemm also takes the GEMV here
    h = awq_moe_gate_up_silu(x, ids, *gu, G, k)
    out = awq_moe_down_combine(h_ref, ids, w, *down, G)
    # Same partial sums and the same roundings; only exp() and the order of the fp32 sum over k may differ.
    ulp = {torch.float32: 1e-6, torch.float16: 2.0**-10}[dtype]
    torch.testing.assert_close(h, h_ref, rtol=ulp, atol=ulp * h_ref.abs().max().item())
    torch.testing.assert_close(out, out_ref, rtol=ulp, atol=ulp * out_ref.abs().max().item())


def test_opcheck_fused_ops():
    gu, down = _experts()
    x = torch.randn(2, H, device=DEVICE)
    ids, w = _routing(2, 3, seed=3)
    torch.library.opcheck(torch.ops.torchforge.awq_moe_gate_up_silu.default, (x, ids, *gu, G, 3))
    h = torch.randn(6, I, device=DEVICE)
    torch.library.opcheck(torch.ops.torchforge.awq_moe_down_combine.default, (h, ids, w, *down, G))


def test_bad_input_names_the_tensor():
    gu, down = _experts()
    ids, w = _routing(2, 3, seed=3)
    h = torch.randn(6, I, device=DEVICE)
    with pytest.raises(ValueError, match=r"weights has shape \(3, 3\); expected \[T, k\] with T \* k = 6"):
        awq_moe_down_combine(h, ids, torch.rand(3, 3, device=DEVICE), *down, G)
    with pytest.raises(TypeError, match="weights must be floating point"):
        awq_moe_down_combine(h, ids, torch.ones(2, 3, dtype=torch.int64, device=DEVICE), *down, G)
    with pytest.raises(ValueError, match=r"expected \(4,\) = rows of x \(2\) x x_row_div \(2\)"):
        awq_moe_gate_up_silu(torch.randn(2, H, device=DEVICE), ids, *gu, G, 2)  # 6 ids for 2 tokens x top-2


def test_zero_tokens():
    gu, down = _experts()
    ids = torch.empty(0, dtype=torch.int64, device=DEVICE)
    h = awq_moe_gate_up_silu(torch.randn(0, H, device=DEVICE), ids, *gu, G, 4)
    out = awq_moe_down_combine(h, ids, torch.rand(0, 4, device=DEVICE), *down, G)
    assert h.shape == (0, I) and out.shape == (0, H)


def test_experts_module_takes_the_fused_ops_with_router_gradients_too(monkeypatch):
    """ForgeAWQExperts runs the two fused ops, with no gradient needed and with router weights that need one (the
    ops' backward, ops/moe_autograd.py, since the twenty-seventh session; a PyTorch epilogue before): the gradient
    w.r.t. the weights is each pick's down-projection output."""
    import torchforge.nn.awq_experts as mod
    from torchforge.nn import ForgeAWQExperts

    torch.manual_seed(0)
    experts = ForgeAWQExperts(E, H, I, group_size=G, device=DEVICE).pack_weights(
        torch.randn(E, 2 * I, H, device=DEVICE) * 0.2, torch.randn(E, H, I, device=DEVICE) * 0.2)
    calls = []
    orig = mod.awq_moe_down_combine
    monkeypatch.setattr(mod, "awq_moe_down_combine", lambda *a: calls.append(1) or orig(*a))
    x = torch.randn(3, H, device=DEVICE)
    ids, w = _routing(3, 2, seed=5)
    ids = ids.view(3, 2)
    with torch.no_grad():
        fused = experts(x, ids, w)
    assert calls == [1]
    w_grad = w.clone().requires_grad_(True)
    out = experts(x, ids, w_grad)
    assert calls == [1, 1]  # the fused op again
    torch.testing.assert_close(out, fused)
    out.sum().backward()
    h = awq_moe_gate_up_silu(x, ids.reshape(-1), experts.gate_up_qweight, experts.gate_up_scales,
                             experts.gate_up_qzeros, G, 2)
    down = awq_moe_gemm(h, ids.reshape(-1), experts.down_qweight, experts.down_scales, experts.down_qzeros, G, 1)
    # on CUDA the backward's down rows come from a cuBLAS fp32 GEMM, the fused op's from its own kernel: fp32 sums of
    # H products in two orders (H100: 4e-6 relative apart)
    torch.testing.assert_close(w_grad.grad, down.view(3, 2, H).sum(-1), rtol=2e-5, atol=1e-5)
