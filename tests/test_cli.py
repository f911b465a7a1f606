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
