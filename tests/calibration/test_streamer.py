"""LayerwiseStreamer against collect_router_stats on the whole model, its approximate mode, activation offload,
one layer at a time, and its errors."""
import os
import time
import warnings

import pytest
import torch

from tests import models
from torchforge.calibration import LayerwiseStreamer, RouterStats, activations, collect_router_stats, layer_loader
from torchforge.io import CheckpointError
from torchforge.testing import make_checkpoint

TINY = dict(num_layers=3, hidden_size=64, n_routed_experts=8, moe_intermediate_size=32, vocab_size=96)


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2, 6), generator=g), torch.randint(0, 96, (1, 9), generator=g)]


def _reference(path, dtype=torch.float32):
    """The whole model in memory: transformers' own loader, or for FP8 iter_checkpoint's dequantization."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchforge.export.load import _rebuild_rotary, _stack_experts
    from torchforge.export.naming import EXPERT_KEY, from_checkpoint_name
    from torchforge.io import iter_checkpoint

    cfg = AutoConfig.from_pretrained(path)
    if not hasattr(cfg, "quantization_config"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    del cfg.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    state, per_expert = {}, {}
    for name, t in iter_checkpoint(path, dequantize_fp8=True, dtype=dtype):
        name = from_checkpoint_name(name, cfg.model_type)
        m = EXPERT_KEY.match(name)
        if m:
            per_expert.setdefault(m["module"], {})[(int(m["e"]), m["proj"], m["kind"])] = t
        else:
            state[name] = t
    state.update(_stack_experts(model, per_expert))
    model.load_state_dict(state, strict=True, assign=True)
    _rebuild_rotary(model, "cpu")  # inv_freq is not in checkpoints
    return model


def _assert_same(a: RouterStats, b: RouterStats):
    assert a.layers == b.layers and a.tokens == b.tokens
    torch.testing.assert_close(a.hit_map, b.hit_map, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.topk_counts, b.topk_counts)
    torch.testing.assert_close(a.routed_weight, b.routed_weight, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "deepseek_v3": make_checkpoint(root / "ds", "deepseek_v3", shard_size_bytes=60_000, **TINY),
        "deepseek_v3_fp8": make_checkpoint(root / "ds8", "deepseek_v3", fp8=True, shard_size_bytes=300_000,
                                           **dict(TINY, hidden_size=256, moe_intermediate_size=160)),
        "qwen3_moe": make_checkpoint(root / "qw", "qwen3_moe", shard_size_bytes=60_000, **TINY),
        "mixtral": make_checkpoint(root / "mx", "mixtral", **TINY),
    }


@pytest.mark.parametrize("name,prob", [("deepseek_v3", "sigmoid"), ("deepseek_v3_fp8", "sigmoid"),
                                       ("qwen3_moe", "softmax"), ("mixtral", "softmax")])
def test_exact_mode_equals_whole_model(ckpts, name, prob):
    stats = LayerwiseStreamer(ckpts[name], dtype=torch.float32, device="cpu").collect_router_stats(_batches())
    ref = collect_router_stats(_reference(ckpts[name]), _batches())
    _assert_same(stats, ref)
    assert stats.settings["prob"] == prob and stats.settings["mode"] == "exact" and stats.tokens == 21
    dense = 1 if name.startswith("deepseek") else 0  # first_k_dense_replace=1: no row for layer 0
    assert stats.hit_map.shape == (3 - dense, 8) and stats.layers[0] == f"model.layers.{dense}.mlp.gate"
    if prob == "softmax":  # softmax rows sum to one per token; sigmoid mass is not normalized
        torch.testing.assert_close(stats.hit_map.sum(1), torch.full((3 - dense,), 21.0))


def test_mask_functions_get_the_cache_argument_by_its_current_name(ckpts):
    """transformers 5.24 renamed the mask functions' past_key_values to cache (the old name is renamed with a
    FutureWarning until the shim goes): the streamer passes whichever name the installed version takes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
        stats = LayerwiseStreamer(ckpts["deepseek_v3"], dtype=torch.float32, device="cpu").collect_router_stats(
            _batches())
    assert stats.tokens == 21


def test_bf16_compute_and_saved_settings(ckpts, tmp_path):
    streamer = LayerwiseStreamer(ckpts["deepseek_v3"], device="cpu")  # bf16 by default
    stats = streamer.collect_router_stats(_batches(), max_tokens=12)
    assert stats.tokens == 12  # the second batch is not used
    ref = collect_router_stats(_reference(ckpts["deepseek_v3"], torch.bfloat16), _batches()[:1])
    _assert_same(stats, ref)
    again = RouterStats.load(stats.save(str(tmp_path / "s.pt")))
    assert torch.equal(again.hit_map, stats.hit_map) and again.tokens == 12
    assert again.settings["router_attr"] == "mlp.gate" and again.settings["dtype"] == "torch.bfloat16"


def test_approx_mode_differs_but_has_the_same_shape(ckpts):
    streamer = LayerwiseStreamer(ckpts["deepseek_v3"], dtype=torch.float32, device="cpu")
    exact = streamer.collect_router_stats(_batches())
    approx = streamer.collect_router_stats(_batches(), mode="approx")
    assert approx.settings["mode"] == "approx" and approx.tokens == exact.tokens
    assert approx.hit_map.shape == exact.hit_map.shape and approx.layers == exact.layers
    # the first MoE layer sees the same input either way; later ones do not
    torch.testing.assert_close(approx.hit_map[0], exact.hit_map[0])
    assert not torch.allclose(approx.hit_map[1], exact.hit_map[1])
    assert torch.equal(approx.topk_counts.sum(1), exact.topk_counts.sum(1))


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])  # with and without shared experts
def test_approx_equals_exact_when_routed_experts_are_zero(tmp_path, arch):
    model = models.build(arch, num_hidden_layers=3)
    for block in models.moe_blocks(model):
        for p in block[1].experts.parameters():
            p.data.zero_()
    model.save_pretrained(tmp_path)  # transformers' own checkpoint layout
    streamer = LayerwiseStreamer(tmp_path, dtype=torch.float32, device="cpu")
    exact = streamer.collect_router_stats(_batches())
    _assert_same(streamer.collect_router_stats(_batches(), mode="approx"), exact)
    _assert_same(exact, collect_router_stats(model, _batches()))


def test_offload_spills_and_cleans_up(ckpts, tmp_path, monkeypatch):
    path = ckpts["qwen3_moe"]
    plain = LayerwiseStreamer(path, dtype=torch.float32, device="cpu")
    ref = plain.collect_router_stats(_batches())
    assert plain.spills == 0

    seen = []
    original = activations.ActivationStore.get

    def spy(self, batch):
        seen.append(sorted(os.listdir(self._dir_path)) if self._dir_path else [])
        if self._dir_path and self.offload_dir:  # its own folder inside offload_dir
            assert os.path.dirname(self._dir_path) == str(offload)
        return original(self, batch)

    monkeypatch.setattr(activations.ActivationStore, "get", spy)
    offload = tmp_path / "nvme"
    offload.mkdir()
    chunk = 2 * 6 * 64 * 4  # the first batch's hidden states fit (with room for one in flight), the second does not
    streamer = LayerwiseStreamer(path, offload, dtype=torch.float32, device="cpu", host_budget_bytes=2 * chunk)
    stats = streamer.collect_router_stats(_batches())
    assert torch.equal(stats.hit_map, ref.hit_map) and torch.equal(stats.topk_counts, ref.topk_counts)
    assert streamer.spills == 7  # batch 1, after the embedding and after both halves of each of the three layers
    assert ["hs_layer_0_batch_1.pt"] in seen and ["hs_layer_2_batch_1.pt"] in seen
    assert ["hs_layer_2_mid_batch_1.pt"] in seen  # between layer 2's attention and MLP stages
    assert os.listdir(offload) == []
    assert streamer.max_chunk_bytes == chunk and streamer.peak_host_activation_bytes <= 2 * chunk  # within budget

    # no offload_dir: a temporary folder, removed afterwards
    made = []
    real_mkdtemp = activations.tempfile.mkdtemp
    monkeypatch.setattr(activations.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    streamer = LayerwiseStreamer(path, dtype=torch.float32, device="cpu", host_budget_bytes=0)
    assert torch.equal(streamer.collect_router_stats(_batches()).hit_map, ref.hit_map)
    assert streamer.spills == 14 and len(made) == 1 and not os.path.exists(made[0])


def test_budget_holds_when_a_larger_batch_comes_last(ckpts, tmp_path):
    # the streamer reserves room for the largest batch before the first is stored; the store alone learnt it only
    # when it came, after smaller batches had been kept by their own size (peak 10240 against a budget of 9000)
    batches = [torch.randint(0, 96, (1, 10)), torch.randint(0, 96, (1, 10)), torch.randint(0, 96, (1, 20))]
    streamer = LayerwiseStreamer(ckpts["qwen3_moe"], tmp_path / "off", dtype=torch.float32, device="cpu",
                                 host_budget_bytes=9000)
    stats = streamer.collect_router_stats(batches)
    assert streamer.max_chunk_bytes == 20 * 64 * 4 and streamer.spills > 0
    assert streamer.peak_host_activation_bytes <= 9000
    ref = LayerwiseStreamer(ckpts["qwen3_moe"], dtype=torch.float32, device="cpu").collect_router_stats(batches)
    assert torch.equal(stats.hit_map, ref.hit_map)


def test_failed_spill_leaves_no_file_and_says_what_to_do(tmp_path, monkeypatch):
    def torch_save_on_a_full_disk(obj, path):  # torch.save's writer fails as a RuntimeError, a part written
        with open(path, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(activations.torch, "save", torch_save_on_a_full_disk)
    store = activations.ActivationStore(0, tmp_path / "off")
    with pytest.raises(OSError, match="cannot spill hidden states to .*hs_layer_3_batch_0.pt: .*free space there"):
        store.put(0, torch.zeros(100), layer=3)
    assert [files for _, _, files in os.walk(tmp_path / "off")] == [[], []]  # offload_dir and the store's folder
    store.close()
    assert not os.path.exists(tmp_path / "off")  # made by the store, left empty: removed


def test_one_layer_materialized_at_a_time(ckpts, monkeypatch):
    streamer = LayerwiseStreamer(ckpts["deepseek_v3"], dtype=torch.float32, device="cpu")

    def on_meta(i):
        return [j for j, layer in enumerate(streamer.decoder_layers)
                if j != i and any(t.device.type != "meta" for t in layer.state_dict().values())]

    for i, layer in streamer.layers():
        assert on_meta(i) == [] and all(t.device.type == "cpu" for t in layer.state_dict().values())
    assert on_meta(-1) == []
    for i, layer in streamer.layers():
        break  # a caller that stops early: the layer is freed all the same
    del layer
    assert on_meta(-1) == []
    for i, layer in streamer.layers(routed_experts=False):  # what approx mode loads
        if i > 0:
            assert layer.mlp.experts.gate_up_proj.device.type == "meta"
            assert layer.mlp.shared_experts.up_proj.weight.device.type == "cpu"

    # the next layer is read from disk while the caller works on the current one
    events, read = [], streamer._read
    monkeypatch.setattr(streamer, "_read", lambda i, skip: events.append(("read", i)) or read(i, skip))
    for i, layer in streamer.layers():
        time.sleep(0.05)
        events.append(("done", i))
    assert events.index(("read", 1)) < events.index(("done", 0))
    assert events.index(("read", 2)) < events.index(("done", 1))

    # and the same inside collect_router_stats, whose layers come from the same generator
    counts = []
    real = layer_loader.materialize
    monkeypatch.setattr(layer_loader, "materialize", lambda m, *a: counts.append(len(on_meta(-1))) or real(m, *a))
    on_device = []
    real_run = streamer._run_layer

    def run(i, stage, layer, *a):
        halves = {n: any(t.device.type != "meta" for t in getattr(layer, n).state_dict().values())
                  for n in ("self_attn", "mlp")}
        on_device.append((i, stage, sorted(n for n, v in halves.items() if v)))
        return real_run(i, stage, layer, *a)

    monkeypatch.setattr(streamer, "_run_layer", run)
    streamer.collect_router_stats(_batches(), mode="approx")
    assert counts == [0] * 7  # the embedding, then both halves of three layers, each with nothing else materialized
    assert on_device == [(i, s, [h]) for i in range(3) for s, h in (("attn", "self_attn"), ("mlp", "mlp"))]
    assert streamer.largest_layer_bytes > streamer.largest_stage_bytes > 0 and len(streamer.layer_seconds) == 3


def test_errors_name_the_fix(ckpts, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        LayerwiseStreamer(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(ckpts["qwen3_moe"]):
        os.symlink(os.path.join(ckpts["qwen3_moe"], f), broken / f)
    shard = sorted(f for f in os.listdir(broken) if f.endswith(".safetensors"))[1]
    os.unlink(broken / shard)
    with pytest.raises(CheckpointError, match=f"{shard} .*missing.*download"):
        LayerwiseStreamer(broken)
    models.build("llama").save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="model_type 'llama'.*pass router_attr="):
        LayerwiseStreamer(tmp_path / "llama")
    with pytest.raises(ValueError, match="no decoder layer .* 'mlp.router'"):
        LayerwiseStreamer(ckpts["qwen3_moe"], router_attr="mlp.router", prob="softmax")
    with pytest.raises(ValueError, match="mode must be one of"):
        LayerwiseStreamer(ckpts["qwen3_moe"], device="cpu").collect_router_stats(_batches(), mode="sparse")
    # offload_dir is checked when the streamer is made, not at the first spill after some layers ran
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError, match="offload_dir .*a_file.* cannot be used for spilled hidden states"):
        LayerwiseStreamer(ckpts["qwen3_moe"], tmp_path / "a_file", device="cpu", host_budget_bytes=0)
    with pytest.warns(UserWarning, match="offload_dir without host_budget_bytes is never used"):
        LayerwiseStreamer(ckpts["qwen3_moe"], tmp_path / "spill", device="cpu")


def test_router_attr_override(ckpts):
    streamer = LayerwiseStreamer(ckpts["qwen3_moe"], dtype=torch.float32, device="cpu", router_attr="mlp.gate",
                                 prob="sigmoid")
    stats = streamer.collect_router_stats(_batches())
    ref = collect_router_stats(_reference(ckpts["qwen3_moe"]), _batches(), router_attr="mlp.gate", prob="sigmoid")
    _assert_same(stats, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_fp8"])
def test_cuda_matches_cpu_and_frees_every_layer(ckpts, name):
    cpu = LayerwiseStreamer(ckpts[name], dtype=torch.float32, device="cpu").collect_router_stats(_batches())
    streamer = LayerwiseStreamer(ckpts[name], dtype=torch.float32, device="cuda")
    streamer.collect_router_stats(_batches())  # warm-up: cuBLAS / cuBLASLt workspaces stay allocated after it
    for mode in ("exact", "approx"):
        before = torch.cuda.memory_allocated()
        stats = streamer.collect_router_stats(_batches(), mode=mode)
        if mode == "exact":
            torch.testing.assert_close(stats.hit_map, cpu.hit_map, rtol=1e-4, atol=1e-4)
            assert torch.equal(stats.topk_counts.sum(1), cpu.topk_counts.sum(1))
        assert streamer.peak_gpu_bytes > 0
        assert torch.cuda.memory_allocated() - before < streamer.largest_layer_bytes  # the last layer was freed


@pytest.mark.cuda
def test_cuda_peak_memory_does_not_grow_with_depth(tmp_path):
    """One layer at a time: a checkpoint with twice the layers has the same peak GPU memory."""
    paths = {n: make_checkpoint(tmp_path / f"l{n}", "deepseek_v3", **dict(TINY, num_layers=n)) for n in (2, 4)}
    LayerwiseStreamer(paths[2], device="cuda").collect_router_stats(_batches())  # cuBLAS workspaces, caches
    peaks = {}
    for n, path in paths.items():
        streamer = LayerwiseStreamer(path, device="cuda")
        streamer.collect_router_stats(_batches())
        peaks[n] = streamer.peak_gpu_bytes
        assert peaks[n] >= streamer.largest_layer_bytes
    assert peaks[4] <= peaks[2] + 2**16, peaks


@pytest.mark.slow
def test_bench_tiny_runs(tmp_path):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "streamer_memory.py"), "--tiny", "--json", str(out),
                        "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["exact (whole layers)", "exact", "approx"]
    assert all(row["spills"] > 0 for row in rows)
    assert rows[2]["layer_bytes"] < rows[1]["layer_bytes"] == rows[0]["layer_bytes"]  # approx never loads the experts
    assert rows[1]["stage_bytes"] < rows[0]["stage_bytes"] == rows[0]["layer_bytes"]  # split: never a whole layer
    assert os.listdir(tmp_path) == ["b.json"]  # checkpoint and spill folder removed


def test_exact_mode_token_chunks_give_the_same_stats(ckpts):
    """MoE blocks run on a few tokens at a time (a small working set) compute what whole batches compute."""
    whole = LayerwiseStreamer(ckpts["deepseek_v3"], dtype=torch.float32, device="cpu", moe_chunk_tokens=None)
    parts = LayerwiseStreamer(ckpts["deepseek_v3"], dtype=torch.float32, device="cpu", moe_chunk_tokens=4)
    a, b = whole.collect_router_stats(_batches()), parts.collect_router_stats(_batches())
    torch.testing.assert_close(b.hit_map, a.hit_map, rtol=1e-5, atol=1e-5)
    assert torch.equal(b.topk_counts, a.topk_counts) and b.tokens == a.tokens
    with pytest.raises(ValueError, match="moe_chunk_tokens must be >= 1"):
        LayerwiseStreamer(ckpts["deepseek_v3"], device="cpu", moe_chunk_tokens=0)


@pytest.mark.parametrize("name", ["deepseek_v3", "mixtral"])
def test_split_layers_compute_what_whole_layers_compute(ckpts, name):
    """Attention then MLP as separate stages, each with the other half stubbed to zero: the same hidden states
    (adding a zero is exact), so the same statistics to the bit."""
    split = LayerwiseStreamer(ckpts[name], dtype=torch.float32, device="cpu")
    whole = LayerwiseStreamer(ckpts[name], dtype=torch.float32, device="cpu", split_layers=False)
    assert split.split_layers and not whole.split_layers
    for mode in ("exact", "approx"):
        a, b = split.collect_router_stats(_batches(), mode=mode), whole.collect_router_stats(_batches(), mode=mode)
        assert torch.equal(a.hit_map, b.hit_map) and torch.equal(a.topk_counts, b.topk_counts)
        assert torch.equal(a.routed_weight, b.routed_weight)
        assert split.largest_layer_bytes == whole.largest_layer_bytes == whole.largest_stage_bytes
        assert split.largest_stage_bytes < split.largest_layer_bytes
    # an architecture whose attention module has another name: no split by default, a clear error if asked for
    split.decoder_layers[1].attention = split.decoder_layers[1].self_attn
    del split.decoder_layers[1].self_attn
    assert split._resolve_split(None) is False
    with pytest.raises(ValueError, match="split_layers=True needs .*'self_attn'.*pass split_layers=False"):
        split._resolve_split(True)


def _padded(side: str, seed=0):
    """Two batches of a tokenizer's padded output (pad id 0, mask 0): a full row beside a row of 4 real tokens
    padded to 10 on `side`, and a batch whose mask has no padding; with the 24 real tokens as unpadded rows."""
    from transformers import BatchEncoding

    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randint(1, 96, shape, generator=g) for shape in ((1, 10), (1, 4), (2, 5)))
    pad, real = torch.zeros(1, 6, dtype=torch.long), torch.ones_like(b)
    row, mask = (torch.cat([b, pad], 1), torch.cat([real, pad], 1)) if side == "right" else \
        (torch.cat([pad, b], 1), torch.cat([pad, real], 1))
    first = BatchEncoding({"input_ids": torch.cat([a, row]), "attention_mask": torch.cat([torch.ones_like(a), mask])})
    padded = [first, {"input_ids": c, "attention_mask": torch.ones_like(c)}]
    return padded, [a, b, c]


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_exact_mode_with_padding_equals_whole_model(ckpts, name, side):
    """A tokenizer's padded batches: the streamer masks padding in attention as the whole model does (its own
    create_causal_mask, generate()'s positions) and leaves it out of the statistics, so it equals
    collect_router_stats on the whole model, and both equal the real tokens run unpadded."""
    padded, unpadded = _padded(side)
    streamer = LayerwiseStreamer(ckpts[name], dtype=torch.float32, device="cpu", moe_chunk_tokens=7)
    stats = streamer.collect_router_stats(padded)
    model = _reference(ckpts[name])
    _assert_same(stats, collect_router_stats(model, padded))
    assert stats.tokens == 10 + 4 + 10
    _assert_same(stats, collect_router_stats(model, unpadded))
    # max_tokens counts real tokens: the first batch's 14 reach 14, the second batch is not used
    assert streamer.collect_router_stats(padded, max_tokens=14).tokens == 14


@pytest.mark.parametrize("side", ["right", "left"])
def test_approx_mode_leaves_padding_out(ckpts, side):
    """Padding was counted (tokens, picks, mass) and, left-padded, shifted the real tokens' positions and let them
    attend to padding: approx statistics of padded batches now equal those of the real tokens unpadded."""
    padded, unpadded = _padded(side)
    streamer = LayerwiseStreamer(ckpts["deepseek_v3"], dtype=torch.float32, device="cpu")
    got = streamer.collect_router_stats(padded, mode="approx")
    ref = streamer.collect_router_stats(unpadded, mode="approx")
    _assert_same(got, ref)
    assert got.tokens == 24 and int(got.topk_counts.sum(1)[0]) == 24 * streamer.config.num_experts_per_tok


def test_bad_attention_mask_is_refused(ckpts):
    streamer = LayerwiseStreamer(ckpts["qwen3_moe"], dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 96, (2, 4))
    bad = {
        "attention_mask has shape \\(2, 3\\), input_ids \\(2, 4\\)": torch.ones(2, 3, dtype=torch.long),
        "attention_mask must hold 0 \\(padding\\) and 1 \\(real token\\) only, got values \\[0, 1, 2\\]":
            torch.tensor([[1, 1, 2, 0], [1, 1, 1, 1]]),
        "attention_mask rows \\[1\\] have no real token": torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]),
    }
    for match, mask in bad.items():
        with pytest.raises(ValueError, match="LayerwiseStreamer: " + match):
            streamer.collect_router_stats([{"input_ids": ids, "attention_mask": mask}])
    with pytest.raises(TypeError, match="LayerwiseStreamer: batches must yield integer input_ids tensors"):
        streamer.collect_router_stats([torch.randint(0, 96, (8,))])
    with pytest.raises(TypeError, match="LayerwiseStreamer: a batch mapping needs 'input_ids'"):
        streamer.collect_router_stats([{"attention_mask": torch.ones(1, 4)}])


@pytest.mark.parametrize("name", ["deepseek_v3", "mixtral"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_layers_get_the_whole_models_mask_and_positions(ckpts, name, side):
    """Every decoder layer gets the attention mask, position ids and rotary embedding the whole model gives it.
    (The statistics alone cannot tell: RoPE sees relative positions only, and without a mask transformers reads
    left-padded positions as packed sequences, which masks padding too; neither holds for every model.)"""
    padded, _ = _padded(side)

    def spy(layers):
        seen = {i: [] for i in range(len(layers))}
        hooks = [layer.register_forward_pre_hook(
            lambda m, args, kw, i=i: seen[i].append((kw["attention_mask"], kw["position_ids"],
                                                     kw["position_embeddings"]))
            if kw.get("position_embeddings") is not None else None, with_kwargs=True)
            for i, layer in enumerate(layers)]
        return seen, hooks

    model = _reference(ckpts[name])
    want, hooks = spy(model.model.layers)
    collect_router_stats(model, padded)
    streamer = LayerwiseStreamer(ckpts[name], dtype=torch.float32, device="cpu")
    got, hooks2 = spy(streamer.decoder_layers)
    streamer.collect_router_stats(padded)
    for h in hooks + hooks2:
        h.remove()
    assert want[0][0][0] is not None and want[0][0][0].dim() == 4  # the padded batch has a 4-D mask
    for i in want:
        assert len(got[i]) == len(want[i]) == 2
        for (m1, p1, (cos1, sin1)), (m2, p2, (cos2, sin2)) in zip(got[i], want[i]):
            assert (m1 is None and m2 is None) or torch.equal(m1, m2)
            assert torch.equal(p1.expand_as(p2), p2) and torch.equal(cos1, cos2) and torch.equal(sin1, sin2)


def test_streamed_dequantization_refuses_integer_and_nan_scales():
    """layer_loader multiplies by scale.float(): ue8m0 exponents stored as raw uint8 bytes (127 for 2**0) came out
    127x too large, and NaN/Inf scales as NaN/Inf weights, with no error."""
    w = torch.ones(200, 300).to(torch.float8_e4m3fn)
    dest = torch.empty(200, 300)
    with pytest.raises(CheckpointError, match=r"'x\.weight_scale_inv' of /ckpt cannot dequantize 'x\.weight': "
                                              r"scale_inv must be a floating tensor .* got torch\.uint8"):
        layer_loader._dequantize_into(dest, w, torch.full((2, 3), 127, dtype=torch.uint8), (128, 128), "x.weight",
                                      "/ckpt")
    scale = torch.ones(2, 3)
    scale[1, 2] = float("inf")
    with pytest.raises(CheckpointError, match=r"'x\.weight_scale_inv' of /ckpt .*1 NaN/Inf entries of 6 \(the first "
                                              r"at block \[1, 2\]\)"):
        layer_loader._dequantize_into(dest, w, scale, (128, 128), "x.weight", "/ckpt")
    layer_loader._dequantize_into(dest, w, torch.full((2, 3), 2.0), (128, 128), "x.weight", "/ckpt")
    assert torch.equal(dest, torch.full((200, 300), 2.0))


def test_two_stores_sharing_an_offload_dir_keep_their_own_files(tmp_path):
    # the spill names (hs_layer_{l}_batch_{b}.pt) are the same in every run: two streamers with one offload_dir used
    # to overwrite each other's hidden states, and the first to close deleted the other's
    shared = tmp_path / "nvme"
    shared.mkdir()
    a, b = activations.ActivationStore(0, shared), activations.ActivationStore(0, shared)
    a.put(0, torch.zeros(8), layer=1)
    b.put(0, torch.ones(8), layer=1)
    assert torch.equal(a.get(0), torch.zeros(8)) and torch.equal(b.get(0), torch.ones(8))
    a.close()
    assert torch.equal(b.get(0), torch.ones(8))
    b.close()
    assert os.listdir(shared) == []  # a folder the user made stays, emptied
