"""Candidate configurations, enumerated from the registries so that new formats and codecs join automatically.

Every name registered in :data:`bytediet.quant.WEIGHT_FORMATS` and :data:`bytediet.kvcache.KV_CODECS`
becomes one or more candidate *specs*: a class may list its own with a ``candidate_specs()``
classmethod; otherwise the parameter sweeps in :data:`WEIGHT_VARIANTS` / :data:`KV_VARIANTS` apply;
otherwise the bare name is the only spec. A spec is kept only when it works on *this* model: it
must quantize a weight of each distinct input width of the model's linear layers (block and group
sizes must divide them — SmolLM2's hidden 576 rules out ``int4-g128``) and, for a KV codec, build
a cache page for the model's heads at the engine's block size.

KV candidates are led by **budgets** ``auto:<bits>`` (:mod:`bytediet.kvcache.auto`): each is planned per layer
and per K/V by calibration on the model as it will run (:mod:`bytediet.calibrate.kv_budget`), so the record and
the recommended run config carry the plan. The registered codecs stay as the plain anchors beside them.

Calibrated weight candidates come from :data:`bytediet.calibrate.base.CALIBRATION_METHODS` the
same way: a method lists the weight-format families it calibrates (its ``candidate_formats``
attribute; AWQ and GPTQ: int4, SmoothQuant: int8-w8a8, SparseGPT and Wanda: sparse24), and each family is tried
at the same spec its round-to-nearest candidate uses, so the two compare on one grid. A calibrated
spec is written ``FORMAT+METHOD`` (``int4-g64+awq``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from ..errors import ConfigError

# parameter sweeps of the built-in parametrised names (most preferred first: --quick keeps the first that fits)
WEIGHT_VARIANTS: dict[str, tuple[str, ...]] = {
    "int4": ("int4-g128", "int4-g64", "int4-g32", "int4-g128-sym", "int4-g64-sym", "int4-g32-sym"),
}
KV_VARIANTS: dict[str, tuple[str, ...]] = {
    "turboquant": ("turboquant3.5", "turboquant2.5", "turboquant4"),
    "turboquant_prod": ("turboquant_prod3.5",),
    "kivi": ("kivi4", "kivi2", "kivi4g16", "kivi2g16"),
}
# the references and their plain-float twins are not compression candidates on an fp32 model
REFERENCE_WEIGHTS = ("fp32",)
REFERENCE_KV = ("fp32",)
# --quick: one spec of each of these families (the first of its variants that fits the model)
QUICK_WEIGHT_FAMILIES = ("int8", "int4", "nvfp4", "sparse24")
QUICK_KV_FAMILIES = ("int8", "turboquant")
BUDGET_PREFIX = "auto:"


def split_method(spec: str) -> tuple[str, Optional[str]]:
    """``"int4-g64+awq"`` → ``("int4-g64", "awq")``; a spec without ``+`` has no calibration method."""
    fmt, _, method = spec.partition("+")
    return fmt, (method or None)


@dataclass(frozen=True)
class Candidate:
    """One configuration to measure: a weight format (with per-module overrides, optionally calibrated by a
    registered method) and a KV codec spec."""

    step: str  # "baseline" | "weights" | "kv" | "combined" | "sensitive"
    weights: Optional[str] = None  # None: the checkpoint as loaded
    kv: str = "auto"
    overrides: tuple[tuple[str, str], ...] = ()  # (fnmatch pattern, weight spec), first match wins
    method: Optional[str] = None  # calibration method (bytediet.calibrate.base.CALIBRATION_METHODS)
    activations: Optional[str] = None  # the checkpoint's own blocks at this activation precision (weights None)

    @classmethod
    def for_weights(
        cls, step: str, spec: str, kv: str = "auto", overrides: tuple[tuple[str, str], ...] = ()
    ) -> "Candidate":
        """A candidate from a weight spec that may carry ``+METHOD``."""
        fmt, method = split_method(spec)
        return cls(step, fmt, kv, overrides, method)

    @property
    def weight_spec(self) -> Optional[str]:
        """The weight spec with its method (``int4-g64+awq``), as the candidate lists write it."""
        return f"{self.weights}+{self.method}" if self.weights and self.method else self.weights

    @property
    def label(self) -> str:
        parts = [f"w={self.weight_spec or 'as loaded'}"]
        parts += [f"act={self.activations}"] if self.activations else []
        parts += [f"{pattern}={spec}" for pattern, spec in self.overrides]
        parts.append(f"kv={self.kv}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "label": self.label,
            "weights": self.weights,
            "method": self.method,
            "kv": self.kv,
            "overrides": dict(self.overrides),
            "activations": self.activations,
        }


@dataclass
class Enumeration:
    """Specs that fit the model, and why each other registered spec was left out."""

    specs: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _variants(registry, name: str, table: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    item = registry.get(name)
    if hasattr(item, "candidate_specs"):
        return tuple(item.candidate_specs())
    return table.get(name, (name,))


def _linear_widths(model) -> dict[int, int]:
    """{in_features: a matching out_features} over the model's linear layers."""
    from ..models.quantize import linear_layers

    return {layer.in_features: layer.out_features for _, layer in linear_layers(model)}


def weight_fits(spec: str, model) -> Optional[str]:
    """None when ``spec`` can quantize every linear-layer width of ``model``, else the reason it cannot."""
    from ..models.quantize import build_format

    try:
        fmt = build_format(spec)
        g = torch.Generator().manual_seed(0)
        for n_in, n_out in _linear_widths(model).items():
            fmt.quantize(torch.randn(min(n_out, 16), n_in, generator=g) * 0.05)
    except (ConfigError, ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


def kv_fits(spec: str, model, block_size: Optional[int] = None) -> Optional[str]:
    """None when the codec ``spec`` can page ``model``'s KV heads at ``block_size`` (None: the engine's
    default for the codec), else the reason."""
    from ..kvcache import get_kv_codec
    from ..kvcache.base import default_block_size

    c = model.config
    try:
        codec = get_kv_codec(spec, model.dtype)
        with warnings.catch_warnings():  # a one-block shape check, never run: the uncalibrated codec's warning is moot
            warnings.simplefilter("ignore", UserWarning)
            codec.create_cache(
                0, 1, block_size or default_block_size(codec), c.num_kv_heads, c.head_dim, model.dtype, "cpu"
            )
    except (ConfigError, KeyError, ValueError) as exc:
        return str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
    return None


def budget_fits(spec: str, model) -> Optional[str]:
    """None when the budget ``spec`` (``auto:<bits>``) can be planned for ``model`` — at least the cheapest
    per-layer candidates fit it — else the reason (a malformed spec, a budget below every candidate)."""
    from ..calibrate.kv_budget import candidate_bytes, check_budget
    from ..calibrate.kv_candidates import DEFAULT_CANDIDATES, candidate_roles
    from ..kvcache import get_kv_codec

    c = model.config
    try:
        codec = get_kv_codec(spec, model.dtype)
        # an entry fits when its codec does ("k=kivi4g16" names codec kivi4g16)
        fitting = [e for e in DEFAULT_CANDIDATES if all(kv_fits(c, model, 16) is None for c in candidate_roles([e]))]
        if not fitting:
            raise ConfigError(f"no KV codec of a budget's plan can store head_dim {c.head_dim}")
        check_budget(codec.budget, candidate_bytes(fitting, c.num_kv_heads, c.head_dim), c.num_kv_heads, c.head_dim)
    except (ConfigError, KeyError) as exc:
        return str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
    return None


def _enumerate(registry, table, reference, fits, quick_families, quick: bool, only) -> Enumeration:
    out = Enumeration()
    names = [n for n in registry.names() if n not in reference]
    if only is not None:
        wanted = list(dict.fromkeys(s.strip().lower() for s in only if s.strip()))
        specs_by_family = [(s, (s,)) for s in wanted]
    else:
        if quick:
            names = [n for n in quick_families if n in registry]
        specs_by_family = [(n, _variants(registry, n, table)) for n in names]
    for _family, specs in specs_by_family:
        for spec in specs:
            reason = fits(spec)
            if reason is None:
                out.specs.append(spec)
                if quick and only is None:
                    break  # one spec per family
            else:
                out.skipped[spec] = reason
    return out


def weight_specs(model, quick: bool = False, only: Optional[list[str]] = None) -> Enumeration:
    """Weight-format specs to try on ``model`` (every registered format and variant; ``only`` restricts)."""
    from ..quant import WEIGHT_FORMATS

    return _enumerate(
        WEIGHT_FORMATS,
        WEIGHT_VARIANTS,
        REFERENCE_WEIGHTS,
        lambda s: weight_fits(s, model),
        QUICK_WEIGHT_FAMILIES,
        quick,
        only,
    )


def kv_specs(
    model,
    quick: bool = False,
    only: Optional[list[str]] = None,
    block_size: Optional[int] = None,
    budgets: tuple[float, ...] = (),
) -> Enumeration:
    """KV specs to try on ``model``: the budgets ``auto:<bits>`` first, then every registered codec and variant
    (``quick``: one per :data:`QUICK_KV_FAMILIES`). ``only`` restricts to exactly those specs (budgets among them)."""
    from ..kvcache import KV_CODECS

    def fits(spec: str) -> Optional[str]:
        return budget_fits(spec, model) if spec.startswith(BUDGET_PREFIX) else kv_fits(spec, model, block_size)

    out = Enumeration()
    for spec in dict.fromkeys(f"{BUDGET_PREFIX}{b:g}" for b in (budgets if only is None else ())):
        reason = fits(spec)
        if reason is None:
            out.specs.append(spec)
        else:
            out.skipped[spec] = reason
    rest = _enumerate(KV_CODECS, KV_VARIANTS, REFERENCE_KV, fits, QUICK_KV_FAMILIES, quick, only)
    return Enumeration(out.specs + rest.specs, {**out.skipped, **rest.skipped})


def calibrated_specs(
    model,
    rtn: Enumeration,
    quick: bool = False,
    methods: Optional[tuple[str, ...]] = None,
    only: Optional[list[str]] = None,
) -> Enumeration:
    """``FORMAT+METHOD`` specs for every registered calibration method and the families it declares.

    Each family uses the first spec of it that ``rtn`` (the round-to-nearest enumeration) kept, else the
    first of its variants that fits ``model``. ``methods``: restrict to these method names. ``quick``
    keeps one method per family (the first registered), for the families ``rtn`` measured. ``only``:
    exactly these ``FORMAT+METHOD`` specs (each checked against the model and the method registry).
    """
    from ..calibrate import calibration_method_names
    from ..quant import WEIGHT_FORMATS

    out = Enumeration()
    if only is not None:
        for spec in dict.fromkeys(s.strip().lower() for s in only):
            fmt, method = split_method(spec)
            reason = _method_problem(method, fmt) or weight_fits(fmt, model)
            if reason:
                out.skipped[spec] = reason
            else:
                out.specs.append(spec)
        return out
    done_families: set[str] = set()
    for method in calibration_method_names() if methods is None else list(dict.fromkeys(methods)):
        problem = _method_problem(method)
        if problem:
            out.skipped[f"+{method}"] = problem
            continue
        for family in _method_families(method):
            if quick and family in done_families:
                continue
            chosen = next((s for s in rtn.specs if s == family or s.startswith(family + "-")), None)
            if chosen is None and quick:
                continue  # --quick calibrates only the families it also measures rounded to nearest
            if chosen is None and family in WEIGHT_FORMATS:
                chosen = next(
                    (s for s in _variants(WEIGHT_FORMATS, family, WEIGHT_VARIANTS) if weight_fits(s, model) is None),
                    None,
                )
            if chosen is None:
                out.skipped[f"{family}+{method}"] = f"no {family} spec fits this model"
                continue
            out.specs.append(f"{chosen}+{method}")
            done_families.add(family)
    return out


def activation_specs(spec: str) -> list[str]:
    """The other activation precisions of a weight spec (``FORMAT[+METHOD]``) that its native kernel offers.

    ``int4-g64`` → ``["int4-g64-a8", "int4-g64-af32"]`` (int8 activations as llama.cpp's, float activations;
    the spec itself is the q16 default), ``gguf-q4_1-a8`` → ``["gguf-q4_1", "gguf-q4_1-af32"]``. Formats
    without the choice (fp8 and 2:4 fp16 multiply float activations, int8-w8a8 rounds per token by definition,
    the float formats have no native kernel) give ``[]``. Each spec is checked to read back as the mode it names.
    """
    from ..models.quantize import build_format
    from ..quant.common import ACTIVATION_MODES, NativeActivations

    fmt_spec, method = split_method(spec)
    try:
        fmt = build_format(fmt_spec)
    except (ConfigError, KeyError, ValueError):
        return []
    if not isinstance(fmt, NativeActivations) or fmt.activations not in ACTIVATION_MODES:
        return []
    out = []
    for mode in ACTIVATION_MODES:
        if mode == fmt.activations:
            continue
        variant = build_format(fmt_spec).with_activations(mode).spec()
        try:
            if build_format(variant).activations != mode:
                continue
        except (ConfigError, KeyError, ValueError):
            continue  # a format whose spec cannot name the mode
        out.append(f"{variant}+{method}" if method else variant)
    return out


def as_loaded_activation_modes(model) -> list[str]:
    """The activation precisions other than the default (``q16``) that ``model``'s native block layers offer —
    the checkpoint's own blocks (a GGUF's Q4_1, say) at llama.cpp's int8 activations or float ones; ``[]`` when
    no linear layer has a native kernel with the choice."""
    from ..quant.common import ACTIVATION_MODES, NativeActivations

    native = [lin.format for _, lin in model.linear_layers() if isinstance(lin.format, NativeActivations)]
    if not native:
        return []
    return [mode for mode in ACTIVATION_MODES if mode != native[0].activations]


def _method_families(method: str) -> tuple[str, ...]:
    from ..calibrate import get_calibration_method

    return tuple(getattr(get_calibration_method(method), "candidate_formats", ()))


def _method_problem(method: Optional[str], fmt: Optional[str] = None) -> Optional[str]:
    """Why ``method`` cannot calibrate (``fmt``), or None."""
    if not method:
        return "write a calibrated spec as FORMAT+METHOD, e.g. int4-g64+awq"
    try:
        families = _method_families(method)
    except ConfigError as exc:
        return str(exc)
    if not families:
        return f"the calibration method {method!r} declares no candidate_formats"
    if fmt is not None and not any(fmt == f or fmt.startswith(f + "-") for f in families):
        return f"{method} calibrates {', '.join(families)}, not {fmt}"
    return None
