"""Recovery fine-tuning of a pruned or INT4 model: train what the format leaves free to match the dense model.

After one-shot pruning (magnitude, Wanda, SparseGPT) the surviving weights of every pruned layer
(:class:`~bytediet.quant.pruning.PrunedFormat`) are trained by knowledge distillation from the dense
model (Hinton et al. 2015, arXiv 1503.02531): on calibration windows the loss is the mean over positions
of KL(p_dense ‖ p_pruned) between the next-token distributions. The pruned weights stay exactly zero
(the forward multiplies by the frozen mask, so they get no gradient), every other parameter — norms,
embeddings, layers left dense — is frozen. Sparse fine-tuning of this kind is how the 2:4 papers recover
accuracy (Mishra et al. 2021, arXiv 2104.08378, §3; SparseGPT's and Wanda's LoRA/fine-tune follow-ups).

Runs in float32 on the CPU with AdamW, a linear warm-up and a linear decay to 0 at ``steps``. A token
budget (``max_tokens``) stops training early. State (trained weights, optimizer, step, tokens, history)
is written atomically to ``state_path`` every ``save_every`` steps, and a run given the same path
resumes from it. At the end the trained weights are packed again in each layer's own format under the
same mask, so the model saves as an ordinary bytediet checkpoint.

INT4 group-wise layers (:class:`~bytediet.quant.int4.Int4`) are recovered the same way with their 4-bit codes
frozen and only the per-group scales (and zero-point offsets) trained — PEQA's recipe (Kim et al. 2023,
"Memory-Efficient Fine-Tuning of Compressed LLMs via sub-4-bit Integer Quantization", arXiv 2305.14152): the
checkpoint keeps its exact bytes per weight, and the trained scales are stored back in float16. What is
trained in a layer is its :class:`Trainable` (one class per kind of format, chosen by :func:`trainable_for`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..kvcache import AttentionMetadata
from ..progress import no_meter
from ..quant.base import Packed, WeightFormat
from ..quant.fp4 import unpack_nibbles
from ..quant.int4 import Int4
from ..quant.pruning import PrunedFormat


@dataclass(frozen=True)
class RecoveryConfig:
    steps: int = 200
    lr: float = 1e-4
    warmup: int = 10
    batch: int = 1  # windows per optimizer step
    max_tokens: Optional[int] = None  # token budget: stop after this many training tokens
    save_every: int = 25
    eval_every: int = 0  # call the evaluator every N steps (0: only before and after)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.lr <= 0 or self.batch < 1 or self.warmup < 0 or self.save_every < 1:
            raise ConfigError(f"recovery needs steps, batch, save_every >= 1, lr > 0, warmup >= 0; got {self}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"--recover-tokens must be >= 1, got {self.max_tokens}")

    def to_dict(self) -> dict:
        return asdict(self)

    def lr_at(self, step: int) -> float:
        """Linear warm-up over ``warmup`` steps, then linear decay to 0 at ``steps``."""
        if step < self.warmup:
            return self.lr * (step + 1) / (self.warmup + 1)
        return self.lr * max(0.0, (self.steps - step) / max(1, self.steps - self.warmup))


class MaskedDense(WeightFormat):
    """Training-time stand-in for a pruned layer: y = x (W ⊙ M)ᵀ with W a trainable parameter (never saved)."""

    name = "masked-dense"

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 32.0

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        raise ConfigError("masked-dense is a training-time layer, not a storage format")

    def dequantize(self, packed: Packed) -> torch.Tensor:
        return (packed["weight"] * packed["mask"]).detach().float()

    def apply(self, x: torch.Tensor, packed: Packed, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return F.linear(x, packed["weight"] * packed["mask"], bias)


class GroupScaledCodes(WeightFormat):
    """Training-time stand-in for an INT4 layer: w = (q − 8) · s (symmetric) or q · s + m per group of ``g``
    input columns, codes q frozen (float). Trained in relative units so one learning rate suits every layer:
    s = s₀ · exp(a) and m = m₀ + b · s₀, with a, b (out, in/g) the parameters (0 at the start)."""

    name = "group-scaled-codes"

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 32.0

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        raise ConfigError("group-scaled-codes is a training-time layer, not a storage format")

    @staticmethod
    def scales(packed: Packed) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(s, m) (out, in/g) from the frozen s₀, m₀ and the parameters a, b; m is None when symmetric."""
        s0 = packed["scale0"]
        s = s0 * torch.exp(packed["log_scale"])
        m = packed["offset0"] + packed["offset_shift"] * s0 if "offset0" in packed else None
        return s, m

    @classmethod
    def weight(cls, packed: Packed) -> torch.Tensor:
        codes = packed["codes"]  # (out, groups, g)
        s, m = cls.scales(packed)
        w = codes * s[..., None]
        if m is not None:
            w = w + m[..., None]
        return w.reshape(codes.shape[0], -1)

    def dequantize(self, packed: Packed) -> torch.Tensor:
        return self.weight(packed).detach().float()

    def apply(self, x: torch.Tensor, packed: Packed, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return F.linear(x, self.weight(packed), bias)


class Trainable:
    """What recovery trains in one layer: ``params`` (name → Parameter), the training-time ``(format, packed)``
    the layer runs while training, and the packed tensors in the layer's own format afterwards."""

    def __init__(self, lin) -> None:
        self.format = lin.format
        self.params: dict[str, torch.nn.Parameter] = {}

    def training_layer(self) -> tuple[WeightFormat, Packed]:
        raise NotImplementedError

    def packed(self) -> Packed:
        raise NotImplementedError


class MaskedWeights(Trainable):
    """A pruned layer: the kept weights are trained, the pruned ones stay exactly zero under the frozen mask."""

    def __init__(self, lin) -> None:
        super().__init__(lin)
        self.mask = lin.format.mask(lin.packed)
        self.params = {"weight": torch.nn.Parameter(lin.dequantized_weight().float())}

    def training_layer(self) -> tuple[WeightFormat, Packed]:
        return MaskedDense(), {"weight": self.params["weight"], "mask": self.mask}

    def packed(self) -> Packed:
        return self.format.pack(self.params["weight"].detach() * self.mask, self.mask)


class Int4Scales(Trainable):
    """An INT4 layer: codes frozen, per-group scales (and offsets) trained, stored back in float16 (PEQA)."""

    def __init__(self, lin) -> None:
        super().__init__(lin)
        fmt, packed = lin.format, lin.packed
        self.qweight = packed["qweight"]
        out, groups = packed["scale"].shape
        codes = unpack_nibbles(packed["qweight"]).float().view(out, groups, fmt.group_size)
        self.codes = codes - 8 if fmt.symmetric else codes
        self.frozen = {"scale0": packed["scale"].float()}
        self.params = {"log_scale": torch.nn.Parameter(torch.zeros(out, groups))}
        if "offset" in packed:
            self.frozen["offset0"] = packed["offset"].float()
            self.params["offset_shift"] = torch.nn.Parameter(torch.zeros(out, groups))

    def training_layer(self) -> tuple[WeightFormat, Packed]:
        return GroupScaledCodes(), {"codes": self.codes, **self.frozen, **self.params}

    def packed(self) -> Packed:
        with torch.no_grad():
            s, m = GroupScaledCodes.scales({**self.frozen, **self.params})
        out = {"qweight": self.qweight}
        for k, t in (("scale", s), ("offset", m)):
            if t is None:
                continue
            half = t.clamp(-65504.0, 65504.0).half()
            if not torch.isfinite(half).all():
                raise ConfigError(f"recovery diverged: a trained INT4 {k} is not finite; lower --lr")
            out[k] = half
        return out


def trainable_for(fmt: Optional[WeightFormat]):
    """The :class:`Trainable` class for a layer's format, or None when recovery leaves the layer as it is."""
    if isinstance(fmt, PrunedFormat):
        return MaskedWeights
    if isinstance(fmt, Int4):
        return Int4Scales
    return None


def trainable_layers(model) -> dict[str, object]:
    """Qualified name → Linear for every layer recovery can train (pruned or INT4 group-wise)."""
    return {n: lin for n, lin in model.linear_layers() if trainable_for(lin.format) is not None}


def sequence_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """(L,) ids → (L, vocab) float32 logits with autograd (the model's own forward runs in inference mode)."""
    length = ids.shape[0]
    meta = AttentionMetadata.for_single_sequence(length, 16, model.device)
    caches = model.new_caches(-(-length // 16), 16)
    x = model.embed(ids)
    for layer, cache in zip(model.model.layers, caches):
        x = layer(x, meta, cache)
    return model.head(x)


def distillation_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(softmax(teacher) ‖ softmax(student)), both (L, vocab) → scalar (nats)."""
    return F.kl_div(
        F.log_softmax(student_logits.float(), -1),
        F.log_softmax(teacher_logits.float(), -1),
        log_target=True,
        reduction="batchmean",
    )


class Recovery:
    """One recovery run: ``student`` (pruned, trained in place) against ``teacher`` (dense, frozen)."""

    def __init__(
        self,
        student,
        teacher,
        windows: torch.Tensor,
        config: RecoveryConfig = RecoveryConfig(),
        state_path: Optional[str | os.PathLike] = None,
    ) -> None:
        if windows is None or windows.dim() != 2 or windows.shape[0] < 1:
            raise ConfigError("recovery needs calibration windows (N, L) of token ids; pass --calib-samples N >= 1")
        self.layers = trainable_layers(student)
        if not self.layers:
            raise ConfigError(
                "recovery trains pruned or INT4 layers, and this model has none: prune or quantize it "
                "first (bytediet quantize --format sparse24 [--calibrate wanda|sparsegpt], or "
                "--format int4-g64)"
            )
        if student.config.vocab_size != teacher.config.vocab_size:
            raise ConfigError(
                "the teacher and the pruned model have different vocabularies; pass the dense "
                "model the pruned one was made from as --teacher"
            )
        self.student, self.teacher, self.windows, self.config = student, teacher, windows, config
        self.state_path = Path(state_path) if state_path else None
        self.trainables = {n: trainable_for(lin.format)(lin) for n, lin in self.layers.items()}
        self.params = {f"{n}::{k}": p for n, t in self.trainables.items() for k, p in t.params.items()}
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=config.lr, weight_decay=0.0)
        self.step, self.tokens, self.history = 0, 0, []
        if self.state_path is not None and self.state_path.exists():
            self._load()

    # ---------------------------------------------------------------- one step
    def kl(self, ids: torch.Tensor) -> torch.Tensor:
        """KL of the student against the teacher on one window (L,) (with autograd through the student)."""
        with torch.no_grad():
            target = self.teacher.score(ids).clone()  # a normal tensor, not an inference-mode one
        return distillation_kl(target, sequence_logits(self.student, ids))

    def train_step(self) -> float:
        """One optimizer step over ``batch`` windows → the mean KL before the update."""
        cfg = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr_at(self.step)
        total = 0.0
        for b in range(cfg.batch):
            ids = self.windows[(self.step * cfg.batch + b) % self.windows.shape[0]]
            loss = self.kl(ids) / cfg.batch
            loss.backward()
            total += float(loss.detach())
            self.tokens += ids.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total

    # ---------------------------------------------------------------- the run
    def run(self, meter: Callable = no_meter, evaluate: Optional[Callable[[object], dict]] = None) -> dict:
        """Train until ``steps`` or the token budget; → {steps, tokens, history, config}. ``evaluate(model) → dict``
        (e.g. perplexity) is recorded with the step and tokens before training, every ``eval_every`` steps
        and at the end."""
        cfg = self.config
        if evaluate is not None and not self.history:
            self.history.append({"step": 0, "tokens": 0, **evaluate(self.student)})
        with self._training(), meter(cfg.steps, "recovering", completed=self.step) as bar, torch.enable_grad():
            while self.step < cfg.steps and (cfg.max_tokens is None or self.tokens < cfg.max_tokens):
                loss = self.train_step()
                bar.advance(f"KL {loss:.4f} · {self.tokens:,} tokens")
                if evaluate is not None and cfg.eval_every and self.step % cfg.eval_every == 0:
                    self.history.append(
                        {"step": self.step, "tokens": self.tokens, "kl": loss, **evaluate(self.student)}
                    )
                if self.state_path is not None and self.step % cfg.save_every == 0:
                    self._save()
            if evaluate is not None and self.history[-1]["step"] != self.step:
                self.history.append({"step": self.step, "tokens": self.tokens, **evaluate(self.student)})
            if self.state_path is not None:
                self._save()
        return {"steps": self.step, "tokens": self.tokens, "history": self.history, "config": cfg.to_dict()}

    def _training(self):
        run = self

        class _Swap:
            def __enter__(self):
                for n, lin in run.layers.items():
                    lin.set_packed(*run.trainables[n].training_layer())

            def __exit__(self, *exc):  # also on an error or Ctrl-C: the model is left in its own formats
                run._install()

        return _Swap()

    def _install(self) -> None:
        """Pack what was trained in each layer's own format (under its frozen mask / with its frozen codes)."""
        with torch.no_grad():
            for n, lin in self.layers.items():
                t = self.trainables[n]
                lin.set_packed(t.format, t.packed())
        config = getattr(self.student, "quantize_config", None)
        if config is not None:
            record = {**self.config.to_dict(), "steps_done": self.step, "tokens": self.tokens}
            self.student.quantize_config = replace(
                config, calibration={**(config.calibration or {}), "recovery": record}
            )

    # ---------------------------------------------------------------- resumable state
    def _save(self) -> None:
        state = {
            "step": self.step,
            "tokens": self.tokens,
            "history": self.history,
            "config": self.config.to_dict(),
            "params": {n: p.detach() for n, p in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
        }
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)  # a crash mid-write leaves the previous state

    def _load(self) -> None:
        state = torch.load(self.state_path, weights_only=True)
        params = state.get("params")
        if params is None:  # a state written before INT4 recovery: the pruned layers' weights by layer name
            params = {f"{n}::weight": w for n, w in state.get("weights", {}).items()}
        if set(params) != set(self.params):
            raise ConfigError(
                f"{self.state_path} holds the state of another model's layers; remove it or "
                "choose another --recover-state"
            )
        with torch.no_grad():
            for n, p in params.items():
                self.params[n].copy_(p)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.tokens, self.history = state["step"], state["tokens"], state["history"]
