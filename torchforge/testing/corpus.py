"""The tiny MoE's training corpus, generated offline: procedural math with worked solutions, English prose
(docstrings of Python's standard library) and code (its source).

Held-out text never enters training: stdlib files are split by a hash of their path relative to the stdlib
root (about 10% held out), and math uses disjoint random seeds for train, calibration and evaluation. The
docstrings are read with `ast`, never by importing modules (some stdlib modules act on import).
"""
from __future__ import annotations

import ast
import os
import random
import sysconfig
import zlib
from fractions import Fraction

_SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__", "lib2to3", "tkinter",
              "turtledemo", "ensurepip", "pydoc_data", "encodings"}
MATH_SEEDS = {"train": 1, "calib": 2, "eval": 3}


def _is_heldout(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % 10 == 0


def stdlib_files(split: str) -> list[tuple[str, str]]:
    """[(relative path, source)] of the stdlib's .py files in `split` ('train' or 'eval'), sorted by path."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if _is_heldout(rel) != (split == "eval"):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    out.append((rel, f.read()))
            except (UnicodeDecodeError, OSError):
                continue
    return out


def prose_documents(split: str) -> list[str]:
    """Docstrings (module, class, function) of the stdlib files in `split`, ASCII only, at least 80 chars."""
    docs = []
    for _, src in stdlib_files(split):
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80 and doc.isascii():
                    docs.append(doc.strip() + "\n\n")
    return docs


def code_documents(split: str) -> list[str]:
    return [src for _, src in stdlib_files(split) if src.isascii()]


# ---- math ---------------------------------------------------------------------------------------------------

_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mia", "Noor"]
_ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stamps", "cards", "shells", "eggs", "tickets"]


def _arith(r: random.Random) -> str:
    a, b = r.randint(2, 999), r.randint(2, 999)
    op = r.choice("+-*")
    if op == "*":
        a, b = r.randint(2, 99), r.randint(2, 99)
        tens, ones = b // 10 * 10, b % 10
        return (f"Compute {a} * {b}.\n{a} * {b} = {a} * {tens} + {a} * {ones} = {a * tens} + {a * ones} = "
                f"{a * b}.\nAnswer: {a * b}\n\n")
    val = a + b if op == "+" else a - b
    return f"Compute {a} {op} {b}.\n{a} {op} {b} = {val}.\nAnswer: {val}\n\n"


def _linear(r: random.Random) -> str:
    x, a, b = r.randint(-20, 20), r.randint(2, 12), r.randint(-50, 50)
    c = a * x + b
    sb = f"+ {b}" if b >= 0 else f"- {-b}"
    step = f"Subtract {b} from both sides" if b >= 0 else f"Add {-b} to both sides"
    return (f"Solve for x: {a}x {sb} = {c}.\n{step}: {a}x = {c - b}.\nDivide both sides by {a}: x = {x}.\n"
            f"Check: {a} * {x} {sb} = {c}.\nAnswer: x = {x}\n\n")


def _word(r: random.Random) -> str:
    n, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, k = r.randint(3, 60), r.randint(2, 40), r.randint(2, 9)
    kind = r.randrange(3)
    if kind == 0:
        return (f"{n} has {a} {item} and buys {b} more. How many {item} does {n} have now?\n"
                f"{n} starts with {a} and gains {b}: {a} + {b} = {a + b}.\nAnswer: {a + b}\n\n")
    if kind == 1:
        a = a + b
        return (f"{n} had {a} {item} and gave away {b}. How many {item} are left?\n"
                f"{a} - {b} = {a - b}.\nAnswer: {a - b}\n\n")
    return (f"{n} packs {a} {item} into each of {k} boxes. How many {item} are packed in total?\n"
            f"{k} boxes * {a} {item} = {k * a}.\nAnswer: {k * a}\n\n")


def _fraction(r: random.Random) -> str:
    p, q = Fraction(r.randint(1, 9), r.randint(2, 12)), Fraction(r.randint(1, 9), r.randint(2, 12))
    d = p.denominator * q.denominator
    num = p.numerator * q.denominator + q.numerator * p.denominator
    return (f"Add the fractions {p} + {q}.\nCommon denominator {d}: {num - q.numerator * p.denominator}/{d} + "
            f"{q.numerator * p.denominator}/{d} = {num}/{d} = {p + q}.\nAnswer: {p + q}\n\n")


def _quadratic(r: random.Random) -> str:
    s, t = r.randint(-9, 9), r.randint(-9, 9)
    b, c = -(s + t), s * t
    sb = f"+ {b}x" if b >= 0 else f"- {-b}x"
    sc = f"+ {c}" if c >= 0 else f"- {-c}"
    f1 = f"(x - {s})" if s >= 0 else f"(x + {-s})"
    f2 = f"(x - {t})" if t >= 0 else f"(x + {-t})"
    lo, hi = sorted((s, t))
    return (f"Solve x^2 {sb} {sc} = 0.\nFind two numbers with sum {s + t} and product {c}: {s} and {t}.\n"
            f"Factor: {f1}{f2} = 0.\nAnswer: x = {lo} or x = {hi}\n\n")


_MATH_KINDS = [_arith, _arith, _linear, _word, _word, _fraction, _quadratic]


def math_text(split: str, n_chars: int) -> str:
    """Procedural math problems with worked solutions, about `n_chars` long, deterministic per split."""
    r = random.Random(MATH_SEEDS[split])
    parts, size = [], 0
    while size < n_chars:
        s = r.choice(_MATH_KINDS)(r)
        parts.append(s)
        size += len(s)
    return "".join(parts)


def sample_text(docs: list[str], n_chars: int, seed: int) -> str:
    """Concatenation of randomly ordered documents, cut to `n_chars` (a fixed eval or calibration slice)."""
    r = random.Random(seed)
    order = list(range(len(docs)))
    r.shuffle(order)
    out, size = [], 0
    for i in order:
        out.append(docs[i])
        size += len(docs[i])
        if size >= n_chars:
            break
    return "".join(out)[:n_chars]
