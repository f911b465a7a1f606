"""NVFP4Experts / NVFP4MoE / NVFP4Linear and quantize(model, "nvfp4"): the modules compute what HF's modules
compute on the dequantized weights; shared experts are always computed; fused groups share global scales;
calibration gives input scales and a W4A4 emulation mode."""
import copy

import pytest
import torch
from torch import nn

import torchforge
from tests import models
from torchforge.nn import ForgeMoE, NVFP4Experts, NVFP4Linear, NVFP4MoE, emulate_w4a4
from torchforge.ops import nvfp4_fake_quantize_activation


def _hf_reference_experts(experts, gate_up, down):
    ref = copy.deepcopy(experts)
    ref.gate_up_proj.data.copy_(gate_up)
    ref.down_proj.data.copy_(down)
    return ref


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "mixtral"])
@torch.no_grad()
def test_nvfp4_experts_match_hf_experts_on_dequantized_weights(arch):
    model = models.build(arch)
    _, block = models.moe_blocks(model)[0]
    q = NVFP4Experts.from_hf(block.experts)
    gu, dn = q.dequantized_weights()
    ref = _hf_reference_experts(block.experts, gu, dn)
    x = torch.randn(11, model.config.hidden_size)
    _, w, ids = block.gate(x)
    out, expected = q(x, ids, w), ref(x, ids, w)
    assert (out - expected).norm() / expected.norm() < 1e-5
    orig = block.experts(x, ids, w)  # 4-bit float error, not garbage
    assert 1e-3 < (out - orig).norm() / orig.norm() < 0.25


@torch.no_grad()
def test_nvfp4_experts_gate_up_share_global_scale_and_bf16():
    model = models.build("deepseek_v3")
    _, block = models.moe_blocks(model)[0]
    block.experts.gate_up_proj.data[:, 32:] *= 10  # up rows much larger than gate rows
    q = NVFP4Experts.from_hf(block.experts)
    amax = block.experts.gate_up_proj.abs().amax(dim=(1, 2))
    torch.testing.assert_close(q.gate_up_weight_scale_2, amax / 2688, rtol=0, atol=0)
    E = q.num_experts
    x = torch.randn(E, 64)
    ids = torch.stack([torch.arange(E), (torch.arange(E) + 3) % E], 1)  # every expert twice
    w = torch.rand(E, 2)
    gu, dn = q.dequantized_weights()
    expected = _hf_reference_experts(block.experts, gu, dn)(x, ids, w)
    out = q(x.bfloat16(), ids, w)
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected).norm() / expected.norm() < 2e-2


def test_meta_shapes_and_bad_dims():
    q = NVFP4Experts(4, 64, 32, device="meta")
    shapes = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in q.state_dict().items()}
    assert shapes == {
        "gate_up_weight": ((4, 64, 32), "uint8"), "gate_up_weight_scale": ((4, 64, 4), "float8_e4m3fn"),
        "gate_up_weight_scale_2": ((4,), "float32"), "gate_up_input_scale": ((4,), "float32"),
        "down_weight": ((4, 64, 16), "uint8"), "down_weight_scale": ((4, 64, 2), "float8_e4m3fn"),
        "down_weight_scale_2": ((4,), "float32"), "down_input_scale": ((4,), "float32")}
    lin = NVFP4Linear(64, 40, bias=True, device="meta")
    assert {k: tuple(v.shape) for k, v in lin.state_dict().items()} == {
        "weight": (40, 32), "weight_scale": (40, 4), "weight_scale_2": (), "input_scale": (), "bias": (40,)}
    with pytest.raises(ValueError, match="intermediate_size=40 is not divisible by 16"):
        NVFP4Experts(4, 64, 40, device="meta")
    with pytest.raises(ValueError, match="in_features=40 is not divisible by 16"):
        NVFP4Linear(40, 64, device="meta")


def _calib(model, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (2, 12), generator=g) for _ in range(n)]


@torch.no_grad()
def test_quantize_deepseek_v3_swaps_and_keeps_shared_experts():
    model = models.build("deepseek_v3")
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    before = model(ids).logits
    torchforge.quantize(model, "nvfp4")
    layer = model.model.layers[1]
    assert isinstance(layer.mlp, NVFP4MoE) and isinstance(layer.mlp.experts, NVFP4Experts)
    assert isinstance(layer.mlp.shared_experts.gate_proj, NVFP4Linear)  # shared experts: NVFP4 per the recipe
    assert isinstance(layer.self_attn.q_a_proj, NVFP4Linear)
    assert isinstance(layer.self_attn.kv_b_proj, nn.Linear)  # default ignore
    assert isinstance(model.model.layers[0].mlp.gate_proj, NVFP4Linear)  # dense layer
    # fused groups share weight_scale_2 (vLLM keeps one per fused GEMM; ModelOpt unifies to the max)
    attn, shared = layer.self_attn, layer.mlp.shared_experts
    assert float(attn.q_a_proj.weight_scale_2) == float(attn.kv_a_proj_with_mqa.weight_scale_2)
    assert float(shared.gate_proj.weight_scale_2) == float(shared.up_proj.weight_scale_2)
    after = model(ids).logits
    assert torch.isfinite(after).all()
    assert (after - before).norm() / before.norm() < 0.3
    # the MoE block output is routed experts + shared experts (never skipped)
    x = torch.randn(5, 64)
    moe = layer.mlp
    _, w, top = moe.gate(x)
    torch.testing.assert_close(moe(x), moe.experts(x, top, w) + moe.shared_experts(x))


@torch.no_grad()
def test_quantize_bf16_shared_experts_by_recipe():
    model = models.build("deepseek_v3", dtype=torch.bfloat16)
    recipe = torchforge.Recipe.from_preset("nvfp4")
    recipe = recipe.replace(ignore=recipe.ignore + (r"re:.*shared_experts\..*",))
    torchforge.quantize(model, recipe)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, NVFP4MoE) and isinstance(moe.shared_experts.gate_proj, nn.Linear)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    _, w, top = moe.gate(x)
    torch.testing.assert_close(moe(x), (moe.experts(x, top, w).float() + moe.shared_experts(x).float()).bfloat16())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "llama"])
@torch.no_grad()
def test_quantize_other_architectures(arch):
    model = models.build(arch)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    before = model(ids).logits
    torchforge.quantize(model, "nvfp4")
    assert any(isinstance(m, NVFP4Linear) for m in model.modules())
    if arch != "llama":
        assert any(isinstance(m, NVFP4MoE) for m in model.modules())
    after = model(ids).logits
    assert (after - before).norm() / before.norm() < 0.3


@torch.no_grad()
def test_calibration_of_a_drop_pruned_model_skips_the_dropped_picks():
    # PrunedMoE(drop) hands pruned picks to the experts as id 0 with weight 0: they reach no output and must not
    # count toward expert 0's input amax
    from torchforge.nn.nvfp4_linear import E2M1_E4M3_MAX

    # one kept expert: most tokens' picks are dropped ones
    model = torchforge.prune_experts(models.build("deepseek_v3"), torch.tensor([[-1, -1, -1, 0, -1, -1, -1, -1]]),
                                     mode="drop")
    seen = []
    experts = model.model.layers[1].mlp.experts
    hook = experts.register_forward_pre_hook(lambda m, args: seen.append([a.clone() for a in args[:3]]))
    calib = _calib(model, n=6)
    for batch in calib:
        model(batch)
    hook.remove()
    want = torch.zeros(1)
    for hidden, ids, weights in seen:
        rows = ((ids == 0) & (weights != 0)).any(dim=1)
        if rows.any():
            want[0] = max(want[0], hidden[rows].abs().max())
    assert want[0] > 0 and any(((ids == 0) & (weights == 0)).any() for _, ids, weights in seen)
    torchforge.quantize(model, "nvfp4", calib_data=calib)
    got = model.model.layers[1].mlp.experts.gate_up_input_scale
    torch.testing.assert_close(got, want / E2M1_E4M3_MAX, rtol=0, atol=0)


@torch.no_grad()
def test_zero_tokens_give_an_empty_output():
    model = torchforge.quantize(models.build("qwen3_moe"), "nvfp4")
    block = models.moe_blocks(model)[0][1]
    out = block(torch.randn(1, 0, 64))
    assert out.shape == (1, 0, 64)  # as HF's block and ForgeMoE; the view(T, k, -1) of 0 elements raised


@torch.no_grad()
def test_calibration_and_w4a4_emulation():
    model = models.build("deepseek_v3")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(3))
    torchforge.quantize(model, "nvfp4", calib_data=_calib(model))
    moe = model.model.layers[1].mlp
    assert moe.experts.calibrated and moe.shared_experts.gate_proj.calibrated
    # gate_up input scale = amax of the hidden states routed to the expert / (6 * 448)
    assert (moe.experts.gate_up_input_scale > 0).all() and (moe.experts.down_input_scale > 0).all()
    w4a16 = model(ids).logits
    emulate_w4a4(model)
    w4a4 = model(ids).logits
    rel = (w4a4 - w4a16).norm() / w4a16.norm()
    assert 1e-4 < rel < 0.3, rel
    # a W4A4 linear is the W4A16 linear applied to the fake-quantized input
    lin = moe.shared_experts.down_proj
    x = torch.randn(4, lin.in_features)
    emulated = lin(x)
    torch.testing.assert_close(emulated, nvfp4_fake_quantize_activation(x, lin.input_scale) @ lin.dequantized_weight().T,
                               rtol=1e-5, atol=1e-5)
    emulate_w4a4(model, False)
    torch.testing.assert_close(model(ids).logits, w4a16)
    # uncalibrated models refuse W4A4 when it is switched on (the forward's check is skipped under torch.compile,
    # where input scales of 0 would quantize every activation to 0), through emulate_w4a4 and by hand
    torchforge.quantize(ref, "nvfp4")
    with pytest.raises(RuntimeError, match="emulate_w4a4: .* no calibrated input scale .*quantize with calib_data"):
        emulate_w4a4(ref)
    with pytest.raises(RuntimeError, match="emulate_w4a4: .* no calibrated input scale"):
        ref.model.layers[1].mlp.emulate_w4a4()
    assert not any(getattr(m, "w4a4", False) for m in ref.modules())  # nothing switched
    for m in ref.modules():
        if isinstance(m, (NVFP4Experts, NVFP4Linear)):
            with pytest.raises(RuntimeError, match=f"{type(m).__name__}: W4A4 emulation needs calibrated input"):
                m.w4a4 = True
    assert not any(getattr(m, "w4a4", False) for m in ref.modules())


def test_recipe_validation():
    with pytest.raises(ValueError, match="group_size.*16 for scheme 'nvfp4'"):
        torchforge.Recipe(scheme="nvfp4", group_size=32, export_format="modelopt-nvfp4")
    with pytest.raises(ValueError, match="export_format.*for scheme 'nvfp4'"):
        torchforge.Recipe(scheme="nvfp4", export_format="vllm-awq")
    assert torchforge.Recipe(scheme="nvfp4") == torchforge.Recipe.from_preset("nvfp4")  # block 16 and ModelOpt
    with pytest.raises(ValueError, match="not NVFP4's"):
        torchforge.Recipe(scheme="w4a16-rtn", export_format="modelopt-nvfp4")
    assert torchforge.Recipe.from_preset("nvfp4-ct").export_format == "compressed-tensors"
    assert isinstance(NVFP4MoE.from_hf(models.moe_blocks(models.build("qwen3_moe"))[0][1],
                                       NVFP4Experts(8, 64, 32, device="meta")), ForgeMoE)


def test_to_dtype_moves_but_never_casts_the_format_buffers():
    """model.to(bf16) cast the fp8 block scales and fp32 global scales too: the kernels refused them afterwards."""
    model = torchforge.quantize(models.build("deepseek_v3", dtype=torch.float32), "nvfp4")
    ids = torch.randint(0, 96, (2, 7))
    fixed = {n: b.clone() for n, b in model.named_buffers() if n.endswith(("weight_scale", "weight_scale_2",
                                                                             "input_scale"))}
    assert {b.dtype for b in fixed.values()} == {torch.float8_e4m3fn, torch.float32}
    model.to(torch.bfloat16)
    for name, b in model.named_buffers():
        if name in fixed:
            assert b.dtype == fixed[name].dtype and torch.equal(b.float(), fixed[name].float()), name
    lin = next(m for m in model.modules() if isinstance(m, NVFP4Linear))
    assert lin.bias is None or lin.bias.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(ids).logits.dtype == torch.bfloat16  # runs


def test_w4a4_without_calibration_is_an_error_not_zeros():
    lin = nn.Linear(64, 32, bias=False)
    m = NVFP4Linear.from_linear(lin, input_amax=3.0)
    m.w4a4 = True
    m.pack_weight(lin.weight)  # new weights, no amax: uncalibrated again with the flag on; the eager forward refuses
    with pytest.raises(RuntimeError, match="NVFP4Linear: W4A4 emulation needs a calibrated input_scale"):
        m(torch.randn(2, 64))
    with pytest.raises(ValueError, match="nvfp4_linear: input_scale must be positive and finite"):
        torchforge.ops.nvfp4_linear(torch.randn(2, 64), m.weight, m.weight_scale, m.weight_scale_2,
                                    torch.zeros(()), None)


@torch.no_grad()
def test_packing_a_meta_built_module_leaves_no_buffer_on_meta():
    # the two-phase build (construct on meta, then pack): input_scale stayed on meta unless an amax was given, so
    # `.calibrated` raised and the state dict could not be loaded into a real module
    lin = nn.Linear(64, 32, bias=True)
    m = NVFP4Linear(64, 32, bias=True, device="meta", dtype=torch.float32).pack_weight(lin.weight, lin.bias)
    assert {n: b.device.type for n, b in m.named_buffers()} == dict.fromkeys(m.state_dict(), "cpu")
    assert not m.calibrated
    real = NVFP4Linear(64, 32, bias=True, dtype=torch.float32)
    real.load_state_dict(m.state_dict())
    x = torch.randn(2, 64)
    torch.testing.assert_close(real(x), NVFP4Linear.from_linear(lin)(x), rtol=0, atol=0)
    experts = models.moe_blocks(models.build("qwen3_moe"))[0][1].experts
    e = NVFP4Experts.empty_for(experts, device="meta").pack_weights(experts.gate_up_proj, experts.down_proj)
    assert {b.device.type for b in e.buffers()} == {"cpu"} and not e.calibrated


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("where", ["linear", "experts"])
@torch.no_grad()
def test_calibration_refuses_non_finite_activations(bad, where):
    # an overflow (inf) exported input_scale = inf (vLLM then quantizes with 1 / inf = 0); a NaN was dropped by
    # Python's max for Linear layers, and made the experts' scales NaN, turning the whole export weight-only silently
    model = models.build("qwen3_moe")
    layer = model.model.layers[1]
    target = layer.mlp.experts if where == "experts" else layer.self_attn.o_proj
    calls = []

    def overflow_second_batch(mod, args):
        calls.append(1)
        return (args[0] * bad, *args[1:]) if len(calls) == 2 else None

    target.register_forward_pre_hook(overflow_second_batch)
    with pytest.raises(ValueError, match=r"calibration saw a non-finite activation \((inf|nan)\) at the input of "
                                         r"model\.layers\.1\.(mlp\.experts|self_attn\.o_proj)"):
        torchforge.quantize(model, "nvfp4", calib_data=_calib(model, n=3))
    assert not any(isinstance(m, (NVFP4Linear, NVFP4MoE)) for m in model.modules())


def test_pack_weights_resets_the_input_scales():
    # meta -> to_empty leaves uninitialised input scales on the weights' device: packing must not keep them (nor an
    # earlier calibration of other weights); the module is uncalibrated until set_input_amax
    from torchforge.nn.nvfp4_experts import NVFP4Experts

    E, H, I = 2, 32, 16
    m = NVFP4Experts(E, H, I, device="meta").to_empty(device="cpu")
    m.gate_up_input_scale.fill_(float("nan"))
    m.down_input_scale.fill_(3.0)
    m.pack_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    assert torch.equal(m.gate_up_input_scale, torch.zeros(E)) and torch.equal(m.down_input_scale, torch.zeros(E))
    assert not m.calibrated
    m.set_input_amax(torch.full((E,), 2688.0), torch.full((E,), 26.88))
    assert m.calibrated and torch.equal(m.gate_up_input_scale, torch.ones(E))


def _small_nvfp4(kind: str, calibrated: bool):
    g = torch.Generator().manual_seed(0)
    if kind == "linear":
        return NVFP4Linear.from_linear(nn.Linear(64, 32), input_amax=3.0 if calibrated else None)
    E, H, I = 4, 32, 16
    m = NVFP4Experts(E, H, I).pack_weights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g))
    return m.set_input_amax(torch.full((E,), 3.0), torch.full((E,), 1.0)) if calibrated else m


@pytest.mark.parametrize("kind", ["linear", "experts"])
def test_switching_w4a4_on_by_hand_checks_the_input_scales(kind):
    # `m.w4a4 = True` skipped emulate_w4a4's check; the forward's own is skipped under torch.compile: zeros
    m = _small_nvfp4(kind, calibrated=False)
    with pytest.raises(RuntimeError, match=f"{type(m).__name__}: W4A4 emulation needs calibrated input scales "
                                           r"\(switching it on is refused.*quantize with calib_data"):
        m.w4a4 = True
    assert m.w4a4 is False and "w4a4=False" in repr(m)
    m.w4a4 = False  # switching off is always allowed
    ok = _small_nvfp4(kind, calibrated=True)
    ok.w4a4 = True
    assert ok.w4a4 is True
    meta = NVFP4Linear(64, 32, device="meta") if kind == "linear" else NVFP4Experts(4, 32, 16, device="meta")
    meta.w4a4 = True  # nothing to read on meta yet (load_quantized-style two-phase builds); the eager forward checks


@torch.no_grad()
def test_w4a4_switch_under_torch_compile():
    lin = nn.Linear(64, 32, bias=False)
    m = NVFP4Linear.from_linear(lin)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    w4a16 = m(x)
    with pytest.raises(RuntimeError, match="W4A4 emulation needs calibrated input scales"):
        m.w4a4 = True
    compiled = torch.compile(m, backend="eager", fullgraph=True)  # traced: the forward skips its check
    assert torch.equal(compiled(x), w4a16)  # weight-only, not W4A4 on a scale of 0 (zeros under inductor)
    m.pack_weight(lin.weight, input_amax=float(x.abs().max()))
    m.w4a4 = True  # calibrated: the compiled module follows the flag
    out = compiled(x)
    assert torch.equal(out, m(x)) and not torch.equal(out, w4a16) and out.abs().max() > 0


@torch.no_grad()
def test_w4a4_experts_emulate_one_input_scale_per_layer_as_vllm():
    # vLLM's FlashInfer NVFP4 MoE backends (its default on Blackwell) and its emulation backend load one input scale
    # per layer, the max over experts (flashinfer_fp4_moe.py, fused_moe/oracle/nvfp4.py); torchforge emulated each
    # expert's own, which only vLLM's CUTLASS backend keeps
    E, H = 4, 32
    m = _small_nvfp4("experts", calibrated=True)
    gu_amax, dn_amax = torch.tensor([1.0, 2.0, 40.0, 8.0]), torch.tensor([0.5, 30.0, 1.0, 2.0])
    m.set_input_amax(gu_amax, dn_amax)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(8, H, generator=g) * 4, torch.rand(8, 2, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3], [0, 3], [2, 1]])
    m.w4a4 = True
    out = m(x, ids, w)
    layer_max = copy.deepcopy(m).set_input_amax(torch.full((E,), 40.0), torch.full((E,), 30.0))
    layer_max.per_expert_input_scales = True
    assert torch.equal(out, layer_max(x, ids, w))
    emulate_w4a4(m, per_expert_input_scales=True)  # vLLM's CUTLASS backend: each expert's own scale
    assert m.per_expert_input_scales and "per_expert_input_scales=True" in repr(m)
    per_expert = m(x, ids, w)
    assert not torch.equal(per_expert, out)
    torch.testing.assert_close(m.gate_up_input_scale, gu_amax / 2688, rtol=0, atol=0)  # what export writes
    emulate_w4a4(m)  # None: the setting stays
    assert m.per_expert_input_scales
