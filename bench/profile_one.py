"""Run one kernel configuration a few times, for `ncu` (device only):
    ncu --section SpeedOfLight -k regex:_w4a16_mma -c 1 python3 bench/profile_one.py mma 16 18432x7168
    ncu --section InstructionStats -k regex:awq_quantize -c 1 python3 bench/profile_one.py quant-asym 1 18432x7168
    ncu --section SpeedOfLight -k regex:awq_mma_kernel -c 1 python3 bench/profile_one.py mma-cuda 1 18432x7168
"""
import sys

import torch

import torchforge
from torchforge.ops.awq_gemv_triton import launch_w4a16_gemv
from torchforge.ops._ext import has_cuda_ext
from torchforge.ops.awq_mma_triton import launch_w4a16_mma

has_cuda_ext()  # loads the extension (its ops exist only after that)

kind, m, shape = sys.argv[1], int(sys.argv[2]), sys.argv[3]
OC, IC = map(int, shape.split("x"))
w = torch.randn(OC, IC, device="cuda", dtype=torch.bfloat16) * 0.02
# (the quantize kinds time the quantize kernel itself: no launch of it before theirs, so that `ncu -c 1` takes theirs)
qw, sc, qz = (None,) * 3 if kind.startswith("quant") else torchforge.ops.awq_quantize(w, group_size=128)
x = torch.randn(m, IC, device="cuda", dtype=torch.bfloat16)
if kind == "mma-cuda":  # the decode / wgmma kernels on the mma layout, as a module after use_mma_layout() runs them
    from torchforge.ops.awq_mma import awq_mma_linear
    from torchforge.ops.awq_mma_layout import awq_to_mma_layout

    qw_mma = awq_to_mma_layout(qw)
fn = {"mma": lambda: launch_w4a16_mma(x, qw, sc, qz, 128), "gemv": lambda: launch_w4a16_gemv(x, qw, sc, qz, 128),
      "bf16": lambda: torch.nn.functional.linear(x, w),
      "mma-cuda": lambda: awq_mma_linear(x, qw_mma, sc, qz, 128),
      # the fused quantize + pack kernel (csrc/awq_quantize.cu) on the weight; m unused
      "quant-sym": lambda: torch.ops.torchforge.awq_quantize_cuda(w, 128, True),
      "quant-asym": lambda: torch.ops.torchforge.awq_quantize_cuda(w, 128, False)}[kind]
for _ in range(3):
    fn()
torch.cuda.synchronize()
