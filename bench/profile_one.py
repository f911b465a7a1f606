"""Run one kernel configuration a few times, for `ncu` (device only):
    ncu --section SpeedOfLight -k regex:_w4a16_mma -c 1 python3 bench/profile_one.py mma 16 18432x7168
"""
import sys

import torch

import torchforge
from torchforge.ops.awq_gemv_triton import launch_w4a16_gemv
from torchforge.ops.awq_mma_triton import launch_w4a16_mma

kind, m, shape = sys.argv[1], int(sys.argv[2]), sys.argv[3]
OC, IC = map(int, shape.split("x"))
w = torch.randn(OC, IC, device="cuda", dtype=torch.bfloat16) * 0.02
qw, sc, qz = torchforge.ops.awq_quantize(w, group_size=128)
x = torch.randn(m, IC, device="cuda", dtype=torch.bfloat16)
fn = {"mma": lambda: launch_w4a16_mma(x, qw, sc, qz, 128), "gemv": lambda: launch_w4a16_gemv(x, qw, sc, qz, 128),
      "bf16": lambda: torch.nn.functional.linear(x, w)}[kind]
for _ in range(3):
    fn()
torch.cuda.synchronize()
