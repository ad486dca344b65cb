"""``bytediet generate``: stream one completion, then a summary with the roofline figure."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ._engine_args import add_model_args, add_sampling_args, build_llm, sampling_params


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt (streams tokens)",
        description="Generate a completion, streaming tokens, and report TTFT, tok/s and weight bandwidth.",
    )
    p.add_argument("--prompt", default=None, help="the prompt (default: read standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_model_args(p)
    add_sampling_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    params = sampling_params(args)
    llm = build_llm(args)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": prompt})
        prompt_ids = llm.chat_token_ids(messages)
    else:
        prompt_ids = llm.encode(prompt)
    t0 = time.perf_counter()
    ttft, text, token_ids, finish, cached = None, [], [], None, None
    for out in llm.stream(prompt_ids, params):
        cached = out.cached_tokens if out.cached_tokens is not None else cached
        if ttft is None and out.new_token_ids:
            ttft = time.perf_counter() - t0
        token_ids += out.new_token_ids
        text.append(out.delta_text)
        if not args.json:
            print(out.delta_text, end="", flush=True)
        finish = out.finish_reason
    total = time.perf_counter() - t0
    summary = generation_summary(llm, len(prompt_ids), len(token_ids), ttft or total, total)
    if args.json:
        print(
            json.dumps(
                {
                    "model": llm.model.source_path,
                    **engine_description(llm),
                    "prompt": prompt,
                    "prompt_token_ids": prompt_ids,
                    "completion": "".join(text),
                    "completion_token_ids": token_ids,
                    "finish_reason": finish,
                    **summary,
                    **({"cached_prompt_tokens": cached} if cached is not None else {}),
                }
            )
        )
    else:
        print()
        print(format_summary(summary), file=sys.stderr)
    return 0


def engine_description(llm) -> dict:
    """What ran: the weight formats actually in the model, the KV codec (with its halves) and the KV block size."""
    from ..kernels import dense_gemm
    from ..kernels.cpu.dispatch import describe

    cache = llm.config.cache
    return {
        "weights": ",".join(llm.model.weight_formats()),
        "kv_cache_dtype": llm.engine.runner.codec.describe(llm.model.config.head_dim),  # the codec that ran
        "block_size": cache.block_size,
        "kernels": {**describe(), "decode_step": llm.engine.runner.decode_path, "prefill_gemm": dense_gemm.describe()},
        "device": llm.engine.runner.describe(),
    }  # backend (native / triton), the GPU path's kernels


def generation_summary(llm, n_prompt: int, n_out: int, ttft: float, total: float) -> dict:
    """Timings and the roofline check: weight bytes × decode tokens/s against measured read bandwidth."""
    from ..perf.measure import this_machine

    decode_time = max(total - ttft, 1e-9)
    decode_tps = (n_out - 1) / decode_time if n_out > 1 else 0.0
    weight_bytes = llm.model.weight_bytes()
    stats = llm.engine.stats
    # batch 1: every decode step reads every weight once (a MoE model: only the top-k experts); a step that
    # verified speculative drafts yielded several tokens for one read
    steps_per_s = max(n_out - 1 - stats.spec_accepted_tokens, 0) / decode_time if n_out > 1 else 0.0
    achieved = llm.model.decode_weight_bytes() * steps_per_s
    if llm.config.device == "cuda":  # the GPU's own measured read bandwidth
        from ..perf.measure_gpu import this_gpu

        peak = this_gpu().memory_bandwidth
    else:
        peak = this_machine(measure_if_missing=True, threads=llm.config.num_threads or 2).memory_bandwidth
    return {
        "prompt_tokens": n_prompt,
        "generated_tokens": n_out,
        "ttft_s": ttft,
        "total_s": total,
        "prefill_tokens_per_s": n_prompt / ttft if ttft else None,
        "decode_tokens_per_s": decode_tps,
        "weight_bytes": weight_bytes,
        "achieved_weight_gb_per_s": achieved / 1e9,
        "measured_read_gb_per_s": peak / 1e9,
        "fraction_of_read_bandwidth": achieved / peak,
        "load_s": llm.load_time,
        **({"speculative": speculative_summary(llm)} if llm.config.speculative else {}),
    }


def speculative_summary(llm) -> dict:
    """Drafts proposed and kept: acceptance rate and mean tokens a verifying step yields (accepted + its own)."""
    s = llm.engine.stats
    return {
        **llm.config.speculative.to_dict(),
        "batch_limit": llm.engine.spec_batch_limit.to_dict(),
        "verifications": s.spec_verifications,
        "draft_tokens": s.spec_draft_tokens,
        "accepted_tokens": s.spec_accepted_tokens,
        "acceptance_rate": s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else None,
        "mean_tokens_per_verification": (
            1 + s.spec_accepted_tokens / s.spec_verifications if s.spec_verifications else None
        ),
    }


def format_summary(s: dict) -> str:
    return (
        f"[{s['prompt_tokens']} prompt tokens, {s['generated_tokens']} generated] "
        f"TTFT {s['ttft_s'] * 1e3:.0f} ms, decode {s['decode_tokens_per_s']:.1f} tok/s, "
        f"weights {s['weight_bytes'] / 1e6:.0f} MB → {s['achieved_weight_gb_per_s']:.2f} GB/s achieved "
        f"= {100 * s['fraction_of_read_bandwidth']:.0f}% of this machine's measured "
        f"{s['measured_read_gb_per_s']:.1f} GB/s read bandwidth"
        + (
            f"; speculative: {s['speculative']['accepted_tokens']} of {s['speculative']['draft_tokens']} drafts "
            f"accepted"
            if s.get("speculative")
            else ""
        )
    )
