"""Edge cases of the module swaps: meta construction then load_state_dict(assign=True) of a PrunedMoE, pack calls
whose bias does not match the module, and experts calls whose routing weights do not match the picks."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests import models
from torchforge.gptq import solve
from torchforge.nn import ForgeAWQExperts, ForgeAWQLinear, ForgeGPTQLinear, NVFP4Experts, NVFP4Linear
from torchforge.nn.pruned_moe import PrunedMoE

ROW = torch.tensor([-1, 0, -1, 1, 2, -1, -1, 3], dtype=torch.int32)  # 4 of 8 experts kept


@pytest.mark.parametrize("mode", ["drop", "reroute"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
@torch.no_grad()
def test_pruned_moe_built_on_meta_then_loaded_with_assign(arch, mode):
    """load_state_dict(assign=True) moves no buffer: the map-derived buffers (expert_map_row, slot_map, kept.*; not
    in the state dict) stayed on meta and the block failed ("layer_map is on meta but topk_ids is on cpu")."""
    model = models.build(arch)
    _, block = models.moe_blocks(model)[-1]
    real = PrunedMoE.from_block(block, ROW, mode)
    with torch.device("meta"):
        meta_model = getattr(models, arch)()
    loaded = PrunedMoE.from_block(models.moe_blocks(meta_model)[-1][1], ROW, mode)
    loaded.load_state_dict(real.state_dict(), assign=True)
    assert all(b.device.type == "cpu" for b in loaded.buffers())
    assert loaded.slot_map.tolist() == real.slot_map.tolist()
    x = torch.randn(2, 3, model.config.hidden_size)
    out = loaded(x)
    assert torch.equal(out, real(x))
    if mode == "drop":  # independent reference: HF's router over all experts, pruned picks weighted 0
        xf = x.reshape(-1, x.shape[-1])
        _, w, ids = block.gate(xf)
        w = torch.where(ROW[ids] >= 0, w, torch.zeros_like(w))
        ref = block.experts(xf, ids, w)
        shared = getattr(block, "shared_experts", None)
        if shared is not None:
            ref = ref + shared(xf)
        torch.testing.assert_close(out.reshape_as(ref), ref, rtol=1e-5, atol=1e-6)


def _gptq_pack(m, w, bias):
    return m.pack_result(solve(w, torch.eye(w.shape[1]), group_size=64), bias)


PACKERS = {
    "awq": (lambda **kw: ForgeAWQLinear(128, 64, group_size=64, **kw), lambda m, w, b: m.pack_weight(w, b)),
    "gptq": (lambda **kw: ForgeGPTQLinear(128, 64, group_size=64, **kw), _gptq_pack),
    "nvfp4": (lambda **kw: NVFP4Linear(128, 64, **kw), lambda m, w, b: m.pack_weight(w, b)),
}


@pytest.mark.parametrize("kind", sorted(PACKERS))
@pytest.mark.parametrize("device", ["cpu", "meta"])
@torch.no_grad()
def test_pack_bias_must_match_the_module(kind, device):
    """A bias=True module packed without a bias kept its constructor's torch.empty bias (garbage on CPU, a meta tensor
    for a module built on meta) and computed with it; a bias of the wrong shape was stored as is."""
    build, pack = PACKERS[kind]
    torch.manual_seed(0)
    w, b = torch.randn(64, 128), torch.randn(64)
    with pytest.raises(ValueError, match="built with bias=True but no bias was given"):
        pack(build(bias=True, device=device, dtype=torch.float32), w, None)
    with pytest.raises(ValueError, match=r"bias has shape \(32,\), expected \[out_features\] = \[64\]"):
        pack(build(bias=True, device=device, dtype=torch.float32), w, b[:32])
    with pytest.raises(ValueError, match="got a bias but the module was built with bias=False"):
        pack(build(bias=False, device=device), w, b)
    m = pack(build(bias=True, device=device, dtype=torch.float32), w, b)
    x = torch.randn(3, 128)
    torch.testing.assert_close(m(x), x @ m.dequantized_weight().T + b, rtol=1e-5, atol=1e-5)


def _experts_reference(x, ids, w, gate_up, down, act=F.silu):
    """Loop over tokens and picks on dequantized weights (HF's fused-experts math)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (down[e] @ (act(g) * u))
    return out


@pytest.mark.parametrize("path", ["awq_fused", "awq_gelu", "awq_grad", "nvfp4"])
def test_experts_reject_routing_weights_that_do_not_match_the_picks(path):
    """top_k_weights [T, 1] for top_k_index [T, 2] broadcast in the weighted sum over the picks (NVFP4Experts, and
    ForgeAWQExperts outside its fused SiLU path): a wrong output, no error."""
    torch.manual_seed(0)
    E, H, I, T, k = 4, 64, 32, 5, 2
    gate_up, down = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    if path == "nvfp4":
        m = NVFP4Experts(E, H, I, act_fn=nn.SiLU()).pack_weights(gate_up, down)
    else:
        m = ForgeAWQExperts(E, H, I, group_size=32, act_fn=nn.GELU() if path == "awq_gelu" else nn.SiLU())
        m.pack_weights(gate_up, down)
    x = torch.randn(T, H)
    ids = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1)
    w = torch.rand(T, k, requires_grad=path == "awq_grad")
    with pytest.raises(ValueError, match=r"top_k_weights has shape \(5, 1\) but top_k_index has \(5, 2\)"):
        m(x, ids, w[:, :1])
    with pytest.raises(ValueError, match="hidden_states must be \\[T, H\\]"):
        m(x[None], ids, w)
    with pytest.raises(ValueError, match="top_k_index has 4 rows but hidden_states has 5 tokens"):
        m(x, ids[:4], w[:4])
    out = m(x, ids, w)  # matching shapes: the experts' math on the dequantized weights
    gu_dq, dn_dq = m.dequantized_weights()
    ref = _experts_reference(x, ids, w.detach(), gu_dq, dn_dq, F.gelu if path == "awq_gelu" else F.silu)
    torch.testing.assert_close(out.detach(), ref, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_nvfp4_experts_set_input_amax_needs_one_amax_per_expert():
    """A scalar (or wrong-length) amax was stored as the [E] input-scale buffer: the state dict then held shape ()
    and the failure came only at the W4A4 forward or at export."""
    E, H, I = 4, 64, 32
    m = NVFP4Experts(E, H, I).pack_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    for bad in (torch.tensor(3.0), torch.ones(E - 1)):
        with pytest.raises(ValueError, match=r"gate_up_amax has shape .*expected \[E\] = \[4\]"):
            m.set_input_amax(bad, torch.ones(E))
        with pytest.raises(ValueError, match=r"down_amax has shape .*expected \[E\] = \[4\]"):
            m.set_input_amax(torch.ones(E), bad)
    gu, dn = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, 1.0, 1.5, 2.0])
    m.set_input_amax(gu, dn)
    torch.testing.assert_close(m.gate_up_input_scale, gu / (6.0 * 448.0), rtol=0, atol=0)
    torch.testing.assert_close(m.down_input_scale, dn / (6.0 * 448.0), rtol=0, atol=0)
    assert m.calibrated


def test_nvfp4_amax_must_be_finite_and_not_negative():
    """A NaN or negative calibrated amax was stored as the input scale; W4A4 then refused the module as "not
    calibrated", which sends the user looking for a missing calibration instead of a broken one."""
    lin = nn.Linear(64, 32, bias=False)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="input_amax must be a finite amax >= 0"):
            NVFP4Linear.from_linear(lin, input_amax=bad)
    good = NVFP4Linear.from_linear(lin, input_amax=3.0)
    assert float(good.input_scale) == float(torch.tensor(3.0 / (6.0 * 448.0))) and good.calibrated  # stored in fp32
    E = 4
    m = NVFP4Experts(E, 64, 32).pack_weights(torch.randn(E, 64, 64), torch.randn(E, 64, 32))
    for bad in (torch.tensor([1.0, float("nan"), 1.0, 1.0]), torch.tensor([1.0, -2.0, 1.0, 1.0])):
        with pytest.raises(ValueError, match="down_amax holds NaN, Inf or negative values"):
            m.set_input_amax(torch.ones(E), bad)
    assert not m.calibrated  # nothing was stored
