"""Tokenizers saved into an export folder: each file appears whole or not at all."""
import os
import signal
import subprocess
import sys

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from torch import nn
from transformers import PreTrainedTokenizerFast

from torchforge.export import folder

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(folder.__file__))))


def tiny_tokenizer():
    """Built locally from a vocabulary (no hub download)."""
    t = Tokenizer(WordLevel({"[UNK]": 0, "[PAD]": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", pad_token="[PAD]")


def half_then(fail):
    """A `_save_pretrained` that writes half a tokenizer.json, then calls `fail` (transformers' save_pretrained has
    written tokenizer_config.json by then)."""
    def _save_pretrained(self, save_directory, *args, **kw):
        with open(os.path.join(save_directory, "tokenizer.json"), "w") as f:
            f.write(self.backend_tokenizer.to_str()[:40])
            f.flush()
        fail()
    return _save_pretrained


def test_tokenizer_files_match_save_pretrained_and_reload(tmp_path):
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path / "direct")
    out = tmp_path / "out"
    out.mkdir()
    folder.write_side_files(nn.Module(), str(out), {"format": "test"}, tokenizer=tok)
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "direct") + ["torchforge.json"])
    for name in os.listdir(tmp_path / "direct"):
        assert (out / name).read_bytes() == (tmp_path / "direct" / name).read_bytes()
    again = PreTrainedTokenizerFast.from_pretrained(out)
    assert again("hello world nope")["input_ids"] == tok("hello world nope")["input_ids"] == [2, 3, 0]


def test_a_tokenizer_save_that_fails_midway_leaves_no_file(tmp_path, monkeypatch):
    """save_pretrained wrote straight into the export folder: a failure left tokenizer_config.json and half a
    tokenizer.json there."""
    tok = tiny_tokenizer()

    def disk_full():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tok), "_save_pretrained", half_then(disk_full))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OSError, match="No space left"):
        folder.write_side_files(nn.Module(), str(out), {"format": "test"}, tokenizer=tok)
    assert sorted(os.listdir(out)) == ["torchforge.json"]  # nor the private temporary folder


_KILLED_TOKENIZER_SAVE = """
import os, signal, sys
from torch import nn
from torchforge.export import folder
from tests.export.test_tokenizer_save import half_then, tiny_tokenizer
tok = tiny_tokenizer()
type(tok)._save_pretrained = half_then(lambda: os.kill(os.getpid(), signal.SIGKILL))
folder.write_side_files(nn.Module(), sys.argv[1], {"format": "test"}, tokenizer=tok)
"""


def test_a_process_killed_mid_tokenizer_save_leaves_no_tokenizer_file(tmp_path):
    """SIGKILL (the OOM killer) half-way through tokenizer.json: the export folder shows no tokenizer file, not a
    truncated tokenizer.json beside a complete tokenizer_config.json."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, "-c", _KILLED_TOKENIZER_SAVE, str(out)], env=env, capture_output=True,
                       timeout=300, cwd=_REPO)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == ["torchforge.json"]
