"""bench/common.py's L2Rotation: how many weight copies it makes and that the timed calls cycle through them (CPU,
with the device's L2 size faked)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import common  # noqa: E402


@pytest.fixture
def l2_of(monkeypatch):
    def fake(size):
        props = type("Props", (), {"L2_cache_size": size})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    yield fake
    common.L2Rotation.stop()


@pytest.mark.parametrize("l2, working_set, copies", [
    (50 << 20, 27 << 20, 5),    # 7168x7168 int4 on the H100: 4 other copies (108 MB) between two reads of one
    (50 << 20, 69 << 20, 3),    # 18432x7168
    (50 << 20, (100 << 20) - 1, 3),  # just under twice the L2: one other copy is not enough
    (50 << 20, 200 << 20, 1),   # no rotation
])
def test_copies_put_twice_the_l2_between_reuses(l2_of, l2, working_set, copies):
    l2_of(l2)
    rot = common.L2Rotation(working_set)
    assert rot.copies == copies
    assert (rot.copies - 1) * working_set >= 2 * l2 or rot.copies == 1 and working_set >= 2 * l2


def test_advance_cycles_equal_copies_and_stop_restores(l2_of):
    l2_of(1000)
    a, b = torch.arange(100.0), torch.ones(3, 4)
    own = a.data_ptr(), b.data_ptr()
    rot = common.L2Rotation.start(400, a, b)  # 6 copies
    seen = set()
    for _ in range(2 * rot.copies):
        rot.advance()
        seen.add((a.data_ptr(), b.data_ptr()))
        assert torch.equal(a, torch.arange(100.0)) and torch.equal(b, torch.ones(3, 4))
    assert len(seen) == rot.copies == 6
    extra = torch.zeros(5)
    rot.add(extra)
    rot.advance()
    assert extra.data_ptr() != 0 and torch.equal(extra, torch.zeros(5))
    rot.drop(extra)
    assert len(rot.entries) == 2
    common.L2Rotation.stop()
    assert (a.data_ptr(), b.data_ptr()) == own and common.L2Rotation.active is None
