"""Accuracy of the native GGUF-block kernels' activation modes against the dequantized fp32 reference.

For each model: the same Austen windows are scored by the fp32 reference (``--weights fp32``: the GGUF
dequantized, float activations) and by the engine's native blocks with int8 activations (``q8``, the
default) and with float activations (``f32``); perplexity change, mean KL and top-1 agreement per mode.
The gate for a default (issue 12): ≤ +0.3 % perplexity and ≥ 99 % top-1 agreement.

    .venv/bin/python bench/activation_precision.py --models default,gemma3-270m --windows 8 --window-len 512
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bytediet.eval.corpus import load_corpus, make_windows
from bytediet.eval.fidelity import kl_per_position, next_token_pairs, perplexity, top1_agreement
from bytediet.models.loader import load_model


def measure(model_name: str, windows: int, window_len: int, modes: list[str]) -> dict:
    reference, tokenizer = load_model(model_name, weights="fp32")
    ids = tokenizer.encode(load_corpus("prideprejudice"))
    chosen = [w.ids for w in make_windows(ids, window_len, windows)]
    ref_logits = [reference.score(torch.as_tensor(w)) for w in chosen]
    del reference
    targets = [next_token_pairs(r, torch.as_tensor(w))[1] for r, w in zip(ref_logits, chosen)]
    pairs = [next_token_pairs(r, torch.as_tensor(w))[0] for r, w in zip(ref_logits, chosen)]
    ref_ppl = perplexity(torch.cat(pairs), torch.cat(targets))
    out = {"model": model_name, "windows": windows, "window_len": window_len, "reference_ppl": ref_ppl, "modes": {}}
    for mode in modes:
        model, _ = load_model(model_name, keep_packed=True, activations=mode, load_tokenizer=False)
        test = [next_token_pairs(model.score(torch.as_tensor(w)), torch.as_tensor(w))[0] for w in chosen]
        test_all, ref_all = torch.cat(test), torch.cat(pairs)
        ppl = perplexity(test_all, torch.cat(targets))
        out["modes"][mode] = {
            "weights": ",".join(model.weight_formats()),
            "ppl": ppl,
            "ppl_change_pct": 100 * (ppl / ref_ppl - 1),
            "kl_mean": kl_per_position(ref_all, test_all).mean().item(),
            "top1": top1_agreement(ref_all, test_all),
        }
        print(f"{model_name} {mode}: {out['modes'][mode]}", file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="default,gemma3-270m")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=512)
    p.add_argument("--modes", default="q16,q8,f32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = [measure(m, args.windows, args.window_len, args.modes.split(",")) for m in args.models.split(",")]
    text = json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2)
    if args.out:
        open(args.out, "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
