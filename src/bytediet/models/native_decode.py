"""The decode step as one native call: every layer of a batch of one-token-per-sequence steps in C++.

Python's per-operation cost (≈ 30 ops per layer × 30 layers, each a few µs) exceeds the whole weight
read of a small quantized model, so a decode step that only reads and multiplies must not go through
the module path. :func:`native_decoder` describes a model and its KV pages as a
:class:`~bytediet.kernels.decoder_spec.DecoderSpec` once; the runner then calls
:func:`bytediet.kernels.ops.decode_step` for pure-decode batches, and for steps whose prefill chunks are short
(``engine.runner.native_step_takes``: a chunk's rows attend causally, as drafts do). Longer prefill steps
(compute-bound, where per-op cost is amortized) and every model or cache the native step does not cover stay on
the module path, which is also the reference the step is tested against.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import ops
from ..kernels.decoder_spec import DecoderSpec, LayerSpec, LinearSpec
from .layers import Linear
from .transformer import CausalLM


def _linear(lin: Linear, interleave: bool = False) -> Optional[LinearSpec]:
    """The layer's blocks as the native step reads them; ``interleave``: in the x4 layout where that exists
    (a copy of the same size — the module path keeps reading the GGML layout)."""
    native = lin.native_weight()
    if native is None:
        return None
    gtype, blocks = native
    bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
    x4 = (
        interleave
        and ops.can_interleave(int(gtype), lin.out_features, lin.in_features)
        and ops.tuned_kernel(int(gtype), lin.out_features, lin.in_features) != "rows"
    )  # `bytediet tune`
    source = None
    if x4:
        if lin.interleaved is None:  # the module path (prefill) multiplies with the same copy
            lin.interleaved = ops.repack_x4(int(gtype), blocks)
        blocks, source = lin.interleaved, blocks
    return LinearSpec(blocks, int(gtype), lin.out_features, lin.in_features, bias, interleaved=x4, source=source)


def drop_interleaved(model: CausalLM) -> None:
    """Let go of the x4 copies of ``model``'s layers (the next native decoder over it makes them again)."""
    for _, lin in model.linear_layers():
        lin.interleaved = None


def _pages_or_objection(cache) -> tuple[Optional[dict], str]:
    """(the cache's pages as LayerSpec fields, "") or (None, why the native step cannot read them): the codec's own
    answer, ``LayerKVCache.step_pages``."""
    pages = cache.step_pages()
    return pages.fields, pages.objection


def _pages(cache) -> Optional[dict]:
    """The cache's pages as the native step reads them (LayerSpec fields), or None (see _pages_or_objection)."""
    return _pages_or_objection(cache)[0]


def why_not_native(model: CausalLM, caches: list) -> Optional[str]:
    """None when the native decode step covers this model and these caches, else the reason it does not."""
    if getattr(model, "tensor_parallel", None):
        return "tensor parallel (the native step has no collectives)"
    c = model.config
    if c.num_experts:
        return (
            f"mixture-of-experts model ({c.architecture}, {c.num_experts} experts, top-{c.num_experts_per_tok}): "
            "the native step has no router, so experts run token-grouped on the module path"
        )
    if c.qk_norm and not c.qk_norm_per_head or c.clip_qkv is not None or c.attention_out_bias:
        return "q/k norm over the whole projection, q/k/v clamp or output bias (olmoe attention): module path only"
    if ops.native_library() is None:
        return "no native kernels on this machine"
    if model.dtype != torch.float32:
        return f"compute dtype {model.dtype} (the native step computes in float32)"
    kinds = {type(lin.format).__name__ for _, lin in model.linear_layers() if lin.format is not None}
    for name, lin in model.linear_layers():
        if name != "lm_head" and _linear(lin) is None:
            return (
                f"weight format {lin.format.spec()} of {name} has no native kernel "
                f"(formats: {', '.join(sorted(kinds))})"
            )
    modes = {lin.format.activations for name, lin in model.linear_layers() if name != "lm_head"}
    if len(modes) != 1:
        return f"mixed activation modes {sorted(modes)}"
    if model.config.head_dim % 8:
        return f"head_dim {model.config.head_dim} is not a multiple of 8"
    for cache in caches:
        pages, objection = _pages_or_objection(cache)
        if pages is None:
            return objection
        tq = "turboquant" in (pages["k_dtype"], pages.get("v_dtype"))
        if tq and c.num_heads // c.num_kv_heads > ops.TQ_MAX_GROUP:
            return (
                f"{c.num_heads // c.num_kv_heads} query heads per KV head (TurboQuant pages: at most "
                f"{ops.TQ_MAX_GROUP})"
            )
    return None


def _pending_channels(caches: list) -> list[int]:
    """Layers whose TurboQuant pages have two parts but no channel order yet: the uncalibrated codec picks the
    outlier channels on its first write (a prefill on the module path, ``TurboQuantPages.write``)."""
    return [i for i, cache in enumerate(caches) if not cache.step_ready()]


class NativeDecoder:
    """A model's decode step as one native call, then its final norm and output layer.

    Built once per runner (``native_decoder``); ``logits`` replaces ``CausalLM.forward`` for the batches
    ``engine.runner.native_step_takes`` gives it: decodes (with drafts) and short prefill chunks.
    """

    def __init__(self, model: CausalLM, spec: DecoderSpec, caches: list) -> None:
        self.model, self.spec, self.caches = model, spec, caches
        self.pending = _pending_channels(caches)

    def ready(self) -> bool:
        """Whether the step can run now: False while a layer's TurboQuant pages still wait for the channel order
        that their first write chooses (the caller runs that step on the module path, which writes it). Once
        chosen, the layer's spec takes them (the order is frozen from then on)."""
        for i in list(self.pending):
            cache = self.caches[i]
            if _pending_channels([cache]):
                continue
            layer = self.spec.layers[i]
            for spec, half in ((layer.k_tq, cache.keys), (layer.v_tq, cache.values)):
                if spec is not None:  # TurboQuant pages (one side of a k=q5_0,v=turboquant4 layer, or both)
                    spec.channels = half.channels
            self.spec.native = None  # the C structs point at the channel orders: build them again
            self.pending.remove(i)
        return not self.pending

    def logits(
        self, input_ids: torch.Tensor, meta, logit_rows: torch.Tensor, token_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """input_ids (T,), one per sequence (or a verifying sequence's last token and drafts: token_rows (T,) names
        each token's sequence, the row of ``meta.block_tables``) → float32 logits (N, vocab) of ``logit_rows``."""
        if not self.ready():
            raise RuntimeError(
                "the native decode step ran before the first write chose the TurboQuant outlier "
                "channels; run that step on the module path (check NativeDecoder.ready())"
            )
        hidden = ops.decode_step(
            self.spec,
            self.model.embed(input_ids),
            meta.positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.block_size,
            token_rows,
        )[logit_rows]
        return self.model.head(hidden)  # lm_head multiplies with its interleaved copy when it has one


def native_decoder(model: CausalLM, caches: list) -> Optional[NativeDecoder]:
    """The native decode step of ``model`` over ``caches``, or None when :func:`why_not_native` objects."""
    if why_not_native(model, caches) is not None:
        return None
    c = model.config
    activations = model.model.layers[0].self_attn.q_proj.format.activations
    x4 = activations in ("q8", "q16")  # the interleaved kernels multiply int8 activation planes
    layers = []
    for layer, cache in zip(model.model.layers, caches):
        attn, mlp = layer.self_attn, layer.mlp
        norm = lambda m: None if m is None else m.weight.detach().float().contiguous()
        lin = lambda m: _linear(m, x4)
        layers.append(
            LayerSpec(
                attn_norm=norm(layer.input_layernorm),
                post_attn_norm=norm(layer.post_attention_layernorm),
                inv_freq=attn.rope.inv_freq.float().contiguous(),
                **_pages(cache),
                q=lin(attn.q_proj),
                k=lin(attn.k_proj),
                v=lin(attn.v_proj),
                o=lin(attn.o_proj),
                gate=lin(mlp.gate_proj),
                up=lin(mlp.up_proj),
                down=lin(mlp.down_proj),
                window=attn.window or 0,
                pre_ffn_norm=norm(getattr(layer, "pre_feedforward_layernorm", None)),
                post_ffn_norm=norm(getattr(layer, "post_feedforward_layernorm", None)),
                q_norm=norm(attn.q_norm),
                k_norm=norm(attn.k_norm),
            )
        )
    spec = DecoderSpec(
        layers=layers,
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        eps=c.rms_norm_eps,
        attention_scale=model.model.layers[0].self_attn.scale,
        gelu=c.hidden_act == "gelu_tanh",
        sandwich=c.sandwich_norm,
        activations=activations,
    )
    head = model.lm_head
    if getattr(head.format, "activations", None) in ("q8", "q16"):
        _linear(head, interleave=True)  # gives lm_head its interleaved copy, which model.head multiplies with
    return NativeDecoder(model, spec, caches)
