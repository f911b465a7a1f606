import json
import os
import shutil
import tempfile
import unittest

import pytest
import safetensors
import torch

from torchforge.io import CheckpointError, format_inspect_report, inspect_checkpoint, save_sharded

try:  # in the [test] extra; the GPU machines may lack it, which should skip one class, not this file
    import expecttest
except ImportError:
    expecttest = None

AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _awq_checkpoint(path, with_g_idx=False):
    sd = {}
    for i in range(2):
        p = f"model.layers.{i}.mlp.down_proj."
        sd[p + "qweight"] = torch.zeros(256, 64, dtype=torch.int32)  # [IC, OC / 8]
        sd[p + "qzeros"] = torch.zeros(2, 64, dtype=torch.int32)
        sd[p + "scales"] = torch.ones(2, 512, dtype=torch.float16)
        if with_g_idx:
            sd[p + "g_idx"] = torch.zeros(256, dtype=torch.int32)
    sd["model.norm.weight"] = torch.ones(512, dtype=torch.bfloat16)
    save_sharded(sd, path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "quantization_config": AWQ_CONFIG}, f)
    return sd


def test_inspect_awq(tmp_path, monkeypatch):
    _awq_checkpoint(tmp_path)

    def no_reads(*a, **kw):
        raise AssertionError("inspect must read headers only")

    monkeypatch.setattr(safetensors, "safe_open", no_reads)
    s = inspect_checkpoint(tmp_path)
    assert s["formats"] == ["awq"]
    assert s["quantization_config"] == AWQ_CONFIG
    assert s["layout"] == "safetensors" and s["index_file"] is None
    assert s["files"] == [{"name": "model.safetensors", "bytes": os.path.getsize(tmp_path / "model.safetensors")}]
    assert s["total_bytes"] == os.path.getsize(tmp_path / "model.safetensors")
    assert s["num_tensors"] == 7
    assert s["dtypes"] == {
        "int32": {"count": 4, "bytes": 2 * (256 * 64 + 2 * 64) * 4},
        "float16": {"count": 2, "bytes": 2 * 2 * 512 * 2},
        "bfloat16": {"count": 1, "bytes": 1024},
    }
    assert s["tensor_bytes"] == sum(d["bytes"] for d in s["dtypes"].values())
    assert s["tensors"][0] == ("model.layers.0.mlp.down_proj.qweight", "int32", (256, 64), 65536)
    assert [t[0] for t in s["tensors"]][-1] == "model.norm.weight"


def test_inspect_gptq_is_not_awq(tmp_path):
    _awq_checkpoint(tmp_path, with_g_idx=True)
    assert inspect_checkpoint(tmp_path)["formats"] == ["gptq"]


def test_inspect_fp8_block_sharded(tmp_path):
    sd = {}
    for i in range(3):
        sd[f"model.layers.{i}.mlp.gate_proj.weight"] = torch.zeros(300, 200).to(torch.float8_e4m3fn)
        sd[f"model.layers.{i}.mlp.gate_proj.weight_scale_inv"] = torch.ones(3, 2)
    sd["model.embed_tokens.weight"] = torch.zeros(10, 200, dtype=torch.bfloat16)
    save_sharded(sd, tmp_path, max_shard_bytes=70000)
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    s = inspect_checkpoint(tmp_path)
    assert s["formats"] == ["fp8-block"]
    assert s["quantization_config"] == qc
    assert s["index_file"] == "model.safetensors.index.json" and len(s["files"]) == 3
    assert s["total_bytes"] == sum(os.path.getsize(tmp_path / f["name"]) for f in s["files"])
    assert s["dtypes"]["float8_e4m3fn"] == {"count": 3, "bytes": 3 * 60000}
    assert s["dtypes"]["float32"] == {"count": 3, "bytes": 3 * 24}
    assert [t[0] for t in s["tensors"]] == sorted(sd)


def test_other_formats_and_natural_order(tmp_path):
    sd = {
        "model.layers.10.mlp.weight_packed": torch.zeros(4, dtype=torch.int32),
        "model.layers.2.mlp.weight": torch.zeros(4, 4, dtype=torch.uint8),
        "model.layers.2.mlp.weight_scale": torch.zeros(4, 1).to(torch.float8_e4m3fn),
        "model.layers.2.mlp.weight_scale_2": torch.ones(()),
        "model.layers.3.o.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn),
        "model.layers.3.o.weight_scale": torch.ones(()),
    }
    save_sharded(sd, tmp_path)
    s = inspect_checkpoint(tmp_path)
    assert s["formats"] == ["nvfp4", "compressed-tensors", "fp8"]
    assert [t[0] for t in s["tensors"]] == [
        "model.layers.2.mlp.weight",
        "model.layers.2.mlp.weight_scale",
        "model.layers.2.mlp.weight_scale_2",
        "model.layers.3.o.weight",
        "model.layers.3.o.weight_scale",
        "model.layers.10.mlp.weight_packed",
    ]
    assert s["tensors"][2] == ("model.layers.2.mlp.weight_scale_2", "float32", (), 4)


def test_inspect_bin_and_errors(tmp_path):
    torch.save({"a": torch.zeros(3, 4, dtype=torch.float16)}, tmp_path / "pytorch_model.bin")
    s = inspect_checkpoint(tmp_path)
    assert s["layout"] == "pytorch-bin" and s["tensors"] == [("a", "float16", (3, 4), 24)]
    with pytest.raises(CheckpointError, match="does not exist"):
        inspect_checkpoint(tmp_path / "missing")
    save_sharded({"x": torch.zeros(100)}, tmp_path / "st")
    path = tmp_path / "st" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"tensor 'x' needs data bytes \[0, 400\) but the file holds only 392"):
        inspect_checkpoint(tmp_path / "st")


@unittest.skipIf(expecttest is None, "expecttest is not installed")
class TestReport(expecttest.TestCase if expecttest is not None else unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)
        sd = {
            "model.embed_tokens.weight": torch.zeros(1000, 64, dtype=torch.bfloat16),
            "model.layers.0.mlp.down_proj.weight": torch.zeros(300, 200).to(torch.float8_e4m3fn),
            "model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(3, 2),
            "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
            "model.layers.1.mlp.down_proj.weight": torch.zeros(300, 200).to(torch.float8_e4m3fn),
            "model.layers.1.mlp.down_proj.weight_scale_inv": torch.ones(3, 2),
            "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),
        }
        save_sharded(sd, self.dir, max_shard_bytes=100_000)
        qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump({"quantization_config": qc}, f)

    def report(self, **kw):
        return format_inspect_report(inspect_checkpoint(self.dir), **kw).replace(os.path.abspath(self.dir), "<dir>")

    def test_report(self):
        self.assertExpectedInline(
            self.report(),
            """\
checkpoint  <dir>
layout      safetensors, 3 shards (index model.safetensors.index.json)
size        243.3 KiB on disk, 7 tensors, 242.5 KiB of tensor data
formats     fp8-block
quant cfg   {"fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

dtype          tensors      bytes
bfloat16             3  125.2 KiB
float8_e4m3fn        2  117.2 KiB
float32              2       48 B

name                                           dtype          shape           bytes
model.embed_tokens.weight                      bfloat16       [1000, 64]  125.0 KiB
model.layers.0.input_layernorm.weight          bfloat16       [64]            128 B
model.layers.0.mlp.down_proj.weight            float8_e4m3fn  [300, 200]   58.6 KiB
model.layers.0.mlp.down_proj.weight_scale_inv  float32        [3, 2]           24 B
model.layers.1.mlp.down_proj.weight            float8_e4m3fn  [300, 200]   58.6 KiB
model.layers.1.mlp.down_proj.weight_scale_inv  float32        [3, 2]           24 B
model.norm.weight                              bfloat16       [64]            128 B
""",
        )

    def test_report_truncated(self):
        self.assertExpectedInline(self.report(max_rows=2).split("\n\n")[-1], """\
name                                   dtype     shape           bytes
model.embed_tokens.weight              bfloat16  [1000, 64]  125.0 KiB
model.layers.0.input_layernorm.weight  bfloat16  [64]            128 B
... 5 more tensors (showing 2 of 7)
""")
