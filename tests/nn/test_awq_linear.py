import pytest
import torch
from expecttest import TestCase

from torchforge import ops
from torchforge.nn import ForgeAWQLinear


def _unpack_independent(words: torch.Tensor) -> torch.Tensor:
    """[R, C//8] int32 AWQ words -> [R, C] codes; nibble k holds column [0, 2, 4, 6, 1, 3, 5, 7][k]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for k, col in enumerate(order):
        out[:, col::8] = (w >> (4 * k)) & 0xF
    return out


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_equals_dequantized_linear(symmetric, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 40, bias=bias)
    q = ForgeAWQLinear.from_linear(lin, group_size=64, symmetric=symmetric)
    # dequantize independently of the op under test: (q - z) * s per group of 64 input channels
    codes = _unpack_independent(q.qweight).float()                          # [IC, OC]
    zeros = _unpack_independent(q.qzeros).float().repeat_interleave(64, 0)  # [IC, OC]
    scales = q.scales.float().repeat_interleave(64, 0)
    w = ((codes - zeros) * scales).T
    x = torch.randn(2, 3, 128)
    expected = x @ w.T + (lin.bias if bias else 0)
    torch.testing.assert_close(q(x), expected, rtol=1e-5, atol=1e-5)
    assert (w - lin.weight).abs().max() <= scales.max() * (0.5 if symmetric else 1.0) + 1e-6


class TestLayout(TestCase):
    def test_meta_buffers(self):
        q = ForgeAWQLinear(256, 64, bias=True, group_size=128, device="meta")
        desc = "\n".join(f"{k}: {tuple(v.shape)} {v.dtype} {v.device}" for k, v in q.state_dict().items())
        self.assertExpectedInline(desc, """\
qweight: (256, 8) torch.int32 meta
scales: (2, 64) torch.float16 meta
qzeros: (2, 8) torch.int32 meta
bias: (64,) torch.bfloat16 meta""")


def test_bad_shapes():
    with pytest.raises(ValueError, match="out_features=20 must be divisible by 8"):
        ForgeAWQLinear(128, 20)
    with pytest.raises(ValueError, match="in_features=100 is not divisible by group_size=128"):
        ForgeAWQLinear(100, 16)
    q = ForgeAWQLinear(128, 16, group_size=64)
    with pytest.raises(ValueError, match="expected \\[out_features, in_features\\] = \\[16, 128\\]"):
        q.pack_weight(torch.randn(128, 16))


@pytest.mark.parametrize("group_size", [0, -1, 64.0, True])
def test_bad_group_size_is_named(group_size):
    # 0 failed as a ZeroDivisionError, -1 as a negative buffer size
    from torchforge.nn import ForgeAWQExperts, ForgeGPTQLinear

    for build, owner in ((lambda: ForgeAWQLinear(128, 16, group_size=group_size), "ForgeAWQLinear"),
                         (lambda: ForgeGPTQLinear(128, 16, group_size=group_size), "ForgeGPTQLinear"),
                         (lambda: ForgeAWQExperts(2, 128, 64, group_size=group_size), "ForgeAWQExperts")):
        with pytest.raises(ValueError, match=f"{owner}: group_size={group_size!r} must be a positive int"):
            build()


def test_nan_weight_rejected():
    lin = torch.nn.Linear(128, 16)
    with torch.no_grad():
        lin.weight[3, 5] = float("nan")
    with pytest.raises((ValueError, RuntimeError), match="(?i)nan"):
        ForgeAWQLinear.from_linear(lin, group_size=64)


def test_symmetric_zero_points_are_eight():
    q = ForgeAWQLinear.from_linear(torch.nn.Linear(64, 16), group_size=32, symmetric=True)
    assert bool((q.qzeros == ops.awq_pack(torch.full((2, 16), 8, dtype=torch.uint8))).all())
    assert bool((q.qzeros == -2004318072).all())  # 0x88888888 as int32


def test_mma_layout_runs_the_same_and_exports_awq():
    """use_mma_layout: same outputs, AWQ layout in state_dict and on load, refused where the shape does not fit."""
    import torchforge

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=True), torch.nn.Linear(128, 40))
    model[0] = ForgeAWQLinear.from_linear(model[0], group_size=64, symmetric=False)
    model[1] = ForgeAWQLinear.from_linear(model[1], group_size=64)
    x = torch.randn(3, 256)
    before, state = model(x), {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[0].dequantized_weight()
    assert torchforge.use_mma_layout(model) == 1  # OC = 40 is not a multiple of 64: stays on the AWQ layout
    assert (model[0].weight_layout, model[1].weight_layout) == ("mma", "awq")
    assert model[0].qweight.shape == (2, 2048) and "weight_layout=mma" in repr(model[0])
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    assert torch.equal(model[0].dequantized_weight(), weight)
    fresh = ForgeAWQLinear(256, 128, bias=True, group_size=64, symmetric=False, dtype=torch.float32)
    assert fresh.use_mma_layout()
    fresh.load_state_dict({k[2:]: v for k, v in state.items() if k.startswith("0.")})
    assert torch.equal(fresh.qweight, model[0].qweight)
    torch.testing.assert_close(fresh(x), model[0](x), rtol=0, atol=0)
    meta = ForgeAWQLinear(256, 128, group_size=128, device="meta")
    assert meta.use_mma_layout() and meta.qweight.shape == (2, 2048) and meta.qweight.is_meta
    assert ForgeAWQLinear(256, 128, group_size=32).use_mma_layout()  # groups of 32: dequantized per register
    assert not ForgeAWQLinear(256, 128, group_size=16).use_mma_layout()  # a lane's 16 rows of a chunk span 2 groups
    # the decode kernel's ticket buffer: zeros, 8 row blocks x OC / 64, never in a checkpoint, zeros after to_empty
    tickets = model[0].mma_tickets
    assert tickets.dtype == torch.int32 and tickets.shape == (16,) and int(tickets.count_nonzero()) == 0
    assert "0.mma_tickets" not in after
    tickets.fill_(5)
    model.float()  # any move or cast re-zeroes them
    assert int(model[0].mma_tickets.count_nonzero()) == 0
    meta.to_empty(device="cpu")
    with torch.inference_mode():  # buffers made in inference mode: casts and moves outside it still work
        inf = ForgeAWQLinear.from_linear(torch.nn.Linear(128, 64), group_size=64)
        assert inf.use_mma_layout()
    inf.half()
    assert int(inf.mma_tickets.count_nonzero()) == 0
    assert meta.mma_tickets.device.type == "cpu" and int(meta.mma_tickets.count_nonzero()) == 0


def test_mma_module_switched_on_meta_then_loaded_with_assign_computes_correctly():
    # load_state_dict(assign=True) moves no buffer: the tickets stayed on meta and sent the op to its fake, which
    # returned uninitialised memory
    torch.manual_seed(0)
    ref = ForgeAWQLinear.from_linear(torch.nn.Linear(128, 128).bfloat16(), group_size=64)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    m = ForgeAWQLinear(128, 128, bias=True, group_size=64, device="meta")
    assert m.use_mma_layout()
    m.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, assign=True)
    assert m.mma_tickets.device.type == "cpu" and int(m.mma_tickets.count_nonzero()) == 0
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    # and the op itself never takes tickets from another device than x
    from torchforge.ops.awq_mma import awq_mma_linear

    meta_tickets = torch.zeros(16, dtype=torch.int32, device="meta")
    out = awq_mma_linear(x, m.qweight, m.scales, m.qzeros, 64, m.bias, meta_tickets)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not ops._ext.has_cuda_ext(), reason="needs the compiled extension (csrc/) and a GPU")
def test_mma_module_cast_to_bf16_stays_on_the_cuda_kernel(monkeypatch):
    """model.to(bfloat16) casts the fp16 scales to bf16; the mma-layout module keeps the CUDA kernel for them."""
    import torchforge.ops.awq_mma as awq_mma

    torch.manual_seed(5)
    layer = ForgeAWQLinear.from_linear(torch.nn.Linear(512, 256, dtype=torch.bfloat16), group_size=128).cuda()
    assert layer.scales.dtype == torch.float16 and layer.bias.dtype == torch.bfloat16
    assert layer.use_mma_layout()
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    fp16_scales = layer(x)
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.bfloat16 and layer.qzeros.dtype == torch.int32
    calls = []
    real = awq_mma.launch_awq_mma_cuda
    monkeypatch.setattr(awq_mma, "launch_awq_mma_cuda", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    out = layer(x)
    assert len(calls) == 1 and calls[0]["tickets"] is layer.mma_tickets  # the module's kept tickets
    assert int(layer.mma_tickets.count_nonzero()) == 0
    expected = x.double() @ layer.dequantized_weight().double().T + layer.bias.double()
    assert ((out.double() - expected).norm() / expected.norm()) < 4e-3
    assert ((out.float() - fp16_scales.float()).norm() / fp16_scales.float().norm()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantized_weight_is_rounded_once(dtype):
    """In a narrow dtype it is the fp32 weight rounded once, the weight the layer multiplies with (the scales were
    rounded to that dtype first: two roundings, thousands of entries off in bf16)."""
    from tests import models
    import torchforge
    from torchforge.nn import ForgeGPTQLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64, bias=False)
    for mod in (ForgeAWQLinear.from_linear(lin, group_size=32), ForgeGPTQLinear.from_linear(lin, group_size=32)):
        assert torch.equal(mod.dequantized_weight(dtype), mod.dequantized_weight().to(dtype))
        x = torch.eye(256, dtype=dtype)
        assert torch.equal(mod(x).T, mod.dequantized_weight(dtype))  # probing the layer with the identity
    moe = torchforge.quantize(models.build("qwen3_moe"), {"scheme": "w4a16-rtn", "group_size": 32})
    experts = next(m for m in moe.modules() if hasattr(m, "dequantized_weights"))
    for a, b in zip(experts.dequantized_weights(dtype), experts.dequantized_weights()):
        assert torch.equal(a, b.to(dtype))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dead_group_quantizes_to_zero_and_runs_finite(symmetric, dtype):
    # a group of ~1e-9 weights: (max - min) / 15 or amax / 7 is below fp16's smallest subnormal; the scale is kept
    # nonzero (2^-24 symmetric, 1e-5 / 15 asymmetric), so the group decodes to ~0, never to NaN / Inf
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(128, 16, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight[:, :64] = (torch.randn(16, 64, generator=g) * 1e-9).to(dtype)
    q = ForgeAWQLinear.from_linear(lin, group_size=64, symmetric=symmetric)
    assert bool((q.scales > 0).all())
    w = q.dequantized_weight(dtype)
    assert bool(torch.isfinite(w).all()) and float(w[:, :64].abs().max()) == 0.0
    y = q(torch.randn(3, 128, generator=g).to(dtype))
    assert bool(torch.isfinite(y).all())
