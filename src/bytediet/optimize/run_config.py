"""Run configuration files: one JSON object naming the model and how to run it.

``bytediet optimize`` writes one (``recommended.json``); ``bytediet generate --config`` and
``bytediet serve --config`` read it. Example::

    {"bytediet_run_config": 1,
     "model": "default",
     "dtype": "float32",
     "weights": "int4-g64",
     "weight_overrides": {"lm_head": "int8", "model.layers.0.*": "int8"},
     "kv_cache_dtype": "turboquant3.5",
     "kv_calibration": {"corpus": "prideprejudice", "windows": 2, "window_len": 1024, "seed": 0},
     "kv_calibration_state": null,
     "engine": {"kv_cache_memory": "1GiB", "block_size": 16},
     "notes": {"source": "bytediet optimize", "expected": {"ppl": 13.1}}}

``weights`` applies to every linear layer; ``weight_overrides`` maps ``fnmatch`` patterns on layer
names to other formats (first match wins; :class:`bytediet.models.quantize.QuantizeConfig`). ``engine``
holds :class:`bytediet.engine.llm.LLM` keyword arguments (:data:`ENGINE_KEYS`). ``kv_calibration``
(optional) calibrates a KV codec that has calibration hooks (fp8 scales, TurboQuant means/outliers/
layout) on those windows of the corpus's calibration split when the config is loaded — one forward
pass over them, the same windows every time, so a run reproduces what ``bytediet optimize`` measured.
``kv_calibration_state`` (optional) is the calibration itself, as data: what the codec learnt (a dict, e.g.
the per-layer plan of a budget ``"auto:4.5"``) or the path of a file holding it (``.json`` or ``torch.save``,
relative to this file); given, the codec is rebuilt from its name and this state with no calibration pass.
The file holds names and data, never objects: the engine builds the codec once
(:meth:`bytediet.kvcache.config.CacheConfig.build_codec`).
``notes`` is free-form
and ignored when loading. Unknown keys are errors, so a typo never silently changes a run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from ..errors import ConfigError

VERSION = 1
ENGINE_KEYS = (
    "kv_cache_memory",
    "block_size",
    "num_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "long_prefill_token_threshold",
    "scheduling_policy",
    "speculative_config",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "seed",
    "num_threads",
    "keep_packed",
    "activations",
)
DTYPES = ("float32", "bfloat16", "float16")
_KEYS = (
    "bytediet_run_config",
    "model",
    "dtype",
    "weights",
    "weight_overrides",
    "kv_cache_dtype",
    "kv_calibration",
    "kv_calibration_state",
    "engine",
    "notes",
)
_KV_CALIBRATION_KEYS = {"corpus": str, "windows": int, "window_len": int, "seed": int}


@dataclass(frozen=True)
class RunConfig:
    """A validated run configuration (see the module docstring for the file format)."""

    model: str
    dtype: str = "float32"
    weights: Optional[str] = None
    weight_overrides: Mapping[str, str] = field(default_factory=dict)
    kv_cache_dtype: str = "auto"
    kv_calibration: Optional[Mapping[str, Any]] = None
    kv_calibration_state: Any = None  # a dict of plain data, or a file path
    engine: Mapping[str, Any] = field(default_factory=dict)
    notes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_overrides", dict(self.weight_overrides))
        object.__setattr__(self, "engine", dict(self.engine))
        object.__setattr__(self, "notes", dict(self.notes))
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("run config: 'model' must name a checkpoint (a path, 'default' or 'gemma3-270m')")
        if self.dtype not in DTYPES:
            raise ConfigError(f"run config: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.weight_overrides and not self.weights:
            raise ConfigError("run config: 'weight_overrides' needs 'weights' (the format of the other layers)")
        self.quantize_config()  # validates every weight spec
        unknown = sorted(set(self.engine) - set(ENGINE_KEYS))
        if unknown:
            raise ConfigError(f"run config: unknown engine setting(s) {unknown}; known: {', '.join(ENGINE_KEYS)}")
        from ..quant.common import ACTIVATION_MODES

        if self.engine.get("activations", "q16") not in ACTIVATION_MODES:
            raise ConfigError(
                f"run config: engine.activations must be one of {', '.join(ACTIVATION_MODES)}, got "
                f"{self.engine['activations']!r}"
            )
        from ..kvcache import get_kv_codec

        try:
            get_kv_codec(self.kv_cache_dtype)
        except KeyError as exc:
            raise ConfigError(f"run config: kv_cache_dtype: {exc.args[0]}") from None
        if not isinstance(self.kv_cache_dtype, str):
            raise ConfigError(
                "run config: kv_cache_dtype must be a codec name; its calibration goes in "
                "kv_calibration (a recipe) or kv_calibration_state (the data)"
            )
        if self.kv_calibration_state is not None and not isinstance(self.kv_calibration_state, (dict, str)):
            raise ConfigError("run config: kv_calibration_state must be an object (the state) or a file path")
        if self.kv_calibration is not None:
            cal = dict(self.kv_calibration)
            bad = {
                k: v
                for k, v in cal.items()
                if k not in _KV_CALIBRATION_KEYS or not isinstance(v, _KV_CALIBRATION_KEYS[k])
            }
            if bad or set(cal) != set(_KV_CALIBRATION_KEYS) or cal["windows"] < 1 or cal["window_len"] < 2:
                raise ConfigError(
                    f"run config: kv_calibration must be {{corpus: str, windows: int >= 1, "
                    f"window_len: int >= 2, seed: int}}, got {cal}"
                )
            object.__setattr__(self, "kv_calibration", cal)

    def quantize_config(self):
        """The :class:`QuantizeConfig` of ``weights`` + ``weight_overrides`` (None when weights are as loaded)."""
        if not self.weights:
            return None
        from ..models.quantize import QuantizeConfig

        return QuantizeConfig(format=self.weights, overrides=self.weight_overrides)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytediet_run_config": VERSION,
            "model": self.model,
            "dtype": self.dtype,
            "weights": self.weights,
            "weight_overrides": dict(self.weight_overrides),
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_calibration": self.kv_calibration,
            "kv_calibration_state": self.kv_calibration_state,
            "engine": dict(self.engine),
            "notes": dict(self.notes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunConfig":
        if not isinstance(d, Mapping):
            raise ConfigError("run config: the file must hold one JSON object")
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            raise ConfigError(f"run config: unknown key(s) {unknown}; known: {', '.join(_KEYS)}")
        if d.get("bytediet_run_config", VERSION) != VERSION:
            raise ConfigError(f"run config: version {d['bytediet_run_config']} is not supported (this is {VERSION})")
        if "model" not in d:
            raise ConfigError("run config: 'model' is required")
        return cls(
            model=d["model"],
            dtype=d.get("dtype", "float32"),
            weights=d.get("weights"),
            weight_overrides=d.get("weight_overrides") or {},
            kv_cache_dtype=d.get("kv_cache_dtype", "auto"),
            kv_calibration=d.get("kv_calibration"),
            kv_calibration_state=d.get("kv_calibration_state"),
            engine=d.get("engine") or {},
            notes=d.get("notes") or {},
        )

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def read_run_config(path: str | Path) -> RunConfig:
    """Parse and validate a run config file; a relative model path is taken relative to the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the run config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"run config {path} is not valid JSON: {exc}") from None
    config = RunConfig.from_dict(data)
    model = Path(config.model).expanduser()
    if not model.is_absolute() and not model.exists() and (path.parent / model).exists():
        config = RunConfig.from_dict({**config.to_dict(), "model": str(path.parent / model)})
    state = config.kv_calibration_state
    if isinstance(state, str) and not Path(state).expanduser().is_absolute() and (path.parent / state).exists():
        config = RunConfig.from_dict({**config.to_dict(), "kv_calibration_state": str(path.parent / state)})
    return config


def load_run_config(path: str | Path) -> dict[str, Any]:
    """Keyword arguments for :class:`bytediet.engine.llm.LLM` from a run config file.

    Uniform weights travel as ``weights=``; with per-module overrides or a KV calibration recipe the model is
    loaded (and quantized) here and handed over as ``loaded=(model, tokenizer)``, since ``LLM(weights=...)``
    takes a single format and the codec is calibrated on the model as it will run. The KV codec travels as
    ``kv_cache_dtype`` (its name) plus ``kv_calibration_state`` (the file's, or the one the recipe produced).
    """
    config = read_run_config(path)
    kwargs: dict[str, Any] = {
        "model": config.model,
        "dtype": config.dtype,
        "weights": config.weights,
        "kv_cache_dtype": config.kv_cache_dtype,
        **config.engine,
    }
    if config.kv_calibration_state is not None:
        kwargs["kv_calibration_state"] = config.kv_calibration_state
    if config.weight_overrides or (config.kv_calibration and config.kv_calibration_state is None):
        from ..eval.harness import calibrated_kv_codec
        from ..models.loader import load_model
        from ..models.quantize import quantize

        # as LLM(model) would load it: a GGUF's own blocks stay packed unless weights re-quantize them
        model, tokenizer = load_model(
            config.model,
            dtype=config.dtype,
            weights=None,
            keep_packed=not config.weights and config.engine.get("keep_packed", True),
            activations=config.engine.get("activations", "q16"),
        )
        if config.weights:
            quantize(model, config.quantize_config())
        kwargs.update(weights=None, loaded=(model, tokenizer))
        if config.kv_calibration and config.kv_calibration_state is None:
            from ..kvcache.base import codec_config

            codec = calibrated_kv_codec(config.kv_cache_dtype, model, tokenizer, config.kv_calibration)
            state = codec_config(codec)[1]
            if state is not None:
                kwargs["kv_calibration_state"] = state
    return kwargs
