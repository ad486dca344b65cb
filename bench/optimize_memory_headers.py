"""The memory plan of ``bytediet optimize`` for 7B Q4_K_M checkpoints, from header-only GGUF files.

Writes a GGUF with the tensor list of Qwen2.5-7B-Instruct and Llama-2-7B at llama.cpp's Q4_K_M mix (Q4_K, with
Q6_K for ``output`` and for ``attn_v`` / ``ffn_down`` in llama.cpp's "more bits" layers) as a sparse file — the
header is real, the tensor bytes are holes, so nothing is downloaded and the disk holds a few kilobytes — and
prints each one's predicted peak of ``optimize --quick`` and of ``eval`` / ``quantize`` / ``serve``.

    PYTHONPATH=src python bench/optimize_memory_headers.py [--dir /tmp/headers]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

MODELS = {
    # name: (arch, hidden, intermediate, layers, heads, kv heads, vocab, qkv bias, tied)
    "qwen2.5-7b-q4_k_m": ("qwen2", 3584, 18944, 28, 28, 4, 152064, True, False),
    "llama-2-7b-q4_k_m": ("llama", 4096, 11008, 32, 32, 32, 32000, False, False),
}
Q4K, Q6K, F32 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.F32


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def nbytes(qtype, rows: int, cols: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return rows * cols // block * size


def write_header(path: Path, spec) -> None:
    arch, hidden, inter, layers, heads, kv, vocab, bias, tied = spec
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    tensors = [("token_embd.weight", Q4K, vocab, hidden), ("output_norm.weight", F32, 1, hidden)]
    if not tied:
        tensors.append(("output.weight", Q6K, vocab, hidden))
    for i in range(layers):
        more = more_bits(i, layers)
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", F32, 1, hidden),
            (b + "ffn_norm.weight", F32, 1, hidden),
            (b + "attn_q.weight", Q4K, heads * head_dim, hidden),
            (b + "attn_k.weight", Q4K, kv * head_dim, hidden),
            (b + "attn_v.weight", Q6K if more else Q4K, kv * head_dim, hidden),
            (b + "attn_output.weight", Q4K, hidden, heads * head_dim),
            (b + "ffn_gate.weight", Q4K, inter, hidden),
            (b + "ffn_up.weight", Q4K, inter, hidden),
            (b + "ffn_down.weight", Q6K if more else Q4K, hidden, inter),
        ]
        if bias:
            tensors += [(b + f"attn_{x}.bias", F32, 1, n * head_dim) for x, n in (("q", heads), ("k", kv), ("v", kv))]
    for name, qtype, rows, cols in tensors:
        if qtype == F32:
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), rows * cols * 4)
        else:  # a quantized tensor's shape is given in bytes per row
            size = nbytes(qtype, rows, cols)
            w.add_tensor_info(name, (rows, size // rows), np.dtype(np.uint8), size, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    total = path.stat().st_size + sum(
        -(-(r * c * 4 if q == F32 else nbytes(q, r, c)) // 32) * 32 for _, q, r, c in tensors
    )
    with open(path, "r+b") as f:
        f.truncate(total + 4096)  # holes: the tensors' bytes are never read


def main() -> None:
    from bytediet.commands._memory import plan_eval, plan_quantize, plan_serve
    from bytediet.optimize.memory_plan import plan_optimize
    from bytediet.optimize.recipe import OptimizeOptions
    from bytediet.perf.memory import GB, footprint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/bytediet-headers"))
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, spec in MODELS.items():
        path = args.dir / f"{name}.gguf"
        write_header(path, spec)
        fp = footprint(path, packed_embedding=True)
        print(f"{name}: checkpoint {fp.file_bytes / GB:.2f} GB, loaded for optimize {fp.loaded_bytes / GB:.2f} GB")
        print("  " + plan_optimize(OptimizeOptions(model=str(path), quick=True)).describe())
        for plan in (plan_eval(str(path)), plan_quantize(str(path), "int4-g64"), plan_serve(str(path))):
            print("  " + plan.describe())


if __name__ == "__main__":
    main()
