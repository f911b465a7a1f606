"""Instruction mix of each kernel's hottest loop in a csrc/ file, without a GPU.

The mma kernels are bound by the ALU pipe past 16 rows (BENCHMARKS.md, sixth session), so SASS instruction counts
per work item predict their speed well enough to try changes locally before spending device time:

    python3 bench/sass_mix.py csrc/awq_mma.cu [--filter bfloat16] [--cuobjdump PATH]

Needs nvcc (sm_90a) and cuobjdump: the CUDA toolkit, or `pip download nvidia-cuda-cuobjdump` and unzip the wheel.
The hottest loop is the backward branch whose body holds the most HMMA instructions (else the longest body).
--order also prints where that loop's global loads sit among its MMAs, run-length coded ("H20 L8" = 20 HMMA, then 8
LDG): ptxas reorders loads freely, so the PTX order says little about when a load goes out (thirty-eighth session:
the decode kernel's rolled loads, one per k-step in PTX, all came after the item's last MMA in SASS).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile

_INS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_FUNC = re.compile(r"Function : (\S+)")


def hottest_loop(sass: str) -> list[str]:
    """The instructions (text, in address order) of the hottest loop of one function's SASS; [] if it has none."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_INS.match, sass.splitlines()) if m]
    best = None
    for addr, text in ins:
        target = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in ins if int(target.group(1), 16) <= a <= addr]
            key = (sum("HMMA" in t for t in body), len(body))
            if best is None or key > best[0]:
                best = (key, body)
    return [] if best is None else best[1]


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the hottest loop of one function's SASS."""
    body = hottest_loop(sass)
    return len(body), collections.Counter(map(_opcode, body))


def loop_order(sass: str) -> str:
    """The hottest loop's HMMA (H) and global loads (L: LDG, LDGSTS) in address order, run-length coded."""
    marks = filter(None, ({"HMMA": "H", "LDG": "L", "LDGSTS": "L"}.get(_opcode(t), "") for t in hottest_loop(sass)))
    return " ".join(f"{m}{sum(1 for _ in run)}" for m, run in itertools.groupby(marks))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a .cu file in csrc/")
    p.add_argument("--filter", default="", help="only functions whose mangled name contains this")
    p.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    p.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    p.add_argument("--top", type=int, default=12, help="opcodes shown per function")
    p.add_argument("--order", action="store_true", help="also print where the loop's loads sit among its MMAs")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        obj = os.path.join(tmp, "k.o")
        subprocess.run([args.nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-c", args.source,
                        "-o", obj], check=True)
        sass = subprocess.run([args.cuobjdump, "-sass", obj], check=True, capture_output=True, text=True).stdout
    parts = _FUNC.split(sass)
    for name, body in zip(parts[1::2], parts[2::2]):
        if args.filter in name:
            n, ops = loop_mix(body)
            print(f"{name}\n  loop: {n} instructions; " + ", ".join(f"{k} {v}" for k, v in ops.most_common(args.top)))
            if args.order:
                print(f"  order: {loop_order(body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
