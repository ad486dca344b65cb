"""``bytediet chat``: an interactive multi-turn chat rendered with the model's own chat template."""

from __future__ import annotations

import argparse
import sys

from ._engine_args import add_model_args, add_sampling_args, build_llm, sampling_params

EXIT_WORDS = {"/exit", "/quit"}


def register(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="interactive multi-turn chat (the model's chat template)",
        description="Chat with a model. Type /exit (or send end-of-file) to leave, /reset to start over.",
    )
    p.add_argument("--system", default=None, help="system message")
    add_model_args(p)
    add_sampling_args(p)
    p.set_defaults(handler=run, max_tokens=256)


def run(args: argparse.Namespace) -> int:
    llm = build_llm(args)
    params = sampling_params(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    llm.chat_prompt(base + [{"role": "user", "content": "hi"}])  # fail early if the model has no template
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in EXIT_WORDS:
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages = list(base)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        print("assistant> ", end="", flush=True)
        reply = []
        for out in llm.stream(llm.chat_token_ids(messages), params):
            print(out.delta_text, end="", flush=True)
            reply.append(out.delta_text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
