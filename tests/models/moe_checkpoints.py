"""Tiny random-weight MoE checkpoints written here: Hugging Face directories via ``transformers``'
``save_pretrained`` and GGUF files via the ``gguf`` writer with llama.cpp's tensor names.

No checkpoint is downloaded. The GGUF writer is written from llama.cpp's conventions
(``convert_hf_to_gguf.py``: experts stacked as ``ffn_{gate,up,down}_exps`` (n_expert, out, in), router
``ffn_gate_inp`` in F32, qwen2moe's shared expert ``*_shexp`` and its gate ``ffn_gate_inp_shexp`` stored
1-D, Mixtral written as ``llama`` with its q/k rows permuted), independently of the loader's inverse.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _mixtral(**kw):
    from transformers import MixtralConfig

    return MixtralConfig(**{**COMMON, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, **kw})


def _qwen2_moe(**kw):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **{
            **COMMON,
            "intermediate_size": 48,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            **kw,
        }
    )


def _olmoe(**kw):
    from transformers import OlmoeConfig

    # no GQA by default, as in OLMoE-1B-7B: llama.cpp's olmoe sizes attn_k_norm by n_embd
    return OlmoeConfig(
        **{
            **COMMON,
            "intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "num_key_value_heads": 4,
            **kw,
        }
    )


# variant name → HF config: each family, and each gating / attention option it has
VARIANTS = {
    "mixtral": lambda: _mixtral(),
    "mixtral-sliding-window": lambda: _mixtral(sliding_window=6),
    "qwen2_moe": lambda: _qwen2_moe(),
    "qwen2_moe-dense-layer-norm-topk": lambda: _qwen2_moe(
        num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True
    ),
    "olmoe": lambda: _olmoe(),
    "olmoe-gqa-clip-bias-norm-topk": lambda: _olmoe(
        num_key_value_heads=2, clip_qkv=1.0, attention_bias=True, norm_topk_prob=True
    ),
}
GGUF_VARIANTS = ("mixtral", "qwen2_moe", "olmoe")


def write_hf(out: Path, variant: str, seed: int = 0):
    """A random-weight model of ``variant`` saved with ``save_pretrained`` (+ a word-level tokenizer.json).

    Weights ~ N(0, 0.2²) and norms ~ 1 + N(0, 0.1²) (HF's init, std 0.02, gives near-uniform routing and
    logits, which would test little). Returns the transformers model (float32, eval mode).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(VARIANTS[variant]()).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    write_tokenizer(out, model.config.vocab_size)
    return model


def write_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer: token ``tN`` is id N (enough for the engine to detokenize)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))


def permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q/k rows of llama-architecture models)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "w1": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "w3": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w2": "ffn_down_exps",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "olmoe": "olmoe"}


def write_gguf(hf_dir: Path, out: Path, qtype=None, stacked: bool = True) -> None:
    """The HF checkpoint in ``hf_dir`` as a llama.cpp-style GGUF (``qtype``: quantize the linear weights;
    ``stacked`` False: one tensor per expert, ``blk.N.ffn_gate.E.weight``, as in Mixtral GGUFs before 2024)."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    kind = cfg["model_type"]
    w = gguf.GGUFWriter(str(out), ARCH[kind])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if kind == "qwen2_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if kind == "olmoe" and cfg.get("clip_qkv"):
        w.add_clamp_kqv(cfg["clip_qkv"])
    n = cfg["vocab_size"]  # a placeholder SentencePiece vocabulary: llama.cpp refuses a file without one
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([int(gguf.TokenType.NORMAL)] * n)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}
    for name, a in state.items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault((int(m.group(1)), EXPERT_NAMES[m.group(3)]), {})[int(m.group(2))] = a
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            tensors[
                {
                    "model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight",
                }[name]
            ] = a
            continue
        _, _, idx, rest = name.split(".", 3)
        module, kind_ = rest.rsplit(".", 1)
        if kind == "mixtral" and module == "self_attn.q_proj":
            a = permute_like_llama_cpp(a, cfg["num_attention_heads"])
        if kind == "mixtral" and module == "self_attn.k_proj":
            a = permute_like_llama_cpp(a, cfg["num_key_value_heads"])
        if module == "mlp.shared_expert_gate":
            a = a.reshape(-1)
        tensors[f"blk.{idx}.{LAYER_NAMES[module]}.{kind_}"] = a
    for (idx, gname), per_expert in experts.items():
        if stacked:
            tensors[f"blk.{idx}.{gname}.weight"] = np.stack([per_expert[e] for e in sorted(per_expert)])
        else:
            for e, a in per_expert.items():
                tensors[f"blk.{idx}.{gname.removesuffix('_exps')}.{e}.weight"] = a
    for gname, a in tensors.items():
        quantize = qtype is not None and a.ndim >= 2 and "ffn_gate_inp" not in gname and "token_embd" not in gname
        if quantize:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
