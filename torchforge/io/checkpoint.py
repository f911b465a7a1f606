"""Reading Hugging Face style checkpoints tensor by tensor.

Supported layouts, in order of preference when a folder holds several:

1. sharded safetensors: ``model.safetensors.index.json`` (or a single other ``*.safetensors.index.json``)
   plus the shards it lists;
2. ``model.safetensors``, or the only ``*.safetensors`` file of the folder;
3. sharded PyTorch pickles: ``pytorch_model.bin.index.json`` plus its shards;
4. ``pytorch_model.bin``.

Safetensors files are read through ``safe_open`` one tensor at a time and one shard at a time; their
headers are parsed and checked (header length, JSON, data offsets against each other and the file size)
before any tensor data is read, so truncated downloads fail with a message that names the file instead of a
crash deep inside the reader.

Where there is an index, its ``weight_map`` is the list of the checkpoint's tensors and says which shard holds
each: a tensor a shard holds that the index does not list is not read (a warning names it), nor is a copy of a
listed tensor in another shard.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "CheckpointError",
    "check_checkpoint_files",
    "iter_checkpoint",
    "load_state_dict",
    "checkpoint_tensor_names",
    "read_safetensors_header",
    "TensorInfo",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "BIN_WEIGHTS_NAME",
    "BIN_WEIGHTS_INDEX_NAME",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
BIN_WEIGHTS_NAME = "pytorch_model.bin"
BIN_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

_SCALE_INV_SUFFIX = "_scale_inv"


class CheckpointError(ValueError):
    """A checkpoint folder or file is missing, incomplete, corrupt or inconsistent."""


# --------------------------------------------------------------------------------------------------
# safetensors headers
# --------------------------------------------------------------------------------------------------

# safetensors dtype code -> (torch dtype name, bits per element)
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 8),
    "U8": ("uint8", 8),
    "I8": ("int8", 8),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "I16": ("int16", 16),
    "U16": ("uint16", 16),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "I32": ("int32", 32),
    "U32": ("uint32", 32),
    "F32": ("float32", 32),
    "I64": ("int64", 64),
    "U64": ("uint64", 64),
    "F64": ("float64", 64),
    "C64": ("complex64", 64),
    "F4": ("float4_e2m1", 4),
}
_FP8_WEIGHT_CODES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
# dtypes block scales can have (dequantize_fp8_block multiplies in float32): not integers, e.g. raw ue8m0 bytes
_FP8_SCALE_CODES = frozenset({"F32", "F16", "BF16", "F64", "F8_E8M0"})


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of a safetensors header (offsets are relative to the data section)."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype_name(self) -> str:
        return SAFETENSORS_DTYPES.get(self.dtype, (self.dtype, 0))[0]


# safetensors refuses larger headers (MAX_HEADER_SIZE in its Rust core), so no readable file has one
_MAX_HEADER_BYTES = 100_000_000


def _corrupt(path: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"corrupt or truncated safetensors file {path}: {what}; the file is damaged or the download "
        f"is incomplete: delete it and download/save it again"
    )


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of a safetensors file without reading tensor data.

    A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON + the data section; the JSON
    maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data
    section) plus an optional ``"__metadata__"`` string map. Returns ``(infos, metadata)`` with
    ``infos`` in file order. Raises :class:`CheckpointError` naming the file when the header length
    exceeds the file, the JSON is invalid, or any tensor's data lies beyond the end of the file.
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"the file has {size} bytes, fewer than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise _corrupt(path, f"the header length field says {n} bytes but the file has only {size} bytes")
            if n > _MAX_HEADER_BYTES:  # checked before the read: a damaged length field must not read gigabytes
                raise _corrupt(path, f"the header length field says {n} bytes, over safetensors' limit of "
                                     f"{_MAX_HEADER_BYTES} bytes")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"its {n}-byte JSON header does not parse ({e})") from e
    if not isinstance(header, dict):
        raise _corrupt(path, "its JSON header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - n
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = entry["dtype"]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
            if not isinstance(dtype, str) or any(s < 0 for s in shape):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"the header entry of tensor {name!r} is malformed: {entry!r}") from None
        if not 0 <= begin <= end:
            raise _corrupt(path, f"tensor {name!r} has invalid data offsets [{begin}, {end}]")
        if end > data_size:
            raise _corrupt(
                path,
                f"tensor {name!r} needs data bytes [{begin}, {end}) but the file holds only {data_size} "
                f"data bytes ({size} bytes in all)",
            )
        bits = SAFETENSORS_DTYPES.get(dtype, (None, 0))[1]
        if bits and bits % 8 == 0 and end - begin != math.prod(shape) * bits // 8:
            raise _corrupt(
                path,
                f"tensor {name!r} ({dtype}, shape {list(shape)}) should take "
                f"{math.prod(shape) * bits // 8} bytes but its offsets span {end - begin}",
            )
        infos[name] = TensorInfo(name, dtype, shape, begin, end)
    infos = dict(sorted(infos.items(), key=lambda kv: (kv[1].begin, kv[1].end)))
    # safetensors' own rule: the tensors tile the data section exactly. Checked here, or safe_open would refuse the
    # file only when the iteration reaches it, with no hint of the fix.
    stop = 0
    for name, info in infos.items():
        if info.begin != stop:
            raise _corrupt(path, f"tensor {name!r} has data offsets [{info.begin}, {info.end}] but the tensor before "
                                 f"it ends at {stop}: the header's offsets overlap or leave a gap")
        stop = info.end
    if stop != data_size:
        raise _corrupt(path, f"its tensors take {stop} data bytes but the file holds {data_size} after the header: "
                             "the header does not describe the file")
    return infos, metadata


# --------------------------------------------------------------------------------------------------
# layout discovery
# --------------------------------------------------------------------------------------------------


@dataclass
class _Layout:
    root: str
    kind: str  # "safetensors" | "bin"
    files: list[str]  # file names relative to root, in read order
    weight_map: dict[str, str] | None  # from the index, None for single-file checkpoints
    index_file: str | None


_SHARD_RE = re.compile(r".*-\d{5}-of-\d{5}\.(safetensors|bin)")


def _read_index(root: str, index_name: str) -> dict[str, str]:
    path = os.path.join(root, index_name)
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"index file {path} cannot be read as JSON ({e}): it is corrupt or truncated; download it again"
        ) from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"index file {path} has no valid 'weight_map' (tensor name -> shard file); it is not a "
            f"Hugging Face checkpoint index or it is damaged"
        )
    if not weight_map:
        raise CheckpointError(f"index file {path} maps no tensor (an empty 'weight_map'): it is damaged or from an "
                              "interrupted save; download or save the checkpoint again")
    # shards are files of the checkpoint's own folder (as transformers writes and reads them): a path elsewhere
    # ('../x', '/abs/x', 'sub/x') would read files the folder does not hold
    odd = sorted({v for v in weight_map.values() if v != os.path.basename(v) or v in ("", ".", "..")})
    if odd:
        raise CheckpointError(f"index file {path} names shard {odd[0]!r}, not a file of {root}: shards must be plain "
                              "file names in the checkpoint's folder; the index is damaged or hand-edited")
    return weight_map


def _check_shards_present(root: str, index_name: str, weight_map: dict[str, str]) -> list[str]:
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.isfile(os.path.join(root, f))]
    if missing:
        more = f" ({len(missing)} of {len(files)} shards missing: {', '.join(missing)})" if len(missing) > 1 else ""
        raise CheckpointError(
            f"shard {missing[0]} listed in {index_name} is missing from {root}: the download is "
            f"incomplete{more}; download the missing files again"
        )
    return files


def _resolve(model_dir: str | os.PathLike) -> _Layout:
    model_dir = os.fspath(model_dir)
    if os.path.isfile(model_dir):
        root, name = os.path.split(os.path.abspath(model_dir))
        if name.endswith(".safetensors"):
            return _Layout(root, "safetensors", [name], None, None)
        if name.endswith(".bin"):
            return _Layout(root, "bin", [name], None, None)
        raise CheckpointError(f"{model_dir} is neither a checkpoint folder nor a .safetensors/.bin file")
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint folder {model_dir} does not exist")
    root = model_dir
    entries = set(os.listdir(root))

    # transformers' precedence (modeling_utils): model.safetensors before its index, pytorch_model.bin before its
    # index. save_pretrained over an earlier sharded save leaves the old index and shards beside the new file.
    if os.path.isfile(os.path.join(root, SAFE_WEIGHTS_NAME)):
        return _Layout(root, "safetensors", [SAFE_WEIGHTS_NAME], None, None)
    st_indexes = sorted(e for e in entries if e.endswith(".safetensors.index.json"))
    if SAFE_WEIGHTS_INDEX_NAME in st_indexes or len(st_indexes) == 1:
        index_name = SAFE_WEIGHTS_INDEX_NAME if SAFE_WEIGHTS_INDEX_NAME in st_indexes else st_indexes[0]
        weight_map = _read_index(root, index_name)
        return _Layout(root, "safetensors", _check_shards_present(root, index_name, weight_map), weight_map, index_name)
    if len(st_indexes) > 1:
        raise CheckpointError(
            f"{root} holds several safetensors indexes ({', '.join(st_indexes)}) and none is "
            f"{SAFE_WEIGHTS_INDEX_NAME}; pass the path of the weights file to read instead"
        )
    st_files = sorted(e for e in entries if e.endswith(".safetensors") and os.path.isfile(os.path.join(root, e)))
    if len(st_files) == 1:
        return _Layout(root, "safetensors", st_files, None, None)
    if len(st_files) > 1:
        hint = (
            "these look like shards whose index was not written (interrupted save?) or not downloaded"
            if any(_SHARD_RE.fullmatch(f) for f in st_files)
            else "pass the path of the file to read instead"
        )
        raise CheckpointError(
            f"{root} holds {len(st_files)} .safetensors files ({', '.join(st_files[:4])}"
            f"{', ...' if len(st_files) > 4 else ''}) but no {SAFE_WEIGHTS_INDEX_NAME}: {hint}"
        )

    if BIN_WEIGHTS_NAME in entries:
        return _Layout(root, "bin", [BIN_WEIGHTS_NAME], None, None)
    if BIN_WEIGHTS_INDEX_NAME in entries:
        weight_map = _read_index(root, BIN_WEIGHTS_INDEX_NAME)
        files = _check_shards_present(root, BIN_WEIGHTS_INDEX_NAME, weight_map)
        return _Layout(root, "bin", files, weight_map, BIN_WEIGHTS_INDEX_NAME)
    if any(e.startswith("pytorch_model-") and e.endswith(".bin") for e in entries):
        raise CheckpointError(f"{root} holds pytorch_model-*.bin shards but no {BIN_WEIGHTS_INDEX_NAME}")
    raise CheckpointError(
        f"no checkpoint files in {root}: expected {SAFE_WEIGHTS_INDEX_NAME}, {SAFE_WEIGHTS_NAME}, "
        f"a *.safetensors file, {BIN_WEIGHTS_INDEX_NAME} or {BIN_WEIGHTS_NAME}"
    )


def _fp8_block_size(root: str) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` from config.json, else DeepSeek's 128x128."""
    try:
        with open(os.path.join(root, "config.json"), encoding="utf-8") as f:
            qc = json.load(f).get("quantization_config") or {}
        bs = qc.get("weight_block_size")
        if isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs):
            return int(bs[0]), int(bs[1])
    except (OSError, ValueError, AttributeError):
        pass
    return (128, 128)


def _normalize_prefixes(prefixes) -> tuple[str, ...] | None:
    if prefixes is None:
        return None
    if isinstance(prefixes, str):
        return (prefixes,)
    out = tuple(prefixes)
    if not all(isinstance(p, str) for p in out):
        raise TypeError(f"prefixes must be strings, got {out!r}")
    return out


def _torch_load(path: str) -> dict:
    """``torch.load`` a weights-only state dict, memory-mapped where the file format allows it."""
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # legacy (non-zip) files cannot be mmapped; anything else is an error
                raise
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot load {path} with torch.load(weights_only=True): {type(e).__name__}: {e}; the file is "
            f"corrupt or truncated (delete it and download/save it again), or it is not a plain state dict"
        ) from e
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path} does not hold a state dict (got {type(sd).__name__})")
    return sd


# --------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------


def checkpoint_tensor_names(model_dir: str | os.PathLike) -> dict[str, str]:
    """Map every tensor name of the checkpoint to the file (relative to the folder) that holds it.

    Uses the index where there is one (the list of the tensors :func:`iter_checkpoint` reads); a single
    safetensors file is read for its header only; a single ``pytorch_model.bin`` has to be unpickled
    (memory-mapped where possible).
    """
    layout = _resolve(model_dir)
    if layout.weight_map is not None:
        return dict(layout.weight_map)
    (name,) = layout.files
    path = os.path.join(layout.root, name)
    if layout.kind == "safetensors":
        infos, _ = read_safetensors_header(path)
        return {k: name for k in infos}
    return {k: name for k, v in _torch_load(path).items() if isinstance(v, torch.Tensor)}


def check_checkpoint_files(model_dir: str | os.PathLike) -> None:
    """Raises CheckpointError naming the file where a checkpoint folder is incomplete or damaged: a missing shard, an
    unreadable index, a safetensors file whose header or data is cut short, an index naming a tensor its shard lacks.
    Headers only (no tensor data is read); `.bin` files are not opened (unpickling them is a full read)."""
    layout = _resolve(model_dir)
    if layout.kind != "safetensors":
        return
    _, names_by_file = _files_to_read(layout, None)
    for fname in layout.files:
        infos, _ = read_safetensors_header(os.path.join(layout.root, fname))
        _check_index_names(layout, names_by_file, fname, infos, None)


def load_state_dict(model_dir: str | os.PathLike, prefixes=None, **kw) -> dict[str, torch.Tensor]:
    """``dict(iter_checkpoint(model_dir, prefixes, **kw))``."""
    return dict(iter_checkpoint(model_dir, prefixes, **kw))


def iter_checkpoint(
    model_dir: str | os.PathLike,
    prefixes: Iterable[str] | str | None = None,
    *,
    dequantize_fp8: bool = False,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the tensors of a checkpoint, one shard open at a time.

    ``model_dir`` is a checkpoint folder (see the module docstring for the layouts) or the path of a
    single ``.safetensors``/``.bin`` file. ``prefixes``: only tensors whose name starts with one of
    them are read, and shards that hold none of them are not opened. With ``dequantize_fp8``, every
    float8 tensor ``X`` with a companion ``X_scale_inv`` (DeepSeek-V3/R1 block FP8, see
    :mod:`torchforge.io.fp8`; block size from config.json, default 128x128) is yielded dequantized to
    ``dtype`` (bfloat16 by default), the companion may live in another shard, and the consumed
    ``*_scale_inv`` tensors are not yielded. ``dtype`` casts the floating (non-float8) tensors, except
    ``*_scale_inv`` block scales yielded as stored, which keep their dtype so that they stay exact.
    Tensors end up on ``device`` (dequantization runs there). With an index, only the tensors it lists are
    read, each from the shard it names (see the module docstring).

    The layout, the index, the shards to be read and (for safetensors) their headers and the FP8
    companions are all checked when this function is called, before anything is yielded; a
    :class:`CheckpointError` says what is wrong and with which file.
    """
    layout = _resolve(model_dir)
    prefixes = _normalize_prefixes(prefixes)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device)
    block = _fp8_block_size(layout.root) if dequantize_fp8 else (128, 128)
    if layout.kind == "safetensors":
        return _iter_safetensors(layout, prefixes, dequantize_fp8, device, dtype, block)
    return _iter_bin(layout, prefixes, dequantize_fp8, device, dtype, block)


def _wanted(name: str, prefixes: tuple[str, ...] | None) -> bool:
    return prefixes is None or name.startswith(prefixes)


def _finish(t: torch.Tensor, name: str, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """Cast floating, non-float8 tensors to ``dtype`` (block-FP8 ``*_scale_inv`` scales stay exact)."""
    from .fp8 import is_fp8_dtype

    if (
        dtype is not None
        and t.is_floating_point()
        and not is_fp8_dtype(t.dtype)
        and not name.endswith(_SCALE_INV_SUFFIX)
    ):
        t = t.to(dtype)
    return t.to(device)


def _files_to_read(layout: _Layout, prefixes) -> tuple[list[str], dict[str, list[str]] | None]:
    """Files holding at least one wanted tensor (by the index; single-file layouts: the file)."""
    if layout.weight_map is None:
        return list(layout.files), None
    names_by_file: dict[str, list[str]] = {f: [] for f in layout.files}
    for n, f in layout.weight_map.items():
        names_by_file[f].append(n)
    return [f for f in layout.files if any(_wanted(n, prefixes) for n in names_by_file[f])], names_by_file


def _check_index_names(layout: _Layout, names_by_file, fname: str, present, prefixes) -> None:
    """The index's (wanted) tensors of shard `fname` must be in it: else the index and the shards do not match."""
    if names_by_file is None:
        return
    lost = [n for n in names_by_file[fname] if n not in present and _wanted(n, prefixes)]
    if lost:
        raise CheckpointError(
            f"{layout.index_file} maps {lost[0]!r}{f' (and {len(lost) - 1} more)' if len(lost) > 1 else ''} "
            f"to {fname}, but that shard does not contain it: the index and the shards in {layout.root} come "
            f"from different saves or downloads"
        )


_UNLISTED_WARNED: set[str] = set()  # index files warned about: once per checkpoint, not once per layer read


def _warn_unlisted(layout: _Layout, fname: str, names: list[str], more_shards: int, stacklevel: int,
                   partial_read: bool = False) -> None:
    """Warns (once per index) that shard `fname` holds `names`, tensors its index does not list, which are not read.

    transformers' from_pretrained loads every tensor of the shards an index lists, unlisted ones too; here the index
    is the list, as it is for checkpoint_tensor_names (calibration's layer streaming, load_quantized's module swaps).
    `partial_read`: the read asked for some tensors only (prefixes), so the counts cover only the shards and names it
    looked at, and the message says so."""
    index_path = os.path.abspath(os.path.join(layout.root, layout.index_file))  # not the folder as spelled
    if index_path in _UNLISTED_WARNED:
        return
    _UNLISTED_WARNED.add(index_path)
    shown = ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    others = f" (and {more_shards} other shard(s) hold unlisted tensors too)" if more_shards else ""
    scope = " among the tensors this partial read looked at (there may be more)" if partial_read else ""
    warnings.warn(
        f"{os.path.join(layout.root, fname)} holds {len(names)} tensor(s) that {layout.index_file} does not list "
        f"({shown}){others}{scope}: they are not read. The index is the checkpoint's list of tensors; if the model needs "
        f"them, the index is damaged or hand-edited: add them to its weight_map or save the checkpoint again",
        stacklevel=stacklevel + 1,
    )


def _iter_safetensors(layout: _Layout, prefixes, dequantize_fp8, device, dtype, block):
    from .fp8 import expected_scale_shape

    root, weight_map = layout.root, layout.weight_map
    headers: dict[str, dict[str, TensorInfo]] = {}

    def header(fname: str) -> dict[str, TensorInfo]:
        if fname not in headers:
            headers[fname] = read_safetensors_header(os.path.join(root, fname))[0]
        return headers[fname]

    def lookup(name: str, near: str) -> tuple[str, TensorInfo] | None:
        """(file, info) of tensor ``name``: through the index, else in the header of file ``near``."""
        fname = weight_map.get(name) if weight_map is not None else near
        if fname is None:
            return None
        info = header(fname).get(name)
        if info is None and weight_map is not None:
            raise CheckpointError(
                f"{layout.index_file} maps {name!r} to {fname}, but that shard does not contain it: the "
                f"index and the shards in {root} come from different saves or downloads"
            )
        return None if info is None else (fname, info)

    # Which files to open, and which of their tensors to yield (in on-disk order).
    files, names_by_file = _files_to_read(layout, prefixes)
    plan: dict[str, list[TensorInfo]] = {}
    unlisted: dict[str, list[str]] = {}
    for fname in files:
        infos = header(fname)
        _check_index_names(layout, names_by_file, fname, infos, prefixes)
        plan[fname] = [i for i in infos.values() if _wanted(i.name, prefixes)]
        if weight_map is not None:
            unlisted[fname] = [i.name for i in plan[fname] if i.name not in weight_map]
            plan[fname] = [i for i in plan[fname] if weight_map.get(i.name) == fname]
    extra = [f for f, names in unlisted.items() if names]
    if extra:
        _warn_unlisted(layout, extra[0], unlisted[extra[0]], len(extra) - 1, stacklevel=3,  # iter_checkpoint's caller
                       partial_read=prefixes is not None)

    # FP8 companions: find and check every scale before reading any data.
    scale_of: dict[str, tuple[str, str]] = {}  # float8 weight name -> (scale name, its file)
    consumed: set[str] = set()  # scales that are applied, not yielded
    if dequantize_fp8:
        for fname, infos in plan.items():
            for info in infos:
                if info.dtype in _FP8_WEIGHT_CODES:
                    sname = info.name + _SCALE_INV_SUFFIX
                    found = lookup(sname, fname)
                    if found is None:
                        alt = info.name + "_scale"
                        hint = (
                            f" (it has {alt!r} instead: per-tensor/per-channel FP8, not DeepSeek block FP8)"
                            if lookup(alt, fname) is not None
                            else ""
                        )
                        raise CheckpointError(
                            f"float8 tensor {info.name!r} in {fname} has no companion {sname!r} in {root}{hint}; "
                            f"cannot dequantize it: read with dequantize_fp8=False to get the stored tensors"
                        )
                    sfile, sinfo = found
                    if sinfo.dtype not in _FP8_SCALE_CODES:
                        raise CheckpointError(
                            f"{sname!r} in {sfile} is {sinfo.torch_dtype_name}, but block-FP8 scales of {info.name!r} "
                            f"are float32 (or float8_e8m0fnu): the checkpoint is not DeepSeek block FP8 or it is "
                            f"damaged; read with dequantize_fp8=False to get the stored tensors"
                        )
                    try:
                        want = expected_scale_shape(info.shape, block)
                    except ValueError as e:
                        raise CheckpointError(f"float8 tensor {info.name!r} in {fname}: {e}; read with "
                                              f"dequantize_fp8=False to get the stored tensors") from None
                    if sinfo.shape != want:
                        raise CheckpointError(
                            f"{sname!r} in {sfile} has shape {list(sinfo.shape)} but {info.name!r} of shape "
                            f"{list(info.shape)} with {block[0]}x{block[1]} blocks needs {list(want)} "
                            f"(ceil(shape / block)): the scales do not belong to this weight, or "
                            f"weight_block_size in config.json is wrong"
                        )
                    scale_of[info.name] = (sname, sfile)
                elif info.name.endswith(_SCALE_INV_SUFFIX):
                    base = lookup(info.name[: -len(_SCALE_INV_SUFFIX)], fname)
                    if base is not None and base[1].dtype in _FP8_WEIGHT_CODES:
                        consumed.add(info.name)

    def gen():
        from safetensors import safe_open

        from .fp8 import dequantize_fp8_block

        # Scales stored in another shard than their weight are small: read them first, one shard at a
        # time, so that the main pass keeps a single shard open.
        remote_by_file: dict[str, list[str]] = {}
        for fname, infos in plan.items():
            for info in infos:
                if info.name in scale_of and scale_of[info.name][1] != fname:
                    sname, sfile = scale_of[info.name]
                    remote_by_file.setdefault(sfile, []).append(sname)
        remote: dict[str, torch.Tensor] = {}
        for sfile, snames in remote_by_file.items():
            with _SafeOpen(safe_open, root, sfile) as f:
                for sname in snames:
                    remote[sname] = f.get_tensor(sname)

        for fname, infos in plan.items():
            if not infos:
                continue
            with _SafeOpen(safe_open, root, fname) as f:
                for info in infos:
                    if info.name in consumed:
                        continue
                    t = f.get_tensor(info.name)
                    if info.name in scale_of:
                        sname, sfile = scale_of[info.name]
                        s = remote.pop(sname) if sfile != fname else f.get_tensor(sname)
                        try:
                            t = dequantize_fp8_block(t.to(device), s.to(device), block, dtype=dtype or torch.bfloat16)
                        except CheckpointError as e:  # NaN/Inf scales: only the data shows them
                            raise CheckpointError(f"{sname!r} in {sfile} cannot dequantize {info.name!r}: {e}") from e
                        yield info.name, t
                    else:
                        yield info.name, _finish(t, info.name, device, dtype)

    return gen()


class _SafeOpen:
    """``safe_open`` with its errors turned into :class:`CheckpointError` naming the file."""

    def __init__(self, safe_open, root: str, fname: str):
        self.path = os.path.join(root, fname)
        try:
            self.handle = safe_open(self.path, framework="pt", device="cpu")
        except Exception as e:
            raise CheckpointError(f"cannot open safetensors file {self.path}: {e}") from e

    def __enter__(self):
        return self.handle.__enter__()

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


def _iter_bin(layout: _Layout, prefixes, dequantize_fp8, device, dtype, block):
    from .fp8 import dequantize_fp8_block, is_fp8_dtype

    root, weight_map = layout.root, layout.weight_map
    files, names_by_file = _files_to_read(layout, prefixes)

    # Pickled shards cannot be read tensor by tensor: each is loaded (memory-mapped where possible) at most once
    # and kept until the last file whose turn may need one of its tensors (an FP8 weight's scale, or the weight of
    # a scale, by the index) is done.
    last_use: dict[str, int] = {}
    for i, fname in enumerate(files):
        last_use[fname] = i
        if not dequantize_fp8 or weight_map is None:
            continue
        for name in names_by_file[fname]:
            if not _wanted(name, prefixes):
                continue
            base = name[: -len(_SCALE_INV_SUFFIX)] if name.endswith(_SCALE_INV_SUFFIX) else None
            for other in (weight_map.get(name + _SCALE_INV_SUFFIX), base and weight_map.get(base)):
                if other is not None and other != fname:
                    last_use[other] = i

    def gen():
        loaded: dict[str, dict] = {}

        def shard(fname: str) -> dict:
            if fname not in loaded:
                loaded[fname] = _torch_load(os.path.join(root, fname))
            return loaded[fname]

        def companion(name: str, fname: str, sd: dict) -> torch.Tensor | None:
            """Tensor `name` where the index puts it (single files: in `sd`, the shard of `fname`)."""
            where = fname if weight_map is None else weight_map.get(name)
            if where is None:
                return None
            t = (sd if where == fname else shard(where)).get(name)
            return t if isinstance(t, torch.Tensor) else None

        try:
            for i, fname in enumerate(files):
                sd = shard(fname)
                _check_index_names(layout, names_by_file, fname,
                                   {n for n, t in sd.items() if isinstance(t, torch.Tensor)}, prefixes)
                if weight_map is not None:
                    unlisted = [n for n, t in sd.items()
                                if isinstance(t, torch.Tensor) and _wanted(n, prefixes) and n not in weight_map]
                    if unlisted:
                        _warn_unlisted(layout, fname, unlisted, 0, stacklevel=2,  # the caller's next()
                                       partial_read=prefixes is not None)
                for name, t in sd.items():
                    if not isinstance(t, torch.Tensor) or not _wanted(name, prefixes):
                        continue
                    if weight_map is not None and weight_map.get(name) != fname:
                        continue
                    if dequantize_fp8 and name.endswith(_SCALE_INV_SUFFIX):
                        base_t = companion(name[: -len(_SCALE_INV_SUFFIX)], fname, sd)
                        if base_t is not None and is_fp8_dtype(base_t.dtype):
                            continue  # applied to its weight
                    if dequantize_fp8 and is_fp8_dtype(t.dtype):
                        sname = name + _SCALE_INV_SUFFIX
                        s = companion(sname, fname, sd)
                        if s is None:
                            raise CheckpointError(
                                f"float8 tensor {name!r} in {fname} has no companion {sname!r} in {root}; "
                                f"cannot dequantize it: read with dequantize_fp8=False to get the stored tensors"
                            )
                        try:
                            t = dequantize_fp8_block(t.to(device), s.to(device), block, dtype=dtype or torch.bfloat16)
                        except (TypeError, ValueError) as e:  # CheckpointError too; a wrong dtype, a 1-D weight
                            raise CheckpointError(f"{sname!r} does not fit {name!r} in {fname}: {e}") from e
                        yield name, t
                        continue
                    yield name, _finish(t, name, device, dtype)
                del sd
                for f in [f for f in loaded if last_use.get(f, -1) <= i]:
                    del loaded[f]
        finally:  # also where the caller stops early: no shard stays mapped
            loaded.clear()

    return gen()
