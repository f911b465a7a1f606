"""The hottest SASS instructions of an Nsight Compute source page (`ncu -i R --page source --csv --print-source sass`,
as bench/ncu_decode_stalls.sh writes it): warp stall samples per instruction with their main reasons, and the samples
summed by opcode and by reason.

    python3 bench/ncu_source_top.py stalls_1_18432x7168.csv [--top 30]
"""
from __future__ import annotations

import argparse
import collections
import csv
import io

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(text: str, name: str = "the source page") -> list[dict]:
    """One dict per SASS instruction: address, source, samples and the per-reason samples (ncu names those columns
    stall_<reason>; the "(Not Issued)" ones are left out, they are a subset)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and "Address" in line), None)
    if start is None:
        raise ValueError(f"{name}: no header line with 'Address' and 'Source' columns; export the page with "
                         "ncu -i REPORT --page source --csv --print-source sass")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    head = rows[0]
    reasons = [c for c in head if c.startswith("stall_") and not c.endswith("(Not Issued)")]
    out = []
    for r in rows[1:]:
        if len(r) != len(head):
            continue
        cell = dict(zip(head, r))
        out.append({"address": cell["Address"], "source": cell["Source"].strip(), "samples": _number(cell[SAMPLES]),
                    "reasons": {c.removeprefix("stall_"): _number(cell[c]) for c in reasons}})
    return out


def opcode(source: str) -> str:
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def summary(instructions: list[dict], top: int) -> tuple[list[dict], dict, dict]:
    """The `top` instructions by samples, and the share of all samples by opcode and by reason."""
    total = sum(i["samples"] for i in instructions) or 1.0
    by_op: collections.Counter = collections.Counter()
    by_reason: collections.Counter = collections.Counter()
    for i in instructions:
        by_op[opcode(i["source"])] += i["samples"] / total
        for reason, n in i["reasons"].items():
            by_reason[reason] += n / total
    hot = sorted(instructions, key=lambda i: -i["samples"])[:top]
    return hot, dict(by_op.most_common()), dict(by_reason.most_common())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    instructions = read_source_page(open(args.csv, encoding="utf-8", errors="replace").read(), args.csv)
    hot, by_op, by_reason = summary(instructions, args.top)
    total = sum(i["samples"] for i in instructions) or 1.0
    print(f"{len(instructions)} instructions, {total:.0f} samples")
    for i in hot:
        why = ", ".join(f"{r} {n:.0f}" for r, n in sorted(i["reasons"].items(), key=lambda kv: -kv[1])[:3] if n > 0)
        print(f"{i['samples']:7.0f} {100 * i['samples'] / total:5.1f}%  {i['address']:>18}  {i['source'][:60]:60}  {why}")
    print("by opcode:", ", ".join(f"{op} {100 * v:.1f}%" for op, v in list(by_op.items())[:12]))
    print("by reason:", ", ".join(f"{r} {100 * v:.1f}%" for r, v in list(by_reason.items())[:10]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
