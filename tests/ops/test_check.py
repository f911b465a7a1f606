"""torchforge.ops._check: torch's argument checks with a fast path for plain True."""
from unittest import mock

import pytest
import torch

from torchforge.ops._check import check, check_type, check_value


@pytest.mark.parametrize("fn, torch_name, error", [(check, "_check", RuntimeError),
                                                   (check_type, "_check_type", TypeError),
                                                   (check_value, "_check_value", ValueError)])
def test_same_errors_as_torch(fn, torch_name, error):
    assert fn(True, lambda: "unused") is None
    with pytest.raises(error, match="x has 3 rows"):
        fn(False, lambda: "x has 3 rows")
    with pytest.raises(TypeError, match="cond must be a bool"):  # torch's own check of the condition's type
        fn(1, lambda: "not a bool")
    # only a plain True skips torch's function; anything else (False, a SymBool while tracing) goes to it
    with mock.patch.object(torch, torch_name) as theirs:
        fn(True, lambda: "")
        assert theirs.call_count == 0
        sentinel = object()
        fn(sentinel, lambda: "")
        assert theirs.call_count == 1 and theirs.call_args.args[0] is sentinel


def test_symbolic_condition_becomes_a_guard():
    # under torch.compile with dynamic shapes the op checks see SymBools: torch records them, and a call that breaks
    # the condition fails with the op's message
    def f(x):
        check_value(x.shape[0] % 2 == 0, lambda: f"x has {x.shape[0]} rows, need an even number")
        return x * 2

    g = torch.compile(f, dynamic=True, backend="eager")
    assert torch.equal(g(torch.ones(4)), torch.full((4,), 2.0))
    assert torch.equal(g(torch.ones(6)), torch.full((6,), 2.0))
    with pytest.raises(ValueError, match="x has 5 rows, need an even number"):
        g(torch.ones(5))
