"""Calibration data for post-training quantization: a seeded token set and per-layer activation statistics.

* :class:`CalibrationConfig` says how much text; the caller cuts the windows
  (:func:`bytediet.eval.corpus.calibration_windows`: ``samples`` windows of ``seq_len`` tokens from the
  corpus's *calibration* split, disjoint from every evaluation window, each prefixed with BOS).
* :class:`BlockRunner` runs those windows through the decoder one block at a time, keeping only the
  hidden states between blocks (N × L × hidden floats), so the whole-model lm_head (262k columns on
  Gemma) never runs and methods can quantize block i before computing the inputs of block i + 1
  (GPTQ's sequential scheme, Frantar et al. 2022, arXiv 2210.17323, §4). On a model whose blocks are packed
  (a GGUF as loaded, ``bytediet optimize``'s candidates), :meth:`BlockRunner.begin` dequantizes one block to
  float32 and :meth:`BlockRunner.end` quantizes it to the config's formats: one block's float weights at a
  time, as llm-compressor's sequential pipeline holds them; on a float model both do nothing.
* :func:`capture` hangs forward pre-hooks on ``Linear`` modules and accumulates :class:`LinearStats`
  of their inputs: mean |x| and max |x| per input channel (AWQ, SmoothQuant), the Gram matrix Σ xᵀx
  (GPTQ's Hessian) and a seeded sample of input rows (AWQ's search objective).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterator, Mapping, Optional

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..kvcache import AttentionMetadata, get_kv_codec
from ..models.layers import Linear
from ..models.quantize import build_format, quantize, quantize_layer
from ..progress import Progress, no_progress
from ..registry import Registry


@dataclass(frozen=True)
class CalibrationConfig:
    """How much calibration text: ``samples`` windows × ``seq_len`` tokens of ``corpus`` (seeded)."""

    samples: int = 128
    seq_len: int = 512
    corpus: str = "austen"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1 or self.seq_len < 2:
            raise ConfigError(f"calibration needs samples >= 1 and seq_len >= 2, got {self.samples} × {self.seq_len}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LinearStats:
    """Running statistics of one linear layer's inputs x (T, in_features) over the calibration set."""

    in_features: int
    tokens: int = 0
    abs_sum: Optional[torch.Tensor] = None  # (in,) float64, Σ |x|
    abs_max: Optional[torch.Tensor] = None  # (in,) float32, max |x|
    gram: Optional[torch.Tensor] = None  # (in, in) float64, Σ xᵀx (only when asked)
    samples: list[torch.Tensor] = field(default_factory=list)  # rows of x, float32

    @property
    def mean_abs(self) -> torch.Tensor:
        """(in,) mean |x_j| per input channel (AWQ's activation magnitude)."""
        return (self.abs_sum / max(self.tokens, 1)).float()

    @property
    def hessian(self) -> torch.Tensor:
        """(in, in) float64 H = 2 XᵀX / T, the Hessian of ‖XWᵀ − XŴᵀ‖² / T per output row (GPTQ eq. 1)."""
        if self.gram is None:
            raise ValueError("this capture did not accumulate the Gram matrix (capture(..., hessian=True))")
        return 2.0 * self.gram / max(self.tokens, 1)

    def take_hessian(self) -> torch.Tensor:
        """:attr:`hessian`, computed in the Gram matrix's own storage (the stats no longer hold a Gram)."""
        if self.gram is None:
            raise ValueError("this capture did not accumulate the Gram matrix (capture(..., hessian=True))")
        h, self.gram = self.gram, None
        with torch.inference_mode():  # the Gram was summed in the forward passes' inference mode
            return h.mul_(2.0).div_(max(self.tokens, 1))

    def sample(self) -> torch.Tensor:
        """(S, in) the sampled input rows."""
        return torch.cat(self.samples) if self.samples else torch.zeros(0, self.in_features)

    def update(self, x: torch.Tensor, want_gram: bool, rows: Optional[torch.Tensor]) -> None:
        x = x.detach().reshape(-1, self.in_features).float()
        a = x.abs()
        self.abs_sum = a.sum(0, dtype=torch.float64) + (0 if self.abs_sum is None else self.abs_sum)
        amax = a.amax(0)
        self.abs_max = amax if self.abs_max is None else torch.maximum(self.abs_max, amax)
        if want_gram:
            g = x.t() @ x  # float32 product per window, float64 sum across windows (added without a float64 copy)
            self.gram = g.double() if self.gram is None else self.gram.add_(g)
        if rows is not None:
            self.samples.append(x[rows[rows < x.shape[0]]].clone())
        self.tokens += x.shape[0]


@contextmanager
def capture(
    modules: Mapping[str, nn.Module], hessian: bool = False, rows_per_call: int = 0, seed: int = 0
) -> Iterator[dict[str, LinearStats]]:
    """Accumulate input statistics of ``modules`` (name → Linear) while the ``with`` body runs them.

    ``rows_per_call``: how many input rows to keep from each call (chosen by a generator seeded with
    ``seed``; the same positions for every module of one call, so samples line up across layers).
    """
    stats = {name: LinearStats(m.in_features) for name, m in modules.items()}
    gen = torch.Generator().manual_seed(seed)
    row_sets: list[torch.Tensor] = []  # the k-th call of every module keeps the rows row_sets[k]
    calls = {name: 0 for name in modules}

    def rows_for(name: str, n: int) -> Optional[torch.Tensor]:
        if rows_per_call <= 0:
            return None
        k = calls[name]
        calls[name] += 1
        if k == len(row_sets):
            row_sets.append(torch.randperm(n, generator=gen)[:rows_per_call].sort().values)
        return row_sets[k]

    def hook_for(name: str):
        def hook(module, args):
            x = args[0]
            stats[name].update(x, hessian, rows_for(name, x.reshape(-1, module.in_features).shape[0]))

        return hook

    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in modules.items()]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


class BlockRunner:
    """Calibration windows through the decoder, one block at a time.

    ``hidden`` is (N, L, hidden) in the model's dtype. ``run_block(i, hidden)`` returns block i's
    outputs for every window (one Linear call per window, so :func:`capture` samples each window).
    ``config``: the formats :meth:`end` quantizes a block to that :meth:`begin` made float; ``packed``
    collects them ({layer: packed}, for ``quantize(model, config, prepacked=...)``).
    """

    def __init__(self, model: nn.Module, windows: torch.Tensor, block_size: int = 16, config=None) -> None:
        if windows.dim() != 2 or windows.shape[0] < 1:
            raise ConfigError(f"calibration windows must be (N, L) token ids, got shape {tuple(windows.shape)}")
        self.model, self.windows, self.block_size = model, windows.to(model.device), block_size
        self.length = windows.shape[1]
        self.meta = AttentionMetadata.for_single_sequence(self.length, block_size, model.device)
        self.codec = get_kv_codec("auto", model.dtype)
        self.config = config
        self.floated: set[str] = set()  # layers begin() dequantized from packed blocks
        self.packed: dict[str, dict] = {}

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def begin(self, index: int) -> None:
        """Block ``index``'s packed (non-float) linear layers dequantized to float32 for calibration."""
        fp32 = build_format("fp32")
        for name, layer in block_linears(self.layers[index], f"model.layers.{index}").items():
            if layer.format is not None and layer.format.spec() not in FLOAT_SPECS:
                layer.set_packed(fp32, fp32.quantize(layer.dequantized_weight()))
                self.floated.add(name)

    def end(self, index: int) -> None:
        """The layers :meth:`begin` made float in block ``index`` quantized to ``config``'s formats (a layer it
        skips stays float32, as an fp32 load holds it); the float copies are dropped."""
        for name, layer in block_linears(self.layers[index], f"model.layers.{index}").items():
            if name in self.floated and name not in self.packed and self.config is not None:
                quantize_layer(name, layer, self.config)
                if layer.format.spec() not in FLOAT_SPECS:
                    self.packed[name] = layer.packed

    @torch.inference_mode()
    def embed(self) -> torch.Tensor:
        """(N, L, hidden) inputs of block 0."""
        return self.model.embed(self.windows)

    @torch.inference_mode()
    def run_block(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """(N, L, hidden) → block ``index``'s outputs, each window in a fresh KV cache."""
        c = self.model.config
        block = self.layers[index]
        outs = []
        for h in hidden:
            cache = self.codec.create_cache(
                index,
                math.ceil(self.length / self.block_size),
                self.block_size,
                c.num_kv_heads,
                c.head_dim,
                self.model.dtype,
                self.model.device,
            )
            outs.append(block(h, self.meta, cache))
        return torch.stack(outs)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, L, vocab) float32 logits from the last block's outputs (final norm + lm_head)."""
        return torch.stack([self.model.lm_head(self.model.model.norm(h)).float() for h in hidden])


FLOAT_SPECS = ("fp32", "bf16", "fp16")


def block_linears(block: nn.Module, prefix: str) -> dict[str, nn.Module]:
    """Qualified name → Linear for the linear layers inside one decoder block."""
    return {f"{prefix}.{n}": m for n, m in block.named_modules() if isinstance(m, Linear)}


def require_windows(windows: Optional[torch.Tensor], method: str) -> None:
    """Raise unless ``windows`` holds calibration tokens: ``method`` chooses from data and has none without it."""
    if windows is None or windows.numel() == 0:
        raise ConfigError(
            f"{method} needs calibration data: pass calibration windows (bytediet quantize "
            f"--calibrate {method} --calib-samples N --calib-len L, N ≥ 1); without calibration, "
            "a sparse format prunes by magnitude"
        )


def pack_blocks_in_order(
    model: nn.Module,
    config,
    windows: torch.Tensor,
    progress: Progress,
    desc: str,
    wants_stats: Callable[[object], bool],
    pack: Callable[[torch.Tensor, object, Optional[LinearStats]], dict],
) -> dict[str, dict]:
    """Calibrate decoder blocks one after the other (GPTQ's sequential scheme, arXiv 2210.17323 §4).

    For block i: the inputs of its layers whose format ``wants_stats(fmt)`` are captured (with the Gram
    matrix) on the outputs of the already-packed blocks 0..i−1; every layer of the block with a format
    in ``config`` is packed by ``pack(weight, fmt, stats or None)`` and installed for the rest of the
    pass; the block is re-run to give block i+1 its inputs. The model's weights are restored at the end:
    install the returned {layer: packed} with ``quantize(model, config, prepacked=...)``. A packed model's
    blocks are calibrated from their dequantized blocks one at a time (:meth:`BlockRunner.begin`) and keep
    their new weights.
    """
    runner = BlockRunner(model, windows, config=config)
    hidden = runner.embed()
    result: dict[str, dict] = {}
    originals = {}
    try:
        for i in progress(range(len(runner.layers)), desc):
            runner.begin(i)
            linears = block_linears(runner.layers[i], f"model.layers.{i}")
            fmts = {name: build_format(spec) for name in linears if (spec := config.spec_for(name)) is not None}
            with capture({n: m for n, m in linears.items() if wants_stats(fmts.get(n))}, hessian=True) as stats:
                runner.run_block(i, hidden)
            for name, fmt in fmts.items():
                layer = linears[name]
                try:
                    packed = pack(layer.dequantized_weight(), fmt, stats.pop(name, None))  # its Gram freed after
                except ConfigError as exc:
                    raise ConfigError(f"layer {name} ({layer.out_features}×{layer.in_features}): {exc}") from None
                if name not in runner.floated:  # a packed model's float copy is not worth restoring
                    originals[name] = (layer, layer.format, layer.packed)
                layer.set_packed(fmt, packed)
                result[name] = packed
            hidden = runner.run_block(i, hidden)  # packed block → inputs of the next
            for name in fmts:  # its kernels' repacked copies are made again where the candidate is measured
                linears[name].drop_native()
    finally:
        for layer, fmt, packed in originals.values():
            layer.set_packed(fmt, packed)
    return result


# ------------------------------------------------------------------------------ methods by name
CALIBRATION_METHODS: Registry = Registry("calibration method")


def calibration_method_names() -> list[str]:
    """Every registered calibration method (built-in ones register when :mod:`bytediet.calibrate` is imported)."""
    return CALIBRATION_METHODS.names()


def get_calibration_method(name: str) -> Callable:
    """``method(model, config, windows, progress, **settings) → (prepacked | None, record)`` registered as ``name``."""
    try:
        return CALIBRATION_METHODS.get(name)
    except KeyError as exc:
        raise ConfigError(exc.args[0]) from None


def calibrate_and_quantize(
    model,
    config,
    method: str,
    windows: torch.Tensor,
    calib: CalibrationConfig = CalibrationConfig(),
    progress: Progress = no_progress,
    **options,
):
    """Calibrate ``model`` with ``method`` on ``windows`` (N, L) token ids, then ``quantize(model, config)``.

    ``windows`` are cut from ``calib``'s corpus by the caller (:func:`bytediet.eval.corpus.calibration_windows`).

    The calibration settings and the method's record are stored in the config (and so in a saved checkpoint).
    ``options`` go to the method's settings (e.g. ``n_grid=10`` for AWQ, ``act_order=True`` for GPTQ,
    ``alpha=0.8`` for SmoothQuant). Returns the :class:`~bytediet.models.quantize.QuantizeSummary`.
    """
    run = get_calibration_method(method)
    prepacked, record = run(model, config, windows, progress, **options)
    config = replace(config, calibration={**calib.to_dict(), "samples": int(windows.shape[0]), **record})
    return quantize(model, config, prepacked=prepacked)
