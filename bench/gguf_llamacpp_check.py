"""Does llama.cpp load and run the GGUF files ``bytediet quantize --export-gguf`` writes, with the same numbers?

For each block type: the default model's linear layers (all but lm_head, which is tied to the embedding
the export copies byte for byte) are re-quantized to ``gguf-<type>`` in bytediet,
exported with :func:`bytediet.calibrate.gguf_export.export_gguf`, loaded by ``llama-cpp-python``, and both
systems score the same Austen passage. Reported per type: llama.cpp's perplexity and bytediet's on the
same weights, the top-1 agreement of their next-token predictions, the largest logit difference, and a
short greedy continuation from llama.cpp. (llama.cpp quantizes activations to 8 bits inside its
quantized dot products, so its logits differ from bytediet's float ones by a little; the file is right
when perplexities agree closely and top-1 agreement is high.)

    .venv/bin/python bench/gguf_llamacpp_check.py [--types q8_0 q4_0 q5_0 q4_1] [--tokens 256] [--out FILE.json]

Needs the optional ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp(mean NLL) of ids[1:] under logits[:-1] (float32, (T, vocab))."""
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:]).item())


def source_type(path: Path) -> str:
    """The block type most linear tensors of a GGUF file use, e.g. "q4_1"."""
    import collections

    import gguf

    types = collections.Counter(
        t.tensor_type.name
        for t in gguf.GGUFReader(str(path)).tensors
        if t.name.startswith("blk.") and t.name.endswith(".weight") and t.data.ndim > 1
    )
    return types.most_common(1)[0][0].lower()


def _same_linear_bytes(a: Path, b: Path) -> bool:
    """Whether every block-layer weight tensor of two GGUF files holds the same bytes."""
    import gguf
    import numpy as np

    def tensors(path):
        return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors if t.name.startswith("blk.")}

    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=["q8_0", "q4_0", "q5_0", "q4_1"])
    p.add_argument("--tokens", type=int, default=256, help="passage length scored by both systems")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    import llama_cpp

    from bytediet.calibrate.gguf_export import export_gguf
    from bytediet.eval.corpus import make_windows, tokenize_corpus
    from bytediet.models.loader import default_model_path, load_model
    from bytediet.models.quantize import QuantizeConfig, quantize
    from bytediet.perf.peers import _llama_cpp_model_params, probe_llama_cpp_extra_buffer_types

    torch.set_num_threads(args.threads)
    source = default_model_path()
    base, tokenizer = load_model(str(source), dtype=torch.float32)
    ids = make_windows(tokenize_corpus(tokenizer, "prideprejudice"), args.tokens, 1, split="eval", seed=0)[0].ids
    extra, note = probe_llama_cpp_extra_buffer_types(source, args.threads)
    result = {
        "source": str(source),
        "tokens": len(ids),
        "llama_cpp": llama_cpp.__version__,
        "extra_buffer_types": extra,
        "note": note,
        "types": {},
    }
    with _llama_cpp_model_params(use_extra_bufts=extra):  # the source file itself: llama.cpp's own numerics
        llm = llama_cpp.Llama(
            model_path=str(source),
            n_ctx=args.tokens + 64,
            n_batch=args.tokens,
            n_threads=args.threads,
            logits_all=True,
            verbose=False,
        )
    llm.eval(ids.tolist())
    theirs = torch.from_numpy(llm.scores[: len(ids)].copy()).float()
    llm.close()
    ours = base.score(ids).float()
    result["source_file"] = {
        "ppl_llama_cpp": perplexity(theirs, ids),
        "ppl_bytediet": perplexity(ours, ids),
        "top1_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
        "max_abs_logit_diff": float((theirs - ours).abs().max()),
    }
    print(f"source: {json.dumps(result['source_file'])}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        for gtype in args.types:
            t0 = time.perf_counter()
            model, _ = load_model(str(source), dtype=torch.float32)
            # lm_head is tied to token_embd, which the export copies as stored (Q8_0 here): keep it as loaded
            quantize(model, QuantizeConfig(format=f"gguf-{gtype}", skip=("lm_head",)))
            ours = model.score(ids).float()
            path = export_gguf(model, source, Path(tmp) / f"smollm2-{gtype}.gguf", gtype)
            same_bytes = _same_linear_bytes(source, path) if gtype == source_type(source) else None
            with _llama_cpp_model_params(use_extra_bufts=extra):
                llm = llama_cpp.Llama(
                    model_path=str(path),
                    n_ctx=args.tokens + 64,
                    n_batch=args.tokens,
                    n_threads=args.threads,
                    logits_all=True,
                    verbose=False,
                )
            llm.eval(ids.tolist())
            theirs = torch.from_numpy(llm.scores[: len(ids)].copy()).float()
            llm.reset()
            prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
            cont = []
            for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
                cont.append(tok)
                if len(cont) == 12:
                    break
            llm.close()
            result["types"][gtype] = {
                "file_bytes": path.stat().st_size,
                "linear_blocks_identical_to_source": same_bytes,
                "ppl_llama_cpp": perplexity(theirs, ids),
                "ppl_bytediet": perplexity(ours, ids),
                "ppl_unquantized_source": perplexity(base.score(ids).float(), ids),
                "top1_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
                "max_abs_logit_diff": float((theirs - ours).abs().max()),
                "llama_cpp_greedy": tokenizer.decode(cont),
                "seconds": time.perf_counter() - t0,
            }
            print(f"{gtype}: {json.dumps(result['types'][gtype])}", file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
