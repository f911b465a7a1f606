"""CPU checks of the CUDA ops' dispatch: sizes past ops.cpp's limits take the fallbacks (the ops raise on them), and
a module's kept ticket buffer keeps its address through no-op moves (CUDA graphs captured before hold it)."""
import torch

from torchforge.nn.awq_linear import ForgeAWQLinear
from torchforge.ops.awq_gemv_cuda import cuda_gemv_config


def test_gemv_config_stays_within_the_grid():
    # K = 2^26 rows, N = 32: 65536 items of 32 rows per k-lane round, one more slice than grid dimension y takes
    splits, rows = cuda_gemv_config(1 << 26, 32, 128)
    assert rows == 32 and splits == 65535


def test_mma_dispatch_size_limits():
    from torchforge.ops.awq_mma_cuda import _dense_shape_ok

    assert _dense_shape_ok(16 * 7168, 7168, 18432)
    assert not _dense_shape_ok(1 << 30, 1 << 30, 64)  # K = 2^30: ops.cpp raises
    assert not _dense_shape_ok(4096, 4096, 1 << 22)  # N / 64 = 65536 column blocks: past grid dimension y
    assert not _dense_shape_ok(1 << 34, 1 << 20, 64)


def test_tickets_keep_their_address_through_no_op_moves():
    lin = ForgeAWQLinear.from_linear(torch.nn.Linear(128, 64), group_size=64)
    assert lin.use_mma_layout()
    tickets = lin.mma_tickets
    tickets.fill_(3)
    lin.to("cpu")
    lin.float()
    assert lin.mma_tickets is tickets and int(tickets.count_nonzero()) == 0
