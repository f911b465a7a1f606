"""The `torchforge` command line: demo end to end, inspect on an exported folder, errors as exit codes."""
import torch

import torchforge
from tests import models
from torchforge.cli import main


def test_demo_runs_and_reload_matches(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "out"), "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert "| reload matches            | True |" in table
    assert (tmp_path / "out" / "config.json").is_file()


def test_inspect_reports_awq(tmp_path, capsys):
    model = torchforge.quantize(models.build("qwen3_moe", dtype=torch.bfloat16), {"scheme": "w4a16-rtn", "group_size": 32})
    torchforge.save_quantized(model, str(tmp_path))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "awq" in out and "qweight" in out


def test_inspect_missing_folder_is_an_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "error" in capsys.readouterr().err


def test_plot_hitmap_png(tmp_path, capsys):
    import struct
    import zlib

    hit = torch.tensor([[1.0, 4.0, 2.0, 0.0], [3.0, 3.0, 1.0, 9.0]])
    torch.save({"hit_map": hit}, tmp_path / "hit.pt")
    out = tmp_path / "h.png"
    assert main(["plot-hitmap", str(tmp_path / "hit.pt"), "--out", str(out), "--keep-k", "2", "--cell", "6"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    assert (w, h) == (4 * 6, 2 * 6)
    idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
    rows = zlib.decompress(idat)
    px = lambda r, c: tuple(rows[r * (1 + 3 * w) + 1 + 3 * c: r * (1 + 3 * w) + 4 + 3 * c])  # noqa: E731
    # layer 0 keeps experts 1 (hit 4) and 2 (hit 2): white centre marks; expert 3 (hit 0) unmarked, darkest
    assert px(3, 1 * 6 + 3) == (255, 255, 255) and px(3, 2 * 6 + 3) == (255, 255, 255)
    assert px(3, 3 * 6 + 3) != (255, 255, 255) and px(0, 3 * 6) == (68, 1, 84)
    assert px(0, 1 * 6) == (253, 231, 37)  # the row maximum is the brightest colour


def test_quantize_command_exports_what_the_api_exports(tmp_path):
    """`torchforge quantize SRC OUT --recipe ...` on the trained fixture = torchforge.quantize + save_quantized."""
    import torch

    import torchforge
    from torchforge.cli import main
    from torchforge.testing.tiny_moe import TINY_MOE_DIR, encode, load_text, load_tiny_moe, windows

    recipe = tmp_path / "recipe.yaml"
    torchforge.Recipe.from_dict({"scheme": "w4a16-gptq", "group_size": 64}).to_file(recipe)
    calib = windows(encode(load_text("calib_code")), 128)[:8]
    torch.save(calib, tmp_path / "calib.pt")
    out = tmp_path / "out"
    assert main(["quantize", TINY_MOE_DIR, str(out), "--recipe", str(recipe), "--calib-ids", str(tmp_path / "calib.pt"),
                 "--format", "vllm-gptq", "--device", "cpu"]) == 0
    expected = torchforge.quantize(load_tiny_moe(dtype=torch.bfloat16), torchforge.Recipe.from_file(recipe),
                                   calib_data=calib)
    ids = calib[:2]
    with torch.no_grad():
        assert torch.equal(torchforge.load_quantized(str(out))(ids).logits, expected(ids).logits)
    assert main(["quantize", str(tmp_path / "nowhere"), str(out)]) == 2  # clear error, no traceback
    streamed = tmp_path / "streamed"
    assert main(["quantize", TINY_MOE_DIR, str(streamed), "--recipe", "w4a16-rtn-g64", "--stream", "--device", "cpu"]) == 0
    rtn = torchforge.quantize(load_tiny_moe(dtype=torch.bfloat16), "w4a16-rtn-g64")
    with torch.no_grad():
        assert torch.equal(torchforge.load_quantized(str(streamed))(ids).logits, rtn(ids).logits)
    assert main(["quantize", TINY_MOE_DIR, str(streamed), "--stream", "--device", "cpu"]) == 2  # not over a checkpoint


def test_quantize_command_refuses_what_it_would_ignore_or_crash_on(tmp_path, capsys):
    import pytest

    from torchforge.testing.tiny_moe import TINY_MOE_DIR

    out = str(tmp_path / "out")

    def err(argv):
        assert main(["quantize", TINY_MOE_DIR, out, *argv]) == 2
        return capsys.readouterr().err

    # --stream writes vllm-awq by RTN: another format or calibration ids were silently ignored
    assert "it takes no --format vllm-gptq" in err(["--stream", "--format", "vllm-gptq", "--device", "cpu"])
    torch.save(torch.zeros(2, 8, dtype=torch.long), tmp_path / "ids.pt")
    assert "it takes no --calib-ids" in err(["--stream", "--calib-ids", str(tmp_path / "ids.pt"), "--device", "cpu"])
    # a corrupt --calib-ids file: an error naming it (was a KeyError traceback)
    (tmp_path / "bad.pt").write_bytes(b"not a torch file" * 8)
    assert f"--calib-ids {tmp_path / 'bad.pt'} cannot be read by torch.load" in err(
        ["--calib-ids", str(tmp_path / "bad.pt"), "--device", "cpu"])
    if not torch.cuda.is_available():  # was an AssertionError traceback
        assert "--device cuda: this machine has no CUDA device" in err(["--device", "cuda"])
    with pytest.raises(SystemExit):  # argparse: unknown formats and negative row counts before any work
        main(["quantize", TINY_MOE_DIR, out, "--format", "nonsense"])
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["inspect", TINY_MOE_DIR, "--max-rows", "-1"])
    assert "-1 is negative" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_quantize_command_refuses_damaged_or_overlapping_folders(tmp_path, capsys):
    """OUT = SRC would replace the source's shards; a tensor missing from the source would be exported as
    transformers' random initialisation; a cut shard is named (transformers' own error names no file)."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from torchforge.testing.tiny_moe import TINY_MOE_DIR

    src = tmp_path / "src"
    shutil.copytree(TINY_MOE_DIR, src)
    files = sorted(os.listdir(src))

    def err(source, out, *argv):
        assert main(["quantize", str(source), str(out), "--device", "cpu", *argv]) == 2
        return capsys.readouterr().err

    assert f"OUT {src} is SRC" in err(src, src)
    assert f"OUT {src}/. is SRC" in err(src, f"{src}/.", "--stream")
    assert sorted(os.listdir(src)) == files
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name, shard = next((n, f) for n, f in index["weight_map"].items() if n.endswith("o_proj.weight"))
    state = load_file(src / shard)
    save_file({k: v for k, v in state.items() if k != name}, src / shard, metadata={"format": "pt"})
    assert f"maps '{name}' to {shard}, but that shard does not contain it" in err(src, tmp_path / "out")
    del index["weight_map"][name]  # a consistent folder without the tensor: transformers would make one up
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert f"lacks 1 tensor(s) the model needs ({name}); nothing was written" in err(src, tmp_path / "out")
    data = (src / shard).read_bytes()
    (src / shard).write_bytes(data[: len(data) // 2])
    assert f"{shard}" in err(src, tmp_path / "out")
    # a routed expert missing: transformers' own size-mismatch error, reported as an error (was a traceback)
    src2 = tmp_path / "src2"
    shutil.copytree(TINY_MOE_DIR, src2)
    index = json.loads((src2 / "model.safetensors.index.json").read_text())
    name, shard = next((n, f) for n, f in index["weight_map"].items() if ".experts.3.down_proj" in n)
    state = load_file(src2 / shard)
    save_file({k: v for k, v in state.items() if k != name}, src2 / shard, metadata={"format": "pt"})
    del index["weight_map"][name]
    (src2 / "model.safetensors.index.json").write_text(json.dumps(index))
    message = err(src2, tmp_path / "out")
    assert "lacks 1 tensor(s)" in message or "transformers cannot load this checkpoint" in message
    assert not (tmp_path / "out").exists()


def _no_loading(monkeypatch):
    """from_pretrained that fails the test: the checks below must come before the model is loaded."""
    from transformers import AutoModelForCausalLM

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_quantize_command_checks_format_against_the_recipe_before_loading(tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    models.build("llama", dtype=torch.bfloat16).save_pretrained(src)
    _no_loading(monkeypatch)

    def err(*argv):
        assert main(["quantize", str(src), str(tmp_path / "out"), "--device", "cpu", *argv]) == 2
        return capsys.readouterr().err

    # the recipe's own message, before any loading (was "format ... cannot hold it" after quantizing the model)
    assert "Recipe.export_format: invalid value 'vllm-awq'" in err("--recipe", "nvfp4", "--format", "vllm-awq")
    assert "Recipe.export_format: invalid value 'modelopt-nvfp4'" in err("--format", "modelopt-nvfp4")
    assert not (tmp_path / "out").exists()


def test_cli_input_errors_are_named_not_tracebacks(tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    models.build("llama", dtype=torch.bfloat16).save_pretrained(src)  # vocab_size 96
    _no_loading(monkeypatch)

    def err(*argv):
        assert main(list(argv)) == 2
        return capsys.readouterr().err

    q = ["quantize", str(src), str(tmp_path / "out")]
    assert "--device gpu is not a torch device" in err(*q, "--device", "gpu")  # was a RuntimeError traceback
    if not torch.cuda.is_available():  # demo: was an AssertionError traceback
        assert "--device cuda: this machine has no CUDA device" in err("demo", "--device", "cuda")
    torch.save(torch.tensor([[1, 2, 96]]), tmp_path / "ids.pt")  # id 96 >= vocab_size: was an IndexError after loading
    assert "token ids span [1, 96], outside the model's vocabulary [0, 96)" in err(
        *q, "--calib-ids", str(tmp_path / "ids.pt"), "--recipe", "w4a16-gptq", "--device", "cpu")
    (tmp_path / "afile").write_text("x")  # OUT under a file: was a NotADirectoryError after quantizing
    assert f"{tmp_path / 'afile'} is a file, not a folder" in err(
        "quantize", str(src), str(tmp_path / "afile" / "out"), "--device", "cpu")
    # plot-hitmap: a corrupt file, a dict without 'hit_map', --keep-k 0 (marked nothing), --cell 0 (invalid PNG)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file" * 8)
    assert "junk.pt cannot be read by torch.load" in err("plot-hitmap", str(tmp_path / "junk.pt"))
    torch.save({"x": torch.ones(2, 4)}, tmp_path / "d.pt")
    assert "a dict without a 'hit_map' tensor (keys: x)" in err("plot-hitmap", str(tmp_path / "d.pt"))
    torch.save(torch.ones(2, 4), tmp_path / "hit.pt")
    png = str(tmp_path / "h.png")
    assert "keep_k=0 (layer 0) is below 1" in err("plot-hitmap", str(tmp_path / "hit.pt"), "--keep-k", "0",
                                                  "--out", png)
    import pytest

    with pytest.raises(SystemExit):
        main(["plot-hitmap", str(tmp_path / "hit.pt"), "--cell", "0", "--out", png])
    assert "0 is not positive" in capsys.readouterr().err
    assert not (tmp_path / "h.png").exists() and not (tmp_path / "out").exists()
    # --out in a folder that does not exist: named, not the atomic write's hidden temporary file
    assert f"the folder {tmp_path / 'nodir'} of" in err("plot-hitmap", str(tmp_path / "hit.pt"), "--out",
                                                        str(tmp_path / "nodir" / "h.png"))


def test_quantize_command_points_an_unloadable_fp8_source_to_stream(tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    models.build("llama", dtype=torch.bfloat16).save_pretrained(src)

    def fp8_without_accelerate(*a, **k):  # what transformers raises for DeepSeek's block FP8 without accelerate
        raise ImportError("Loading an FP8 quantized model requires accelerate (`pip install accelerate`)")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fp8_without_accelerate)
    assert main(["quantize", str(src), str(tmp_path / "out"), "--device", "cpu"]) == 2
    assert "requires accelerate" in (e := capsys.readouterr().err) and "pass --stream" in e
