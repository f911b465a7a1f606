"""Fake and real implementations agree on output layout for non-contiguous inputs (opcheck's fake-tensor test), and
an empty unswizzle does not alias its input."""
import torch
from torch.library import opcheck

import torchforge  # noqa: F401  (registers the ops)
from torchforge.ops import nvfp4_unswizzle_scales, qmeta4_encode
from torchforge.prune import build_expert_map

FAKE = ("test_faketensor",)


def test_transposed_inputs():
    g = torch.Generator().manual_seed(0)
    layer_map = build_expert_map(torch.rand(1, 6, generator=g), keep_k=3)[0]
    ids = torch.randint(0, 6, (4, 5), generator=g).T
    opcheck(torch.ops.torchforge.moe_remap.default, (ids, torch.rand(5, 4, generator=g), layer_map), test_utils=FAKE)
    x = torch.randn(32, 4, generator=g).T
    opcheck(torch.ops.torchforge.nvfp4_fake_quantize_activation.default, (x, torch.tensor(0.01)), test_utils=FAKE)
    scale = torch.rand(4, 16, generator=g) + 0.1
    zero = torch.randint(0, 16, (4, 16), generator=g).to(torch.uint8)
    opcheck(torch.ops.torchforge.qmeta4_encode.default, (scale.T, zero.T, True), test_utils=FAKE)
    qmeta = qmeta4_encode(scale, zero, True)
    opcheck(torch.ops.torchforge.qmeta4_decode.default, (qmeta.T,), test_utils=FAKE)
    weight = torch.randn(16, 8, generator=g)  # [OC, IC], groups of 4 along IC: qmeta [OC, IC / 4] = [16, 2]
    qm = torchforge.ops.qmeta4_build(weight, 4, 4, True)
    grid = torch.linspace(0.5, 1.0, 8)
    opcheck(torch.ops.torchforge.qmeta4_mse_refine.default,
            (weight, qm.T.contiguous().T, grid, 4, 4, 2.0, torch.float32), test_utils=FAKE)


def test_empty_unswizzle_is_a_new_tensor():
    swizzled = torch.zeros(0, 128, 4).to(torch.float8_e4m3fn)
    out = nvfp4_unswizzle_scales(swizzled, 100, 3)
    assert out.shape == (0, 100, 3) and out.dtype == torch.float8_e4m3fn
    opcheck(torch.ops.torchforge.nvfp4_unswizzle_scales.default, (swizzled, 100, 3), test_utils=FAKE)
