"""The quantization recipe: what to quantize, how, and in which format to export it.

A :class:`Recipe` is a frozen, validated dataclass. Build one directly, from a preset
(``Recipe.from_preset("w4a16-rtn")``), from a dict, or from a YAML/JSON file;
``Recipe.coerce`` accepts any of these (it is what ``torchforge.quantize(model, recipe)``
uses). Invalid values raise :class:`RecipeError` (a ``ValueError``) naming the field, the
bad value and what is allowed.

Module selection (``targets``/``ignore``) follows compressed-tensors' pattern language;
see :mod:`torchforge.matching`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from torchforge import matching

log = logging.getLogger(__name__)


def _unique_keys(pairs):
    """json object hook: a key given twice is an error (json and yaml would keep the last one silently)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} is given twice")
        out[k] = v
    return out


def _load_yaml_unique(text: str):
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged (and overridden) by SafeLoader
                    continue
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass

__all__ = [
    "DEFAULT_IGNORE",
    "DTYPES",
    "ROUTER_IGNORE",
    "EXPORT_FORMATS",
    "PRESETS",
    "Recipe",
    "RecipeError",
    "SCHEMES",
]


class RecipeError(ValueError):
    """An invalid recipe: bad field value, unknown key, unknown preset, unreadable file."""


# Implemented quantization schemes; "nvfp4" and "w4a16-gptq" are added below with their formats.
SCHEMES: tuple[str, ...] = ("w4a16-rtn",)

# Weight bit widths each scheme supports.
_SCHEME_BITS: dict[str, tuple[int, ...]] = {
    "w4a16-rtn": (4,),
}

# Checkpoint layouts the exporter can write.
EXPORT_FORMATS: tuple[str, ...] = ("vllm-awq",)

# dtype of the tensors left unquantized (norms, embeddings, lm_head, routers, ...) at export.
DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")

MIN_GROUP_SIZE = 16

# MoE routers are never quantized: routing decisions are very sensitive to error. In transformers 5 they are
# *TopkRouter modules (not nn.Linear, so "Linear" skips them anyway), but older and remote-code models use a plain
# nn.Linear named mlp.gate, and PhiMoE / Llama4 / Jamba / GraniteMoE name theirs `router`, some an nn.Linear subclass
# ("Linear" would select it, and their forward unpacks the router's outputs, so a quantized one breaks it). Qwen2-MoE's
# shared_expert_gate is a 1-row sigmoid gate (hidden -> 1): nothing to gain.
ROUTER_IGNORE: tuple[str, ...] = (r"re:.*mlp\.gate$", r"re:.*\.router$", r"re:.*shared_expert_gate$")

DEFAULT_IGNORE: tuple[str, ...] = (
    # The output head stays in bf16: 4-bit logits cost accuracy for little memory.
    "lm_head",
    # Token embeddings are a lookup table, not a matmul: keep them in bf16.
    r"re:.*embed_tokens$",
    *ROUTER_IGNORE,
    # MLA's kv_b_proj: vLLM dequantizes it at load (it is split into W_UK / W_UV and
    # absorbed into the attention computation), so quantizing it only adds error.
    r"re:.*self_attn\.kv_b_proj$",
)

# name -> field values (on top of the dataclass defaults).
PRESETS: dict[str, dict[str, Any]] = {
    "w4a16-rtn": {"scheme": "w4a16-rtn", "bits": 4, "group_size": 128, "symmetric": True},
    "w4a16-rtn-asym": {"scheme": "w4a16-rtn", "bits": 4, "group_size": 128, "symmetric": False},
    "w4a16-rtn-g64": {"scheme": "w4a16-rtn", "bits": 4, "group_size": 64, "symmetric": True},
}

# --- NVFP4 (issue 6): NVIDIA ModelOpt's NVFP4 (E2M1 weights, fp8 block-16 scales, fp32 global scale), written
# as a ModelOpt (`hf_quant_config.json`) or compressed-tensors (`nvfp4-pack-quantized`) checkpoint. The block
# size is fixed at 16 and the format is symmetric.
SCHEMES += ("nvfp4",)
_SCHEME_BITS["nvfp4"] = (4,)
NVFP4_EXPORT_FORMATS: tuple[str, ...] = ("modelopt-nvfp4", "compressed-tensors")
EXPORT_FORMATS += NVFP4_EXPORT_FORMATS
PRESETS["nvfp4"] = {"scheme": "nvfp4", "bits": 4, "group_size": 16, "symmetric": True,
                    "export_format": "modelopt-nvfp4"}
PRESETS["nvfp4-ct"] = {**PRESETS["nvfp4"], "export_format": "compressed-tensors"}

# Field defaults that depend on the scheme, for a field the recipe does not give (Recipe(...), from_dict, recipe
# files): AWQ's (group 128, vllm-awq) for the others, which NVFP4 (block 16 only) would refuse.
BASE_DEFAULTS: dict[str, Any] = {"group_size": 128, "export_format": "vllm-awq"}
SCHEME_DEFAULTS: dict[str, dict[str, Any]] = {"nvfp4": {"group_size": 16, "export_format": "modelopt-nvfp4"}}


class _SchemeDefault:
    """The default of `Recipe.group_size` / `Recipe.export_format`: the scheme's (SCHEME_DEFAULTS, else
    BASE_DEFAULTS), filled in by `Recipe.__post_init__`; an instance never holds it."""

    def __repr__(self) -> str:
        return "<scheme default>"


SCHEME_DEFAULT: Any = _SchemeDefault()


def _check_nvfp4(recipe: "Recipe") -> None:
    nvfp4 = recipe.scheme == "nvfp4"
    if nvfp4 and recipe.group_size != 16:
        raise _fail("group_size", recipe.group_size, "16 for scheme 'nvfp4' (NVFP4's only block size; the default "
                    "when group_size is not given)")
    if nvfp4 and not recipe.symmetric:
        raise _fail("symmetric", recipe.symmetric, "True for scheme 'nvfp4' (no zero points)")
    if nvfp4 and recipe.export_format not in NVFP4_EXPORT_FORMATS:
        raise _fail("export_format", recipe.export_format,
                    "one of " + ", ".join(map(repr, NVFP4_EXPORT_FORMATS)) + " for scheme 'nvfp4'")
    if not nvfp4 and recipe.export_format == "modelopt-nvfp4":
        raise _fail("export_format", recipe.export_format, f"a format of scheme {recipe.scheme!r}, not NVFP4's")


# --- GPTQ (issue 3): W4A16 with GPTQ-solved codes (torchforge.gptq), calibrated by
# `torchforge.quantize(model, recipe, calib_data=..., gptq=GPTQConfig(...))`. Without act-order a GPTQ result
# dequantizes exactly like AWQ's (q - z) * s, so the default export stays vllm-awq.
SCHEMES += ("w4a16-gptq",)
_SCHEME_BITS["w4a16-gptq"] = (4,)
EXPORT_FORMATS += ("vllm-gptq",)  # torchforge.export.gptq_export; "compressed-tensors" is listed above
PRESETS["w4a16-gptq"] = {"scheme": "w4a16-gptq", "bits": 4, "group_size": 128, "symmetric": True}
PRESETS["w4a16-gptq-asym"] = {**PRESETS["w4a16-gptq"], "symmetric": False}

_FILE_SUFFIXES = (".yaml", ".yml", ".json")

PathLike = Union[str, "os.PathLike[str]"]


def _fail(field: str, value: Any, allowed: str) -> RecipeError:
    return RecipeError(f"Recipe.{field}: invalid value {value!r} ({type(value).__name__}); allowed: {allowed}")


def _check_str_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise _fail(field, value, "one of " + ", ".join(repr(c) for c in choices))


def _check_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(field, value, "True or False (a bool)")


def _check_int(field: str, value: Any, allowed: str) -> None:
    # bool is an int subclass; True/False are not valid sizes.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(field, value, allowed)


def _to_patterns(field: str, value: Any, allow_empty: bool) -> tuple[str, ...]:
    allowed = (
        "a list of strings: class names (e.g. 'Linear'), exact module names "
        "(e.g. 'lm_head') or 're:<regex>' patterns"
    )
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise _fail(field, value, allowed)
    for item in value:
        if not isinstance(item, str) or not item:
            raise RecipeError(
                f"Recipe.{field}: invalid entry {item!r} ({type(item).__name__}) in {list(value)!r}; "
                f"allowed: {allowed}"
            )
        if item.startswith(matching.REGEX_PREFIX):
            try:
                re.compile(item[len(matching.REGEX_PREFIX):])
            except re.error as e:
                raise RecipeError(f"Recipe.{field}: invalid regex in {item!r}: {e}") from None
    if not value and not allow_empty:
        raise _fail(field, value, allowed + " (at least one)")
    return tuple(value)


PRUNE_MODES = ("reroute", "drop")
# The router statistic experts are ranked by (the keys of torchforge.prune.RANK_BY).
PRUNE_RANK_BY = ("probability", "count", "weight")


@dataclass(frozen=True)
class PruneRecipe:
    """The `prune` section of a recipe: routed experts to drop before quantizing (see torchforge.prune).

    Either `expert_map` (a saved `expert_map.pt`, or the folder holding it) or `hit_map` (a saved [L, E]
    tensor, e.g. from calibration) with `keep_k` or `keep_ratio`. `balance_groups`: with `hit_map`, keep the
    same number of experts in every routing group of a group-limited router (DeepSeek `n_group`), so a
    reroute export keeps the model's group-limited routing. `rank_by`: with `hit_map`, the router statistic the
    experts are ranked by: "probability" (the default: the hit map, summed router probabilities; the file may
    be a bare tensor), "count" (top-k picks) or "weight" (routed weight received, what `drop` pruning removes);
    the last two need the file `RouterStats.save` writes (see torchforge.prune.RANK_BY).

    Paths: in a recipe read by `Recipe.from_file`, a relative `expert_map` / `hit_map` is relative to the recipe
    file's folder (from_file makes it absolute); built in Python or by `from_dict`, a path is used as given
    (relative to the working directory).
    """

    expert_map: str | None = None
    hit_map: str | None = None
    keep_k: int | None = None
    keep_ratio: float | None = None
    mode: str = "reroute"
    renormalize: bool = False
    balance_groups: bool = False
    rank_by: str = "probability"

    def __post_init__(self) -> None:
        if (self.expert_map is None) == (self.hit_map is None):
            raise RecipeError("Recipe.prune: give exactly one of 'expert_map' (a path to expert_map.pt) or 'hit_map' "
                              "(a path to a saved [L, E] hit map, with keep_k or keep_ratio)")
        for name in ("expert_map", "hit_map"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):  # '' joined to a recipe file's folder is the folder
                raise _fail(f"prune.{name}", v, "a non-empty path string")
        if self.hit_map is not None and (self.keep_k is None) == (self.keep_ratio is None):
            raise RecipeError("Recipe.prune: with 'hit_map' give exactly one of 'keep_k' (experts kept per layer) or "
                              "'keep_ratio' (fraction kept, 0 < r <= 1)")
        if self.expert_map is not None and (self.keep_k is not None or self.keep_ratio is not None):
            raise RecipeError("Recipe.prune: keep_k / keep_ratio apply when the map is built from 'hit_map'; a given "
                              "'expert_map' is used as it is (drop them, or give 'hit_map' instead)")
        if self.keep_k is not None:
            _check_int("prune.keep_k", self.keep_k, "a positive number of experts per layer")
            if self.keep_k < 1:
                raise _fail("prune.keep_k", self.keep_k, "a positive number of experts per layer")
        if self.keep_ratio is not None and (isinstance(self.keep_ratio, bool)
                                            or not isinstance(self.keep_ratio, (int, float))
                                            or not 0 < self.keep_ratio <= 1):
            raise _fail("prune.keep_ratio", self.keep_ratio, "a fraction 0 < r <= 1")
        _check_str_choice("prune.mode", self.mode, PRUNE_MODES)
        _check_bool("prune.renormalize", self.renormalize)
        if self.renormalize and self.mode != "drop":
            raise RecipeError(f"Recipe.prune: renormalize=True applies to mode='drop'; mode={self.mode!r} already "
                              "gives every token top_k kept experts (set mode: drop, or leave renormalize out)")
        _check_bool("prune.balance_groups", self.balance_groups)
        if self.balance_groups and self.hit_map is None:
            raise RecipeError("Recipe.prune: balance_groups applies when the map is built from 'hit_map'; a given "
                              "'expert_map' is used as it is")
        _check_str_choice("prune.rank_by", self.rank_by, PRUNE_RANK_BY)
        if self.rank_by != "probability" and self.hit_map is None:
            raise RecipeError("Recipe.prune: rank_by applies when the map is built from 'hit_map' (router statistics); "
                              "a given 'expert_map' is used as it is")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PruneRecipe":
        if not isinstance(d, Mapping):
            raise RecipeError(f"Recipe.prune must be a mapping, got {type(d).__name__}: {d!r}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in d if k not in valid]
        if unknown:
            raise RecipeError(f"unknown key(s) in recipe section 'prune': {', '.join(map(repr, unknown))}; valid keys: "
                              f"{', '.join(valid)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def _resolve_paths(self, folder: Path) -> "PruneRecipe":
        """A copy whose relative paths are joined to `folder` (absolute paths are kept)."""
        changes = {name: str(folder / path) for name in ("expert_map", "hit_map")
                   if (path := getattr(self, name)) is not None and not os.path.isabs(path)}
        return dataclasses.replace(self, **changes) if changes else self


@dataclass(frozen=True)
class Recipe:
    """How to quantize a model.

    Fields:
        scheme: quantization algorithm + format family, one of :data:`SCHEMES`.
        bits: weight bits (4 for the w4a16 schemes).
        group_size: weights per quantization group along the input dimension; a power of
            two >= 16. Per-channel quantization (group_size=-1) is not supported. Default: the
            scheme's (128; 16 for ``nvfp4``, its only block size).
        symmetric: True -> scale only; False -> scale and zero point.
        targets: patterns of the modules to quantize (see :mod:`torchforge.matching`).
        ignore: patterns of modules to leave unquantized, even if targeted.
        quantize_experts: quantize the routed experts of MoE blocks (fused 3-D experts
            modules of transformers 5, or per-expert ``experts.<i>.*`` linears).
        export_format: checkpoint layout written at export, one of :data:`EXPORT_FORMATS`.
            Default: the scheme's (``vllm-awq``; ``modelopt-nvfp4`` for ``nvfp4``).
        dtype: dtype of the unquantized tensors at export, one of :data:`DTYPES`.
        prune: optional :class:`PruneRecipe` (or its dict): routed experts pruned before quantizing, so
            pruning and quantization compose in one `torchforge.quantize` call.
    """

    scheme: str
    bits: int = 4
    group_size: int = SCHEME_DEFAULT
    symmetric: bool = True
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    quantize_experts: bool = True
    export_format: str = SCHEME_DEFAULT
    dtype: str = "bfloat16"
    prune: PruneRecipe | None = None

    def __post_init__(self) -> None:
        _check_str_choice("scheme", self.scheme, SCHEMES)
        for name, default in BASE_DEFAULTS.items():
            if getattr(self, name) is SCHEME_DEFAULT:
                object.__setattr__(self, name, SCHEME_DEFAULTS.get(self.scheme, {}).get(name, default))
        bits_allowed = _SCHEME_BITS[self.scheme]
        _check_int("bits", self.bits, f"{' or '.join(map(str, bits_allowed))} for scheme {self.scheme!r}")
        if self.bits not in bits_allowed:
            raise _fail("bits", self.bits, f"{' or '.join(map(str, bits_allowed))} for scheme {self.scheme!r}")
        gs_allowed = (
            f"a power of two >= {MIN_GROUP_SIZE} (16, 32, 64, 128, ...); "
            "per-channel quantization (group_size=-1) is not supported"
        )
        _check_int("group_size", self.group_size, gs_allowed)
        gs = self.group_size
        if gs < MIN_GROUP_SIZE or gs & (gs - 1):
            raise _fail("group_size", gs, gs_allowed)
        _check_bool("symmetric", self.symmetric)
        # Frozen dataclass: normalise lists (from users, YAML, JSON) to tuples in place.
        object.__setattr__(self, "targets", _to_patterns("targets", self.targets, allow_empty=False))
        object.__setattr__(self, "ignore", _to_patterns("ignore", self.ignore, allow_empty=True))
        _check_bool("quantize_experts", self.quantize_experts)
        _check_str_choice("export_format", self.export_format, EXPORT_FORMATS)
        _check_nvfp4(self)  # NVFP4 (issue 6): block 16, symmetric, NVFP4 export formats
        _check_str_choice("dtype", self.dtype, DTYPES)
        if isinstance(self.prune, Mapping):
            object.__setattr__(self, "prune", PruneRecipe.from_dict(self.prune))
        elif self.prune is not None and not isinstance(self.prune, PruneRecipe):
            raise _fail("prune", self.prune, "None, a PruneRecipe or a mapping of its fields")

    # ------------------------------------------------------------------ dicts

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-able dict of every field, in declaration order (tuples as lists)."""
        out = {}
        for name in self.field_names():
            value = getattr(self, name)
            if isinstance(value, PruneRecipe):
                value = value.to_dict()
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recipe:
        """Build from a dict of field values; unknown keys and bad values raise RecipeError."""
        if not isinstance(d, Mapping):
            raise RecipeError(f"a recipe must be a mapping of field names to values, got {type(d).__name__}: {d!r}")
        valid = cls.field_names()
        unknown = [k for k in d if k not in valid]
        if unknown:
            raise RecipeError(
                f"unknown recipe key(s): {', '.join(map(repr, unknown))}; valid keys: {', '.join(valid)}"
            )
        if "scheme" not in d:
            raise RecipeError(f"recipe is missing the required key 'scheme' (one of {', '.join(SCHEMES)})")
        return cls(**d)  # fields not given get the scheme's defaults (__post_init__)

    # ---------------------------------------------------------------- presets

    @staticmethod
    def presets() -> list[str]:
        """Names accepted by :meth:`from_preset`."""
        return list(PRESETS)

    @classmethod
    def from_preset(cls, name: str) -> Recipe:
        if not isinstance(name, str) or name not in PRESETS:
            raise RecipeError(f"unknown recipe preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls(**PRESETS[name])

    # ------------------------------------------------------------------ files

    @staticmethod
    def _file_kind(path: Path) -> str:
        suffix = path.suffix.lower()
        if suffix not in _FILE_SUFFIXES:
            raise RecipeError(
                f"recipe file {str(path)!r}: unsupported extension {path.suffix!r}; use one of "
                f"{', '.join(_FILE_SUFFIXES)}"
            )
        return "json" if suffix == ".json" else "yaml"

    def to_file(self, path: PathLike) -> Path:
        """Write as YAML (``.yaml``/``.yml``) or JSON (``.json``), atomically; returns the path.

        The text goes to a temporary file in the destination directory, which then replaces
        ``path`` (``os.replace``), so readers never see a half-written recipe. Relative prune paths
        (relative to the working directory here) are written absolute: in a file they would be relative
        to its folder (see :meth:`from_file`).
        """
        path = Path(path)
        kind = self._file_kind(path)
        data = self.to_dict()
        if self.prune is not None:  # relative to the working directory here, to the file's folder in a file
            data["prune"] = self.prune._resolve_paths(Path.cwd()).to_dict()
        if kind == "json":
            text = json.dumps(data, indent=2) + "\n"
        else:
            import yaml

            text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
        directory = path.parent
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            # mkstemp creates 0600; keep an existing file's mode, else the usual 0644.
            mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return path

    @classmethod
    def from_file(cls, path: PathLike) -> Recipe:
        """Read a recipe written by :meth:`to_file` (or by hand): a mapping of field values.

        Relative paths in it (``prune.expert_map``, ``prune.hit_map``) are relative to the file's folder, as in
        other config files, not to the working directory: they come back absolute. (:meth:`from_dict` and the
        constructor keep paths as given.)
        """
        path = Path(path)
        kind = cls._file_kind(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise RecipeError(f"cannot read recipe file {str(path)!r}: {e}") from None
        try:
            if kind == "json":
                data = json.loads(text, object_pairs_hook=_unique_keys)
            else:
                data = _load_yaml_unique(text)
        except Exception as e:  # json.JSONDecodeError, yaml.YAMLError, a key given twice
            raise RecipeError(f"recipe file {str(path)!r} is not valid {kind.upper()}: {e}") from None
        try:
            recipe = cls.from_dict(data)
        except RecipeError as e:
            raise RecipeError(f"recipe file {str(path)!r}: {e}") from None
        if recipe.prune is not None:
            recipe = dataclasses.replace(recipe, prune=recipe.prune._resolve_paths(path.parent.resolve()))
        return recipe

    # ------------------------------------------------------------ conversions

    def replace(self, **changes: Any) -> Recipe:
        """A validated copy with some fields changed."""
        valid = self.field_names()
        unknown = [k for k in changes if k not in valid]
        if unknown:
            raise RecipeError(
                f"unknown recipe field(s): {', '.join(map(repr, unknown))}; valid fields: {', '.join(valid)}"
            )
        return dataclasses.replace(self, **changes)

    @classmethod
    def coerce(cls, x: Recipe | str | os.PathLike | Mapping[str, Any]) -> Recipe:
        """A Recipe from a Recipe, a preset name, a dict, or a path to a .yaml/.yml/.json file."""
        if isinstance(x, Recipe):
            return x
        if isinstance(x, Mapping):
            return cls.from_dict(x)
        if isinstance(x, os.PathLike):
            return cls.from_file(x)
        if isinstance(x, str):
            if x in PRESETS:
                return cls.from_preset(x)
            if Path(x).suffix.lower() in _FILE_SUFFIXES:
                return cls.from_file(x)
            raise RecipeError(
                f"{x!r} is neither a recipe preset ({', '.join(PRESETS)}) nor a path to a "
                f"{'/'.join(_FILE_SUFFIXES)} recipe file"
            )
        raise RecipeError(
            f"cannot make a Recipe from {type(x).__name__} {x!r}: expected a Recipe, a preset name, "
            "a dict or a path to a .yaml/.yml/.json file"
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a ``torch.dtype``."""
        return getattr(torch, self.dtype)

    # --------------------------------------------------------------- matching

    def matches(self, name: str, module: nn.Module) -> bool:
        """True if this recipe quantizes ``module`` (named ``name``): targeted, not ignored,
        and not a routed expert when ``quantize_experts`` is False."""
        if not matching.is_target(name, module, self.targets, self.ignore):
            return False
        return self.quantize_experts or not matching.is_routed_expert(name, module)

    def select(self, model: nn.Module, check_fused: bool = True) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of every module of ``model`` this recipe quantizes, in model order.

        With ``check_fused`` (default), raises RecipeError if a group of modules that vLLM
        fuses into one layer (MLA's q_a_proj + kv_a_proj_with_mqa, q/k/v, gate/up) would be
        only partly quantized -- see :func:`torchforge.matching.paired_modules_error`.
        """
        selected = matching.select_modules(model, self.targets, self.ignore, predicate=self._expert_predicate)
        self._warn_unmatched(model, selected)
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        tied = [n for n, m in selected if embed is not None and getattr(m, "weight", None) is embed.weight]
        if tied:
            # a tied head shares the embedding table: quantizing it would either be dropped (vLLM and HF re-tie at
            # load, from embed_tokens) or silently left out (the streamed path, whose source has no lm_head tensor)
            raise RecipeError(f"{tied[0]} shares its weight with the input embeddings (tie_word_embeddings=True): "
                              f"it cannot be quantized apart from them; add '{tied[0]}' to the recipe's ignore list")
        if check_fused:
            error = matching.paired_modules_error(
                [n for n, _ in selected], [n for n, _ in model.named_modules()]
            )
            if error is not None:
                raise RecipeError(error)
        return selected

    def _warn_unmatched(self, model: nn.Module, selected) -> None:
        """A target list that selects nothing, or an ignore pattern of the user's (the defaults are written for every
        architecture) that matches no module, is most likely a typo or a name from another vocabulary: say so."""
        names = [(n, m) for n, m in model.named_modules() if n]
        quantized = any(type(m).__module__.startswith("torchforge.") for _, m in names)
        if not selected and not quantized:
            log.warning("recipe: targets %s select no module of %s (patterns match module names such as %r, or "
                        "class names such as 'Linear')", list(self.targets), type(model).__name__,
                        names[-1][0] if names else "")
        elif selected and not quantized and not any(matching.match_class(m, "Linear") or matching.is_fused_experts(m)
                                                    for _, m in selected):
            # e.g. targets ["LlamaDecoderLayer"]: a pattern selects the module itself, not the layers inside it
            log.warning("recipe: targets %s select %d module(s) of %s (e.g. %r) but no Linear layer or fused experts, "
                        "so nothing is quantized; a pattern does not reach into a module's children: target "
                        "'Linear' (with ignore) or the layers' own names", list(self.targets), len(selected),
                        type(model).__name__, selected[0][0])
        # a user's ignore list replaces the defaults, router patterns included
        routers = [n for n, m in selected if any(matching.match_pattern(n, m, p) for p in ROUTER_IGNORE)]
        if routers:
            log.warning("recipe: %d MoE router layer(s) of %s are selected and will be quantized (e.g. %r): the ignore "
                        "list replaces torchforge.recipe.DEFAULT_IGNORE, which leaves routers unquantized (routing is "
                        "sensitive to error); add %s to ignore, or start from ignore=[*DEFAULT_IGNORE, ...]",
                        len(routers), type(model).__name__, routers[0],
                        [p for p in ROUTER_IGNORE if p not in self.ignore])
        for p in self.ignore:
            if p not in DEFAULT_IGNORE and not any(matching.match_pattern(n, m, p) for n, m in names):
                log.warning("recipe: ignore pattern %r matches no module of %s; patterns match the in-memory module "
                            "names (e.g. %r), not checkpoint names", p, type(model).__name__,
                            next((n for n, _ in names if n.endswith("experts")), names[-1][0] if names else ""))

    def _expert_predicate(self, name: str, module: nn.Module) -> bool:
        return self.quantize_experts or not matching.is_routed_expert(name, module)
