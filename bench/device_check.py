#!/usr/bin/env python3
"""bytediet on one GPU, checked and timed in one run (at most ~8 minutes on one H200): one JSON file and a table.

    python3 bench/device_check.py [--out FILE] [--budget-s 450]
                                  [--sections env,machine,gemm,attention,models,optimize,speed]
    python3 bench/device_check.py --dry-run      # the same run on the CPU: Triton's interpreter, tiny shapes

Sections, each in its own try (an error is recorded in the JSON and the run goes on), in this order, under one
time guard that skips what no longer fits:
  env        versions, the GPU
  machine    the GPU's measured copy/read bandwidth and matmul rates (bytediet.perf.measure_gpu: the roofline's)
  gemm       every Triton weight-format kernel against the format's own dequantization, realistic shapes
  attention  the Triton paged attention over every KV page type against kernels/reference.py
  models     tiny random llama / qwen2 / gemma3 written by transformers (save_pretrained) and loaded by bytediet's
             HF loader: greedy tokens equal to transformers on the GPU, with CUDA graphs and eager
  optimize   `bytediet optimize --device cuda`, the smallest quick run under a tight --time-budget: the default model
             where it is installed, else a random SmolLM2-135M-shaped llama and a BPE tokenizer written on the spot;
             a candidate with no GPU kernel (sparse50, kivi4) must be listed as skipped, not run
  speed      random-weight Llama-3-8B- and 1B-shaped models at bf16, int8, int4-g128, fp8, sparse24 (2:4): decode
             tok/s at batch 1/16/64, prefill tok/s, fraction of the roofline's prediction, and the peer
             (transformers, static cache + torch.compile, gpt-fast's recipe) on the same weights in the same run

It needs only what the GPU image has (torch, triton, transformers, numpy, pyyaml) and bytediet's source: the
``gguf`` package, if missing, is read from the wheel carried in bench/wheels (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRY = "--dry-run" in sys.argv
if DRY:  # the GPU code path on the CPU: chosen before torch or triton is imported
    os.environ["BYTEDIET_BACKEND"] = "triton"
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # the CPU's native kernels are not used on the GPU path: never build them there
    os.environ.setdefault("BYTEDIET_KERNELS", "reference")
sys.path.insert(0, str(ROOT / "src"))
try:
    import gguf  # noqa: F401 - only whether it imports
except ImportError:  # the GPU image lacks it: the pure-Python wheel carried beside the source
    sys.path.extend(str(w) for w in sorted((ROOT / "bench" / "wheels").glob("gguf-*.whl")))

import torch

SECTIONS = ("env", "machine", "gemm", "attention", "models", "optimize", "speed")
OPTIMIZE_SECONDS = 75  # optimize's own --time-budget: the baseline and what fits of the candidates below
# SmolLM2-135M's shape (the default model), for the random stand-in where the default model is not installed
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
)
GEMM_FORMATS = (
    "int8",
    "int4-g128",
    "int4-g32-sym",
    "fp8",
    "mxfp4",
    "nvfp4",
    "sparse24",
    "sparse24-int8",
    "gguf-q4_0",
    "gguf-q4_1",
    "gguf-q5_0",
    "gguf-q5_1",
    "gguf-q8_0",
    "gguf-q4_k",
    "gguf-q5_k",
    "gguf-q6_k",
)
KV_CODECS = (
    "bf16",
    "fp16",
    "int8",
    "fp8",
    "q8_0",
    "q5_0",
    "q4_1",
    "q4_0",
    "k=q8_0,v=q4_0",
    "rot-int8",
    "rot-q8_0",
    "turboquant",
)
SPEED_FORMATS = ("bf16", "int4-g128", "int8", "fp8", "sparse24")
# real shapes: Llama-3-8B and Llama-3.2-1B (config.json of meta-llama's checkpoints)
SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "llama3-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    tie_word_embeddings=False,
)


class Run:
    """The results, the deadline, and one ``section`` context per part (errors recorded, never raised)."""

    def __init__(self, budget_s: float, device: str) -> None:
        self.start, self.budget, self.device = time.perf_counter(), budget_s, device
        self.results: dict = {"dry_run": DRY, "device": device, "budget_s": budget_s, "sections": {}}
        self.shapes, self.formats = list(SHAPES), list(SPEED_FORMATS)  # what the speed section runs

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    @contextlib.contextmanager
    def section(self, name: str, need_s: float = 0.0):
        out = self.results["sections"].setdefault(name, {})
        if self.left() < need_s:
            out["skipped"] = f"time guard: {self.left():.0f} s left, {need_s:.0f} s needed"
            yield None
            return
        t0 = time.perf_counter()
        try:
            yield out
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            out["traceback"] = traceback.format_exc(limit=6)[-2000:]
            print(f"[{name}] {out['error']}", file=sys.stderr, flush=True)
        finally:
            out["seconds"] = round(time.perf_counter() - t0, 2)
            if self.device == "cuda":
                torch.cuda.empty_cache()

    def item(self, out: dict, key: str, fn, need_s: float = 0.0):
        """One entry of a section, in its own try (and under the time guard)."""
        if self.left() < need_s:
            out[key] = {"skipped": f"time guard: {self.left():.0f} s left"}
            return None
        t0 = time.perf_counter()
        try:
            out[key] = fn()
        except Exception as e:
            out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            print(f"  {key}: {out[key]['error']}", file=sys.stderr, flush=True)
        finally:
            gc.collect()  # the entry's models, KV pools and graphs go before the next one's
            if self.device == "cuda":
                torch.cuda.empty_cache()
        if isinstance(out[key], dict):
            out[key].setdefault("seconds", round(time.perf_counter() - t0, 2))
        return out[key]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


# -- env, machine -------------------------------------------------------------------------------------------------
def env_section(run: Run, out: dict) -> None:
    import triton

    out.update(
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        backend=os.environ.get("BYTEDIET_BACKEND", "auto"),
        interpreter=os.environ.get("TRITON_INTERPRET") == "1",
    )
    with contextlib.suppress(ImportError):
        import transformers

        out["transformers"] = transformers.__version__
    if run.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(
            gpu=p.name,
            capability=list(torch.cuda.get_device_capability(0)),
            memory_gib=p.total_memory / 2**30,
            multiprocessors=p.multi_processor_count,
        )


def machine_section(run: Run, out: dict):
    """The ceilings the roofline uses: the GPU's, measured (perf.measure_gpu); the CPU's in a dry run."""
    if run.device == "cuda":
        from bytediet.perf.measure_gpu import measure_gpu, spec_from_gpu_measurement

        m = measure_gpu("cuda")
        out.update(m)
        return spec_from_gpu_measurement(m)
    from bytediet.perf.measure import measure, spec_from_measurement

    m = measure(threads=torch.get_num_threads(), read_mib=64)
    out.update(m)
    return spec_from_measurement(m)


# -- kernels ------------------------------------------------------------------------------------------------------
def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))


K_QUANTS = {"gguf-q4_k": 12, "gguf-q5_k": 13, "gguf-q6_k": 14}  # GGML type ids
_K_BLOCK = {12: (144, (0, 2)), 13: (176, (0, 2)), 14: (210, (208,))}  # bytes per 256 weights, f16 scale offsets


def _random_k_blocks(t: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """(n, k/256 blocks) of GGML K-quant type ``t``: random codes and sub-scales, f16 super-scales of ~1e-3."""
    nbytes, scales = _K_BLOCK[t]
    blocks = torch.randint(0, 256, (n, k // 256, nbytes), dtype=torch.uint8, generator=g)
    for off in scales:
        f16 = (torch.rand(n, k // 256, generator=g) * 2e-3 + 5e-4).to(torch.float16)
        blocks[..., off : off + 2] = f16.view(torch.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def gemm_section(run: Run, out: dict) -> None:
    """Each format's Triton GEMM (kernels/backend.gemm) against x · W_dequantizedᵀ, for a decode row, a small batch
    and a prefill tile; the weight quantized on the CPU by the format itself (the proven path)."""
    from bytediet.kernels import backend, reference
    from bytediet.quant import get_weight_format

    n, k = (64, 256) if DRY else (4096, 4096)
    rows = (3,) if DRY else (1, 16, 512)  # a decode row (GEMV), a small batch, a prefill tile (GEMM)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.05
    for spec in GEMM_FORMATS:

        def check(spec=spec):
            if spec in K_QUANTS:  # no float quantizer for these: random blocks with sane scales, read by the twin
                t, blocks = K_QUANTS[spec], _random_k_blocks(K_QUANTS[spec], n, k, g)
                dense = reference.dequantize_blocks(t, blocks).to(run.device)
            else:
                fmt = get_weight_format(spec)
                packed = fmt.quantize(w.clone())
                t, blocks = fmt.native_layout(packed)
                dense = fmt.dequantize(packed).to(run.device)
            blocks = blocks.contiguous().to(run.device)
            res = {"type": int(t), "bytes": blocks.numel()}
            tolerance = 2e-2
            for dtype in (torch.float32,) if DRY else (torch.bfloat16,):  # each dtype compiles its own kernels
                weight = backend.prepare(t, blocks, dtype)  # what the engine runs (W8A8 fp8 / 2:4 on CUDA)
                res[f"kernel_{str(dtype).replace('torch.', '')}"] = weight.kernel
                tolerance = 6e-2 if weight.fp8 is not None else tolerance  # activations rounded to E4M3 too
                for m in rows:
                    x = (torch.randn(m, k, generator=g)).to(run.device, dtype)
                    y = weight(x)
                    ref = x.float() @ dense.float().T
                    entry = {"rel_err": rel_err(y, ref), "dtype_out": str(y.dtype).replace("torch.", "")}
                    if not DRY and dtype == torch.bfloat16:
                        s = min(timed(lambda: weight(x)) for _ in range(5))
                        entry.update(us=s * 1e6, weight_gb_per_s=blocks.numel() / s / 1e9)
                        if weight.blocks is None:  # the tensor-core path; the Triton GEMM timed beside it
                            s = min(timed(lambda: backend.gemm(t, blocks, x)) for _ in range(5))
                            entry.update(triton_us=s * 1e6, triton_rel_err=rel_err(backend.gemm(t, blocks, x), ref))
                    res[f"m{m}_{str(dtype).replace('torch.', '')}"] = entry
            res["ok"] = all(v["rel_err"] < tolerance for v in res.values() if isinstance(v, dict))
            return res

        run.item(out, spec, check, need_s=15)


def attention_section(run: Run, out: dict) -> None:
    """Each KV codec's pages, written by the codec on the device, read by the Triton paged attention and by the
    reference (kernels/reference.py) — decodes over ragged long contexts and one prefill chunk after a cached
    prefix, GQA of 4 (Llama-3-8B's heads) and a sliding window."""
    from bytediet.kernels import backend, reference
    from bytediet.kvcache.base import get_kv_codec

    hq, hkv, d, bs = (4, 2, 32, 16) if DRY else (32, 8, 128, 16)
    # (new tokens, context) per sequence: decodes, then a 64-token chunk after a prefix
    seqs = [(1, 40), (1, 17), (8, 24)] if DRY else [(1, 4000), (1, 1500), (1, 257), (1, 31), (64, 2048)]
    blocks_per = [-(-c // bs) for _, c in seqs]
    nblocks = sum(blocks_per) + 1
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(nblocks - 1, generator=g)  # blocks scattered over the pool
    tables, start = torch.full((len(seqs), max(blocks_per)), -1, dtype=torch.int64), 0
    for i, b in enumerate(blocks_per):
        tables[i, :b] = perm[start : start + b]
        start += b
    positions = torch.cat([torch.arange(c - q, c) for q, c in seqs])
    rows = torch.cat([torch.full((q,), i) for i, (q, _) in enumerate(seqs)])
    all_pos = torch.cat([torch.arange(c) for _, c in seqs])
    all_slots = torch.cat(
        [tables[i, torch.arange(c) // bs] * bs + torch.arange(c) % bs for i, (_, c) in enumerate(seqs)]
    )
    dev = run.device
    dtype = torch.float32 if DRY else torch.bfloat16
    for name in KV_CODECS:

        def check(name=name):
            codec = get_kv_codec(name, dtype)
            cache = codec.create_cache(0, nblocks, bs, hkv, d, dtype, dev)
            k = torch.randn(all_pos.numel(), hkv, d, generator=g).to(dev, dtype)
            v = torch.randn(all_pos.numel(), hkv, d, generator=g).to(dev, dtype)
            cache.write(k, v, all_slots.to(dev), all_pos.to(dev))
            pages = cache.attention_pages()
            if pages is None:
                return {"error": f"{name}: the codec gives no pages a kernel reads"}
            q = torch.randn(positions.numel(), hq, d, generator=g).to(dev, dtype)
            res = {"pages": f"{pages['k_dtype']}/{pages.get('v_dtype') or pages['k_dtype']}"}
            for window in (None, 256 if not DRY else 8):
                args = (positions.to(dev), rows.to(dev), tables.to(dev), bs, d**-0.5, window)
                y = backend.attention_over_pages(q, *args, **pages)
                ref = reference.attention_over_pages(q.float(), *args, **pages)
                res[f"window_{window}"] = {"rel_err": rel_err(y, ref)}
                if not DRY and window is None:
                    s = min(timed(lambda: backend.attention_over_pages(q, *args, **pages)) for _ in range(5))
                    res[f"window_{window}"]["us"] = s * 1e6
            res["ok"] = all(v["rel_err"] < 2e-2 for v in res.values() if isinstance(v, dict))
            return res

        run.item(out, name, check, need_s=10)
    if not DRY:  # the kernel's own check: every K/V page mix on realistic shapes, timed (paged_attention_check)

        def kernel_check():
            from bytediet.kernels.triton.paged_attention_check import check as attention_check

            rows = attention_check("cuda", reps=5)
            return {"ok": all(r["ok"] for r in rows), "cases": rows}

        run.item(out, "kernel_shapes", kernel_check, need_s=60)


# -- models: tiny checkpoints written by transformers -------------------------------------------------------------
def _tiny_hf_config(arch: str):
    import transformers as tf

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_hidden_layers=2,
    )
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    # gemma3: 6 layers (5 sliding + 1 global) and a window shorter than the prompts
    return tf.Gemma3TextConfig(
        **{**common, "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 16}
    )


def models_section(run: Run, out: dict) -> None:
    """Greedy tokens of bytediet (its HF loader, the engine on the device: CUDA graphs, then eager) equal to
    transformers' on the same device, for tiny random llama / qwen2 / gemma3 checkpoints written on the spot."""
    import transformers as tf

    from bytediet.engine.llm import LLM
    from bytediet.engine.params import SamplingParams
    from bytediet.models.loader import load_model

    n_new = 6 if DRY else 24
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in ((9, 5) if DRY else (33, 20, 7))]
    for arch in ("llama", "qwen2", "gemma3"):

        def check(arch=arch):
            torch.manual_seed(3)
            config = _tiny_hf_config(arch)
            config.eos_token_id = None
            hf = tf.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
            with tempfile.TemporaryDirectory() as tmp:
                hf.save_pretrained(tmp, safe_serialization=True)
                model, _ = load_model(tmp, dtype=torch.float32, load_tokenizer=False)
            hf = hf.to(run.device)
            want = []
            for p in prompts:
                ids = torch.tensor([p], device=run.device)
                with torch.no_grad():
                    gen = hf.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=n_new,
                        do_sample=False,
                        min_new_tokens=n_new,
                        pad_token_id=0,
                    )
                want.append(gen[0, len(p) :].tolist())
            res = {}
            for eager in (True,) if DRY or run.device != "cuda" else (False, True):
                llm = LLM(
                    arch,
                    loaded=(model, None),
                    device=run.device,
                    dtype="float32",
                    num_blocks=64,
                    enforce_eager=eager,
                    max_num_seqs=8,
                )
                got = [
                    o.outputs[0].token_ids
                    for o in llm.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
                ]
                agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(got, want)]
                res["eager" if eager else "cuda_graphs"] = {
                    "equal": got == want,
                    "tokens_agreeing": agree,
                    "decode": llm.engine.runner.decode_path,
                    "backend": llm.engine.runner.describe()["backend"],
                }
                del llm
            res["ok"] = all(v["equal"] for v in res.values())
            return res

        run.item(out, arch, check, need_s=20)


# -- optimize -----------------------------------------------------------------------------------------------------
def _corpus_text(n_words: int, seed: int = 0) -> str:
    """Seeded pseudo-prose (a few hundred made-up words in sentences): the stand-in's tokenizer and corpus."""
    import random

    rng = random.Random(seed)
    words = ["".join(rng.choice("etaoinshrdlcumwfgypbvk") for _ in range(rng.randint(2, 8))) for _ in range(600)]
    sentences, sentence = [], []
    for _ in range(n_words):
        sentence.append(rng.choice(words))
        if len(sentence) >= rng.randint(6, 16):
            sentences.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    return " ".join(sentences)


def _stand_in_model(path: Path, shape: dict, n_words: int) -> tuple[str, str]:
    """(model dir, corpus file): a random llama of ``shape`` written by transformers, with a byte-level BPE trained
    on the corpus written beside it (no file is downloaded or carried)."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = _corpus_text(n_words)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    vocab = 256 if DRY else 1024
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([text], trainer)
    torch.manual_seed(5)
    config = tf.LlamaConfig(**{**shape, "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 2048})
    tf.AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (path / "corpus.txt").write_text(text)
    return str(path), str(path / "corpus.txt")


def optimize_section(run: Run, out: dict) -> None:
    """``bytediet optimize --device cuda --quick`` with a tight time budget: the run's device, its steps' records
    (accuracy, speed, bytes), what the GPU path skipped and why, what the time budget left out, the time taken."""
    from bytediet.errors import BytedietError
    from bytediet.models.loader import resolve_model_path
    from bytediet.optimize.recipe import OptimizeOptions, Recipe
    from bytediet.optimize.report import recommend

    with tempfile.TemporaryDirectory() as tmp:
        model, corpus = "default", Path(tmp) / "corpus.txt"  # no corpus download: the GPU machine has no network
        corpus.write_text(_corpus_text(60000))
        try:
            if DRY:  # the default model's 30 layers in Triton's interpreter would take tens of minutes
                raise BytedietError("a dry run")
            resolve_model_path(model)
            out["model"] = "default (SmolLM2-135M-Instruct GGUF)"
        except BytedietError as e:  # not installed on the GPU image: a stand-in of its shape
            shape = TINY_SHAPE if DRY else SMOLLM2_SHAPE
            model, corpus = _stand_in_model(Path(tmp) / "model", shape, 6000 if DRY else 60000)
            out["model"] = f"random llama of {'a tiny' if DRY else 'SmolLM2-135M'}'s shape ({e})"
        small = dict(
            windows=2 if DRY else 4,
            window_len=64 if DRY else 512,
            speed_prompt_len=8 if DRY else 32,
            speed_new_tokens=3 if DRY else 16,
            profile_prompt_len=16 if DRY else 256,
            profile_new_tokens=3 if DRY else 32,
            calib_samples=2 if DRY else 8,
            calib_len=32 if DRY else 256,
            kv_calib_windows=1,
            kv_calib_len=32 if DRY else 512,
            passkey_lengths=(),
        )
        options = OptimizeOptions(
            model=model,
            corpus=str(corpus),
            quick=True,
            device=run.device,
            weights=("int8", "sparse50") if DRY else ("int8", "int4-g128", "int4-g128+gptq", "sparse50"),
            kv=("int8", "kivi4") if DRY else ("int8", "turboquant3.5", "kivi4"),
            kv_budgets=() if DRY else (4.5,),
            time_budget=max(min(OPTIMIZE_SECONDS, run.left() - 30), 20),
            **small,
        )
        if run.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        report = Recipe(options, Path(tmp) / "out", progress=False).run()
        rec = recommend(report)
    keys = ("label", "ppl_increase_pct", "kl_mean", "top1", "weight_bytes", "kv_bytes_per_token", "decode_tok_s")
    out.update(
        seconds_optimize=round(time.perf_counter() - t0, 1),
        device=report["device"],
        time_budget=report["time_budget"],
        profile={k: v["tok_s"] for k, v in report["steps"]["profile"]["phases"].items()},
        records={
            s: [{k: r.get(k) for k in keys} for r in v.get("records", [])]
            for s, v in report["steps"].items()
            if s != "profile"
        },  # fmt: skip
        notes={s: v["note"] for s, v in report["steps"].items() if isinstance(v, dict) and v.get("note")},
        recommendation=rec["label"],
        memory={k: report["memory"].get(k) for k in ("predicted_peak_bytes", "measured_peak_bytes")},
        cuda_peak_bytes=torch.cuda.max_memory_allocated() if run.device == "cuda" else None,
    )
    skipped = {s["label"] for s in report["device"]["skipped"]}
    out["ok"] = bool(report["steps"]["baseline"]["records"]) and "w=sparse50 kv=auto" in skipped


# -- speed --------------------------------------------------------------------------------------------------------
def _random_llama(shape: dict, device: str, dtype: torch.dtype):
    """A transformers Llama of ``shape`` with random weights (std 0.02), built on ``device``."""
    import transformers as tf

    config = tf.LlamaConfig(**shape, max_position_embeddings=4096, rope_theta=500000.0)
    with torch.device(device):
        hf = tf.LlamaForCausalLM(config).to(dtype).eval()
    return hf, config


def _bytediet_from_hf(hf, hf_config, fmt_spec: str, dtype: torch.dtype):
    """bytediet's model of the same weights, each linear quantized to ``fmt_spec`` (on the weights' device where the
    format's quantizer runs there, else on the CPU and moved)."""
    from bytediet.models.loader import build_model
    from bytediet.models.quantize import QuantizeConfig
    from bytediet.models.safetensors import ARCHITECTURES
    from bytediet.quant import get_weight_format

    config = ARCHITECTURES.get("llama")().config_from_hf(hf_config.to_dict())
    model = build_model(config, dtype)
    modules = dict(model.named_modules())
    plain = "bf16" if dtype == torch.bfloat16 else "fp32"
    policy = QuantizeConfig(format=fmt_spec)  # the layers --weights quantizes (the LM head as its policy says)
    for name, t in hf.state_dict().items():
        mod_name, _, kind = name.rpartition(".")
        module = modules[mod_name]
        if kind == "weight" and hasattr(module, "set_weight"):
            fmt = get_weight_format(policy.spec_for(mod_name) or plain)
            try:
                module.set_packed(fmt, fmt.quantize(t))
                if any(p.device != t.device for p in module.packed.values()):
                    raise RuntimeError("quantized off the device")
            except (RuntimeError, TypeError):
                module.set_packed(fmt, {k: p.to(t.device) for k, p in fmt.quantize(t.float().cpu()).items()})
        else:
            setattr(module, kind, torch.nn.Parameter(t, requires_grad=False))
    if config.tie_word_embeddings:
        model.lm_head.set_packed(get_weight_format(plain), {"weight": model.model.embed_tokens.weight.data})
    model.source_path = f"<random {hf_config.hidden_size}-wide llama>"
    return model, config


def _decode_rate(generate, batch: int, prompt: int, new: int) -> dict:
    """tok/s of the decode steps (all sequences together) and of the prefill, from a run of 1 and of 1+new tokens."""
    t1 = timed(lambda: generate(batch, prompt, 1))
    tn = timed(lambda: generate(batch, prompt, 1 + new))
    return {"decode_tok_s": batch * new / max(tn - t1, 1e-9), "ttft_s": t1, "prefill_tok_s": batch * prompt / t1}


def speed_section(run: Run, out: dict, hardware) -> None:
    from bytediet.engine.llm import LLM
    from bytediet.engine.params import SamplingParams
    from bytediet.perf.roofline import analyze
    from bytediet.quant import get_weight_format

    dtype = torch.float32 if DRY else torch.bfloat16
    batches, prompt, new = ((1, 2), 12, 3) if DRY else ((1, 16, 64), 128, 64)
    long_prompt = 24 if DRY else 2048
    shapes = {"tiny": TINY_SHAPE} if DRY else {k: v for k, v in SHAPES.items() if k in run.shapes}
    g = torch.Generator().manual_seed(4)
    for shape_name, shape in shapes.items():
        res = out.setdefault(shape_name, {})
        if run.left() < (5 if DRY else 60):
            res["skipped"] = f"time guard: {run.left():.0f} s left"
            continue
        try:
            hf, hf_config = _random_llama(shape, run.device, dtype)
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
            continue
        vocab = shape["vocab_size"]
        ids = lambda b, n: torch.randint(3, vocab - 1, (b, n), generator=g).tolist()
        for spec in ("int8",) if DRY else run.formats:

            def measure(spec=spec):
                from bytediet.models.placement import one_copy_on_gpu_path

                model, config = _bytediet_from_hf(hf, hf_config, spec, dtype)
                dropped = one_copy_on_gpu_path(model)  # as the engine holds a model it loaded: one copy a layer
                llm = LLM(
                    shape_name,
                    loaded=(model, None),
                    device=run.device,
                    dtype=str(dtype).replace("torch.", ""),
                    kv_cache_memory="256MiB" if DRY else "12GiB",
                    max_num_seqs=max(batches),
                    max_num_batched_tokens=max(long_prompt, max(batches) * prompt),
                    enable_prefix_caching=False,
                )

                def generate(b, n, m):
                    llm.generate(ids(b, n), SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))

                generate(max(batches), prompt, 3)  # warm-up: the kernels of every shape compile here
                generate(1, long_prompt, 1)
                r = {"weight_bytes": model.weight_bytes(), "planes_dropped_bytes": dropped}
                r["device"] = llm.engine.runner.describe()
                r["prefill_tok_s"] = long_prompt / timed(lambda: generate(1, long_prompt, 1))
                fmt = get_weight_format(spec)
                for b in batches:
                    m = _decode_rate(generate, b, prompt, new)
                    pred = analyze(
                        config,
                        hardware,
                        weights=fmt,
                        kv=16.0 if not DRY else 32.0,
                        batch=b,
                        context=prompt + new // 2,
                        prompt_len=prompt,
                        compute_dtype="bf16" if not DRY else "fp32",
                    )
                    m["predicted_decode_tok_s"] = pred.decode_tokens_per_s
                    m["fraction_of_roofline"] = m["decode_tok_s"] / pred.decode_tokens_per_s
                    r[f"batch{b}"] = m
                llm = model = None  # freed before the next format
                return r

            run.item(res, spec, measure, need_s=8 if DRY else 45)
        run.item(res, "peer", lambda: _peer(run, hf, batches, prompt, new, ids), need_s=8 if DRY else 90)
        hf = None  # freed before the next shape
        if run.device == "cuda":
            torch.cuda.empty_cache()


def _peer(run: Run, hf, batches, prompt: int, new: int, ids) -> dict:
    """transformers with a static KV cache and the forward compiled (torch.compile mode="reduce-overhead",
    fullgraph: gpt-fast's recipe, as transformers documents it) — on the GPU; eager on the CPU (a dry run)."""
    from transformers import StaticCache

    compiled = torch.cuda.is_available() and not DRY
    hf.generation_config.eos_token_id = None
    if compiled:
        hf.generation_config.disable_compile = True  # compiled here, once, not by generate's own auto-compile
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    dev = next(hf.parameters()).device
    cache_len = prompt + new + 8  # one static cache length for every call: each batch's shapes compile once

    def generate(b, n, m):
        x = torch.tensor(ids(b, n), device=dev)
        with torch.no_grad():
            hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=m,
                min_new_tokens=m,
                do_sample=False,
                pad_token_id=0,
                past_key_values=StaticCache(config=hf.config, max_cache_len=cache_len),
            )

    r = {
        "recipe": "transformers static cache"
        + (" + torch.compile(reduce-overhead, fullgraph)" if compiled else " (eager: no GPU)")
    }
    for b in batches:
        if run.left() < (5 if DRY else 60):  # a compile per batch shape: skip what no longer fits
            r[f"batch{b}"] = {"skipped": f"time guard: {run.left():.0f} s left"}
            continue
        generate(b, prompt, 3)  # compiles this batch's shapes
        r[f"batch{b}"] = _decode_rate(generate, b, prompt, new)
    return r


# -- report -------------------------------------------------------------------------------------------------------
def table(results: dict) -> str:
    """A short text table: kernel checks (ok / worst error), model checks, speed beside the peer."""
    lines = []
    s = results["sections"]
    for name in ("gemm", "attention", "models"):
        sec = s.get(name, {})
        bad = [k for k, v in sec.items() if isinstance(v, dict) and not v.get("ok", False)]
        good = [k for k, v in sec.items() if isinstance(v, dict) and v.get("ok")]
        lines.append(
            f"{name:<10} ok: {len(good):>2}  failed/skipped: {', '.join(bad) or '-'}"
            + (f"  ERROR {sec['error']}" if "error" in sec else "")
        )
    o = s.get("optimize", {})
    if o:
        lines.append(
            f"optimize   {'ok' if o.get('ok') else 'FAILED'} in {o.get('seconds_optimize', '-')} s, recommended "
            f"{o.get('recommendation', '-')}; skipped on the device: "
            f"{', '.join(x['label'] for x in (o.get('device') or {}).get('skipped', [])) or '-'}"
            + (f"  ERROR {o['error']}" if "error" in o else "")
            + (f"  {o['skipped']}" if "skipped" in o else "")
        )
    m = s.get("machine", {})
    if "read_bandwidth" in m:
        lines.append(
            f"machine    read {m['read_bandwidth'] / 1e9:.0f} GB/s, copy {m['copy_bandwidth'] / 1e9:.0f} GB/s, "
            f"bf16 {m['peak_flops'].get('bf16', 0) / 1e12:.0f} TFLOP/s"
        )
    for shape, res in s.get("speed", {}).items():
        if not isinstance(res, dict):
            continue
        lines.append(f"{shape}: decode tok/s at batch 1/16/64 (fraction of roofline), prefill tok/s")
        for spec, r in res.items():
            if not isinstance(r, dict):
                continue
            if "error" in r or "skipped" in r:
                lines.append(f"  {spec:<10} {r.get('error') or r.get('skipped')}")
                continue
            cells = [
                f"{r[k]['decode_tok_s']:8.1f}"
                + (f" ({r[k]['fraction_of_roofline']:.2f})" if "fraction_of_roofline" in r[k] else "       ")
                for k in sorted(r)
                if k.startswith("batch") and isinstance(r[k], dict) and "decode_tok_s" in r[k]
            ]
            pre = r.get("prefill_tok_s") or r.get("batch1", {}).get("prefill_tok_s", 0)
            lines.append(f"  {spec:<10} {' '.join(cells)}  prefill {pre:9.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="run on the CPU with Triton's interpreter and tiny shapes")
    p.add_argument("--out", default=None, help="the JSON file (default bench/results/device_check-<time>.json)")
    p.add_argument("--budget-s", type=float, default=None, help="time guard in seconds (default 450; dry run 240)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"speed: model shapes ({','.join(SHAPES)})")
    p.add_argument("--formats", default=",".join(SPEED_FORMATS), help="speed: weight formats, in run order")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if not args.dry_run and device != "cuda":
        print("device_check: torch sees no CUDA GPU here; run with --dry-run for the CPU path", file=sys.stderr)
        return 2
    run = Run(args.budget_s or (240.0 if args.dry_run else 450.0), device)
    run.shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    run.formats = [x.strip() for x in args.formats.split(",") if x.strip()]
    run.results.update(shapes=run.shapes, formats=run.formats)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    hardware = None
    for name in SECTIONS:
        if name not in chosen:
            continue
        with run.section(name, need_s=5) as out:
            if out is None:
                continue
            print(f"[{name}] {run.left():.0f} s left", file=sys.stderr, flush=True)
            if name == "env":
                env_section(run, out)
            elif name == "machine":
                hardware = machine_section(run, out)
            elif name == "gemm":
                gemm_section(run, out)
            elif name == "attention":
                attention_section(run, out)
            elif name == "models":
                models_section(run, out)
            elif name == "optimize":
                if run.left() < (30 if DRY else OPTIMIZE_SECONDS + 45):
                    out["skipped"] = f"time guard: {run.left():.0f} s left"
                    continue
                optimize_section(run, out)
            elif name == "speed":
                if hardware is None:
                    hardware = machine_section(run, {})
                speed_section(run, out, hardware)
    run.results["seconds"] = round(time.perf_counter() - run.start, 1)
    path = (
        Path(args.out)
        if args.out
        else ROOT / "bench" / "results" / f"device_check-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run.results, indent=1, default=str))
    print(table(run.results))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
