"""torchforge.quantize(model, "w4a16-gptq", calib_data=...) on tiny HF models: swapped modules, GPTQ beats
RTN on every architecture, routed experts get exactly their routed tokens (gate and up share one Hessian),
the RTN fallback for modules without tokens (logged), sequential vs non-sequential, bad input."""
import copy
import logging
import re

import pytest
import torch
from expecttest import assert_expected_inline

import torchforge
from tests import models
from torchforge.gptq.calibrate import GPTQConfig, _ExpertStats
from torchforge.nn import ForgeAWQExperts, ForgeMoE
from torchforge.nn.gptq_linear import ForgeGPTQLinear
from torchforge.ops.awq import awq_dequantize

RECIPE = {"scheme": "w4a16-gptq", "group_size": 32}


def _ids(n=4, s=24, seed=0):
    return torch.randint(0, 96, (n, s), generator=torch.Generator().manual_seed(seed))


def _logit_err(model, ref, ids):
    with torch.no_grad():
        return float((model(ids).logits - ref).norm() / ref.norm())


def _kinds(model):
    out = []
    for n, m in model.named_modules():
        if isinstance(m, (ForgeGPTQLinear, ForgeAWQExperts, ForgeMoE, torch.nn.Linear)):
            out.append(f"{n}: {type(m).__name__}")
    return "\n".join(out)


def test_deepseek_v3_swapped_modules_pinned():
    model = models.build("deepseek_v3")
    torchforge.quantize(model, RECIPE, calib_data=_ids())
    assert_expected_inline(_kinds(model), """\
model.layers.0.self_attn.q_a_proj: ForgeGPTQLinear
model.layers.0.self_attn.q_b_proj: ForgeGPTQLinear
model.layers.0.self_attn.kv_a_proj_with_mqa: ForgeGPTQLinear
model.layers.0.self_attn.kv_b_proj: Linear
model.layers.0.self_attn.o_proj: ForgeGPTQLinear
model.layers.0.mlp.gate_proj: ForgeGPTQLinear
model.layers.0.mlp.up_proj: ForgeGPTQLinear
model.layers.0.mlp.down_proj: ForgeGPTQLinear
model.layers.1.self_attn.q_a_proj: ForgeGPTQLinear
model.layers.1.self_attn.q_b_proj: ForgeGPTQLinear
model.layers.1.self_attn.kv_a_proj_with_mqa: ForgeGPTQLinear
model.layers.1.self_attn.kv_b_proj: Linear
model.layers.1.self_attn.o_proj: ForgeGPTQLinear
model.layers.1.mlp: ForgeMoE
model.layers.1.mlp.experts: ForgeAWQExperts
model.layers.1.mlp.shared_experts.gate_proj: ForgeGPTQLinear
model.layers.1.mlp.shared_experts.up_proj: ForgeGPTQLinear
model.layers.1.mlp.shared_experts.down_proj: ForgeGPTQLinear
lm_head: Linear""")
    assert model._torchforge_recipe.scheme == "w4a16-gptq"


@pytest.mark.parametrize("arch", sorted(models.ALL_BUILDERS))
def test_gptq_beats_rtn(arch):
    model = models.build(arch)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    rtn = torchforge.quantize(copy.deepcopy(model), {**RECIPE, "scheme": "w4a16-rtn"})
    torchforge.quantize(model, RECIPE, calib_data=ids)
    e_gptq, e_rtn = _logit_err(model, ref, ids), _logit_err(rtn, ref, ids)
    assert e_gptq < 0.85 * e_rtn, (e_gptq, e_rtn)


def test_non_sequential_mode_and_options():
    model = models.build("qwen3_moe")
    ids = _ids(8)
    with torch.no_grad():
        ref = model(ids).logits
    seq = torchforge.quantize(copy.deepcopy(model), RECIPE, calib_data=ids)
    non = torchforge.quantize(copy.deepcopy(model), RECIPE, calib_data=[{"input_ids": ids[:4]}, ids[4:]],
                              gptq=GPTQConfig(sequential=False))
    blk = torchforge.quantize(model, RECIPE, calib_data=ids, gptq={"hessian_block_size": 32, "mse": True})
    q = "model.layers.1.self_attn.o_proj"
    # sequential: layer 1 is calibrated on the outputs of the quantized layer 0, so its Hessians differ
    assert not torch.equal(seq.get_submodule(q).qweight, non.get_submodule(q).qweight)
    for m in (seq, non, blk):
        assert _logit_err(m, ref, ids) < 0.3


def test_routed_experts_get_their_tokens_gate_up_share():
    model = models.build("mixtral")
    experts = model.model.layers[0].mlp.experts
    stats = _ExpertStats(experts, GPTQConfig())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 64, generator=g)
    idx = torch.tensor([[0, 1], [1, 2], [0, 2], [1, 0], [2, 1], [0, 1], [1, 2], [2, 0], [0, 1], [4, 1]])
    w = torch.rand(10, 2, generator=g) + 0.1
    w[1, 0] = w[3, 1] = w[7, 0] = 0  # picks that reach no output (PrunedMoE(drop)'s pruned picks): not expert tokens
    stats.hook(experts, (x, idx, w), {})
    for e in range(4):
        rows = [t for t in range(10) if any(i == e and wt != 0 for i, wt in zip(idx[t].tolist(), w[t].tolist()))]
        h, n = stats.gate_up[e].finalize()
        assert n == len(rows)
        if not rows:
            continue
        xe = x[rows].double()
        torch.testing.assert_close(h.double(), xe.T @ xe / len(rows), rtol=1e-5, atol=1e-6)
        gate, up = (xe @ experts.gate_up_proj[e].detach().double().T).chunk(2, dim=-1)
        inter = torch.nn.functional.silu(gate) * up
        hd, nd = stats.down[e].finalize()
        assert nd == len(rows)
        torch.testing.assert_close(hd.double(), inter.T @ inter / len(rows), rtol=1e-4, atol=1e-6)
    assert stats.gate_up[3].n_seen == 0  # expert 3 never routed; id 4 == num_experts is HF's dropped slot


def test_unrouted_experts_fall_back_to_rtn_with_a_log_line(caplog):
    model = models.build("qwen3_moe")
    gu = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    with caplog.at_level(logging.INFO, logger="torchforge.gptq.calibrate"):
        torchforge.quantize(model, RECIPE, calib_data=_ids(1, 1))  # one token: 2 of 8 experts routed per layer
    assert "saw no calibration tokens; quantizing them round-to-nearest" in caplog.text
    ex = model.model.layers[0].mlp.experts
    line = next(r.getMessage() for r in caplog.records if "model.layers.0.mlp.experts: experts" in r.getMessage())
    unrouted = [int(v) for v in re.search(r"experts \[([0-9, ]+)\] saw", line).group(1).split(",")]
    e = unrouted[0]
    w_hat = awq_dequantize(ex.gate_up_qweight[e], ex.gate_up_scales[e].float(), ex.gate_up_qzeros[e], 32)
    rtn = torchforge.gptq.solve(gu[e], torch.eye(64), group_size=32).dequantize()  # H = I is RTN on the grid
    assert torch.equal(w_hat, rtn)


def test_bad_inputs():
    model = models.build("llama")
    with pytest.raises(ValueError, match="needs calib_data"):
        torchforge.quantize(model, RECIPE)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['blocksize'\]"):
        torchforge.quantize(model, RECIPE, calib_data=_ids(), gptq={"blocksize": 64})
    for bs in (0, -1):  # -1 made no batch: every module saw no token and was quantized round-to-nearest
        with pytest.raises(ValueError, match=f"GPTQConfig: batch_size={bs} must be a positive int"):
            torchforge.quantize(model, RECIPE, calib_data=_ids(), gptq={"batch_size": bs})
    padding_only = {"input_ids": _ids(), "attention_mask": torch.zeros(4, 24, dtype=torch.long)}
    with pytest.raises(ValueError, match="calib_data holds no real token"):  # was RTN everywhere, logged only
        torchforge.quantize(model, RECIPE, calib_data=padding_only)
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(128, 60, bias=False)
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.mlp\.down_proj.*out_features=60"):
        torchforge.quantize(model, RECIPE, calib_data=_ids())


@pytest.mark.parametrize("where", ["linear", "experts"])
def test_a_nan_weight_is_refused_before_any_swap(where):
    # NaN compares False, so the scale-range check let it through: the layers before it were GPTQ-swapped and the
    # solver's error named no module
    model = models.build("qwen3_moe")
    with torch.no_grad():
        if where == "linear":
            model.model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
        else:
            model.model.layers[1].mlp.experts.down_proj[1, 2, 3] = float("nan")
    before = {n: type(m) for n, m in model.named_modules()}
    name = "self_attn\\.o_proj" if where == "linear" else "mlp\\.experts"
    with pytest.raises(ValueError, match=rf"cannot quantize model\.layers\.1\.{name}: gptq: weight contains 1 NaN"):
        torchforge.quantize(model, RECIPE, calib_data=_ids())
    assert {n: type(m) for n, m in model.named_modules()} == before


@pytest.mark.parametrize("sequential", [True, False])
def test_nan_activations_name_the_module(sequential):
    model = models.build("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = float("nan")
    ids = _ids()
    ids[0, 3] = 5
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.self_attn\.q_proj: accumulate_hessian: "
                                         r"the Hessian has NaN/Inf entries"):
        torchforge.quantize(model, RECIPE, calib_data=ids, gptq={"sequential": sequential})


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_cuda_calibration_runs_the_fast_solver(arch):
    model = models.build(arch).cuda()
    ids = _ids(8).cuda()
    with torch.no_grad():
        ref = model(ids).logits
    rtn = torchforge.quantize(copy.deepcopy(model), {**RECIPE, "scheme": "w4a16-rtn"})
    torchforge.quantize(model, RECIPE, calib_data=ids, gptq={"mse": True})
    assert all(m.qweight.is_cuda for m in model.modules() if isinstance(m, ForgeGPTQLinear))
    assert _logit_err(model, ref, ids) < 0.85 * _logit_err(rtn, ref, ids)


def _two_sequences():
    a, b = torch.randint(0, 96, (1, 9)), torch.randint(0, 96, (1, 5))
    padded = {"input_ids": torch.cat([a, torch.cat([b, torch.zeros(1, 4, dtype=torch.long)], 1)]),
              "attention_mask": torch.cat([torch.ones(1, 9), torch.cat([torch.ones(1, 5), torch.zeros(1, 4)], 1)]).long()}
    return a, b, padded


def test_padding_is_left_out_of_the_statistics():
    """Two sequences calibrated one per batch, unpadded, and together right-padded with an attention_mask: the
    Hessians see the same tokens (the padding rows used to enter the dense and the experts' statistics)."""
    from torchforge.gptq.calibrate import _batches, _Collector, _forward_all, _kept_tokens

    model = models.build("deepseek_v3").eval()
    a, b, padded = _two_sequences()
    selected = torchforge.Recipe.coerce(RECIPE).select(model, check_fused=False)
    cfg = GPTQConfig()

    def collect(batches):
        with _Collector(selected, cfg) as col, torch.no_grad():
            _forward_all(model, batches, torch.device("cpu"), col)
        return col

    one_each, together = collect([{"input_ids": a}, {"input_ids": b}]), collect(_batches(padded, 8))
    assert _kept_tokens(_batches(padded, 8)[0]).sum() == 14
    for name, acc in one_each.linears.items():
        h1, n1 = acc.finalize()
        h2, n2 = together.linears[name].finalize()
        assert n1 == n2 == 14, name
        torch.testing.assert_close(h2, h1, rtol=1e-5, atol=1e-6)
    for name, st in one_each.experts.items():
        assert [x.n_seen for x in st.gate_up] == [x.n_seen for x in together.experts[name].gate_up]
        assert sum(x.n_seen for x in st.gate_up) == 14 * model.config.num_experts_per_tok


@pytest.mark.parametrize("sequential", [True, False])
def test_padded_calibration_quantizes_as_unpadded(sequential):
    """Through quantize, layer by layer and all at once: the same codes up to the Hessians' float summation order."""
    a, b, padded = _two_sequences()
    gptq = {"sequential": sequential}
    one_each = torchforge.quantize(models.build("deepseek_v3"), RECIPE, calib_data=[a, b], gptq=gptq)
    together = torchforge.quantize(models.build("deepseek_v3"), RECIPE, calib_data=padded, gptq=gptq)
    q1 = {k: v for k, v in one_each.state_dict().items() if k.endswith("qweight")}
    q2 = together.state_dict()
    differ = sum((q1[k] != q2[k]).sum().item() for k in q1) / sum(v.numel() for v in q1.values())
    assert differ < 1e-3, differ  # with the padding counted: most words differ


@pytest.mark.parametrize("data, message", [
    (torch.zeros(0, 8, dtype=torch.long), "holds no tokens"),
    (torch.zeros(2, 8, 4, dtype=torch.long), "must be integer input_ids \\[N, S\\]"),
    (torch.rand(2, 8), "must be integer input_ids"),
])
def test_calibration_data_errors(data, message):
    from torchforge.gptq.calibrate import _batches

    with pytest.raises(ValueError, match=message):
        _batches(data, 4)


def test_a_tokenizer_output_is_split_in_batches():
    from transformers import BatchEncoding

    from torchforge.gptq.calibrate import _batches

    enc = BatchEncoding({"input_ids": torch.arange(30).reshape(10, 3), "attention_mask": torch.ones(10, 3)})
    out = _batches(enc, 4)
    assert [tuple(b["input_ids"].shape) for b in out] == [(4, 3), (4, 3), (2, 3)]
    assert torch.equal(torch.cat([b["input_ids"] for b in out]), enc["input_ids"])
    assert all(b["attention_mask"].shape == b["input_ids"].shape for b in out)


def test_sequential_layers_get_their_own_attention_mask():
    """transformers passes each decoder layer the mask of its type (here layer 0 full attention, layer 1 a 4-token
    sliding window); sequential GPTQ used to run every layer with layer 0's mask. Layer 0 is left unquantized, so
    layer 1's Hessians must be those of the real forward's activations, solved as GPTQ solves them."""
    model = models.build("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    ids = _ids(4, 24)
    names = ("self_attn.o_proj", "mlp.down_proj")  # the inputs that depend on the attention mask
    layer = model.model.layers[1]
    xs = {n: [] for n in names}
    hooks = [layer.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: xs[n].append(a[0].detach().clone()))
             for n in names]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    want = {}
    for n in names:
        w = layer.get_submodule(n).weight.detach().clone()
        hess, _ = torchforge.gptq.accumulate_hessian(xs[n], w.shape[1])
        want[n] = torchforge.gptq.solve_batched(w[None], hess[None], group_size=32).dequantize()[0]
    recipe = {**RECIPE, "ignore": [r"re:model\.layers\.0\..*", "lm_head"]}
    torchforge.quantize(model, recipe, calib_data=ids)  # sequential (the default)
    for n in names:
        assert torch.equal(layer.get_submodule(n).dequantized_weight(), want[n]), n


def test_layer_calls_are_captured_when_the_loop_needs_real_layer_outputs():
    """The capture forward skips the layers (each returns its input); a loop that unpacks a layer's tuple cannot take
    that, and the layers then run. Either way each layer's own keyword arguments are kept and an instance `forward`
    (accelerate's hooks set one) is left in place."""
    from torchforge.gptq.calibrate import _capture_layer_calls

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, h, scale=1.0):
            return self.lin(h) * scale, None

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList([Layer() for _ in range(3)])

        def forward(self, input_ids, use_cache=False):
            h = self.emb(input_ids)
            for i, layer in enumerate(self.layers):
                h, _ = layer(h, scale=i + 1)  # a [4, ...] tensor cannot be unpacked in two
            return h

    model = Model()
    bound = model.layers[1].forward
    model.layers[1].forward = bound
    ids = torch.randint(0, 16, (4, 5))
    with torch.no_grad():
        hidden, calls = _capture_layer_calls(model, "layers", model.layers, [{"input_ids": ids}], torch.device("cpu"))
        assert torch.equal(hidden[0], model.emb(ids))
    assert calls[0] == [((None,), {"scale": 1}), ((None,), {"scale": 2}), ((None,), {"scale": 3})]
    assert model.layers[1].__dict__["forward"] is bound and "forward" not in model.layers[0].__dict__


def test_asymmetric_zero_point_0_keeps_the_layer_as_true_zero_points(tmp_path):
    """Asymmetric GPTQ on a layer whose groups have no negative weight: their zero point is 0, which GPTQ v1 qzeros
    (z - 1 in 4 bits) cannot hold, and quantize used to fail half way (layers before it already swapped). The layer
    becomes a ForgeAWQLinear with the solver's codes, scales and true zero points; vllm-gptq refuses it by name, and
    compressed-tensors writes and reads it back with the same logits."""
    from torchforge.nn.awq_linear import ForgeAWQLinear
    from torchforge.ops import awq_unpack

    model = models.build("llama")
    name = "model.layers.0.mlp.up_proj"
    with torch.no_grad():
        model.get_submodule(name).weight.abs_()
    w = model.get_submodule(name).weight.detach().clone()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    torchforge.quantize(model, {**RECIPE, "symmetric": False}, calib_data=ids)
    mod = model.get_submodule(name)
    assert isinstance(mod, ForgeAWQLinear)
    assert isinstance(model.get_submodule("model.layers.0.mlp.down_proj"), ForgeGPTQLinear)
    assert (awq_unpack(mod.qzeros) == 0).any()
    w_hat = awq_dequantize(mod.qweight, mod.scales.float(), mod.qzeros, 32)
    assert float((w_hat - w).norm() / w.norm()) < 0.1  # 4-bit codes on the layer's own grid
    assert _logit_err(model, ref, ids) < 0.3
    with pytest.raises(ValueError, match=re.escape(name)):
        torchforge.save_quantized(model, str(tmp_path / "g"), format="vllm-gptq")
    torchforge.save_quantized(model, str(tmp_path / "ct"), format="compressed-tensors", dtype=torch.float32)
    loaded = torchforge.load_quantized(str(tmp_path / "ct"), dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.float()(ids).logits)
