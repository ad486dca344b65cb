"""KV tiers on SmolLM2: a repeated prompt cold / RAM-tier hit / disk hit after a restart, and a multi-turn chat.

Usage: PYTHONPATH=src OMP_NUM_THREADS=1 python bench/kv_tiers_measure.py PROMPT_TOKENS SYSTEM_TOKENS [chat]
(the workloads of ``bytediet bench --parts prefix-cache`` at other sizes; results: bench/KV_TIERS_RESULTS.md).
"""

import json
import os
import sys
import time

import torch

from bytediet.eval.corpus import corpus_token_ids
from bytediet.models.loader import load_model
from bytediet.perf.bench import BenchConfig
from bytediet.perf.peers import BytedietSystem
from bytediet.perf.prefix_cache import multi_turn_chat, repeated_prompt

n = int(sys.argv[1])
torch.set_num_threads(1)
loaded = load_model("default")
ours = BytedietSystem(loaded, threads=1)
ids, label = corpus_token_ids(loaded[1], loaded[0].config.vocab_size, 2 * n + 64, 0)
cfg = BenchConfig(
    prefix_prompt_len=n,
    prefix_new_tokens=16,
    prefix_offload_size="2GiB",
    chat_system_prompts=4,
    chat_system_len=int(sys.argv[2]),
    chat_conversations=8,
    chat_turns=2,
    chat_turn_len=32,
    chat_new_tokens=8,
)
la0 = os.getloadavg()
t0 = time.time()
rp = repeated_prompt(ours, cfg, ids, lambda m: print(m, file=sys.stderr, flush=True))
ch = multi_turn_chat(ours, cfg, ids, lambda m: print(m, file=sys.stderr, flush=True)) if len(sys.argv) > 3 else None
print(
    json.dumps(
        {
            "repeated_prompt": rp,
            "multi_turn_chat": ch,
            "load_average_start": la0,
            "load_average_end": os.getloadavg(),
            "wall_s": time.time() - t0,
            "corpus": label,
        },
        indent=1,
    )
)
