"""lm-evaluation-harness as a real client: its ``local-completions`` model against a live bytediet server.

Hugging Face datasets cannot be downloaded here, so the tasks are local: a few Jane Austen sentences (the
corpus of ``bytediet.eval``) written as JSONL beside two task YAMLs (``dataset_path: json``). One task is
multiple choice (log-likelihoods: ``echo`` + ``logprobs`` on /v1/completions, the prompt scored), one is
``generate_until``. The tokenizer is the server's own (``tokenizer_backend=remote``: /tokenizer_info,
/tokenize, /detokenize), so the requests go out as token ids. The strongest check: every log-likelihood
lm-eval reports equals the same continuation scored by one forward pass of the served model, and its
accuracy is the one those scores give.
"""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch

from bytediet.engine.async_engine import AsyncEngine
from bytediet.engine.llm import LLM
from bytediet.server.app import build_app
from tests.server.conftest import live

MODEL = "smollm2"
NUM_DOCS = 6

CLOZE_YAML = """\
task: austen_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

COMPLETE_YAML = """\
task: austen_complete
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: " {{{{ending}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def austen_docs(count: int) -> list[dict]:
    """``count`` sentences of Pride and Prejudice: the context, its last three words, and two wrong endings."""
    from bytediet.eval.corpus import load_corpus

    text = re.sub(r"\b(Mrs?|Dr|St)\.", r"\1", " ".join(load_corpus("prideprejudice").split()))  # not a sentence end
    sentences = [
        s
        for s in re.split(r"(?<=[.!?])\s+", text)
        if 14 <= len(s.split()) <= 30 and re.fullmatch(r"[A-Za-z ,;']+\.", s)
    ]
    picked = random.Random(0).sample(sentences, count)
    endings = [" ".join(s[:-1].split()[-3:]) for s in picked]
    docs = []
    for i, s in enumerate(picked):
        words = s[:-1].split()
        choices = [endings[i], endings[(i + 1) % count], endings[(i + 2) % count]]
        random.Random(i).shuffle(choices)
        docs.append(
            {
                "context": " ".join(words[:-3]),
                "ending": endings[i],
                "choices": choices,
                "label": choices.index(endings[i]),
            }
        )
    return docs


@pytest.fixture(scope="module")
def served():
    """The default model behind a real uvicorn socket; yields (base url, the LLM whose engine it serves)."""
    llm = LLM("default")
    engine = AsyncEngine(llm.engine)
    try:
        with live(build_app(engine, [MODEL])) as (host, port):
            yield f"http://{host}:{port}", llm
    finally:
        engine.shutdown()


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``TemplateLM._encode_pair``: trailing spaces of the context move to the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def loglikelihood(model, ctx: list[int], cont: list[int]) -> float:
    """log p(cont | ctx) from one forward pass over ctx + cont."""
    ids = torch.tensor(ctx + cont)
    lp = model.score(ids).log_softmax(dim=-1)[len(ctx) - 1 : -1]
    return float(lp.gather(1, torch.tensor(cont).unsqueeze(1)).sum())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_lm_eval_local_completions_against_the_server(served, tmp_path, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    base, llm = served
    data = tmp_path / "austen.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in austen_docs(NUM_DOCS)))
    (tmp_path / "austen_cloze.yaml").write_text(CLOZE_YAML.format(data=data))
    (tmp_path / "austen_complete.yaml").write_text(COMPLETE_YAML.format(data=data))

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{base}/v1/completions",
            "model": MODEL,
            "tokenizer_backend": "remote",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
            "max_length": 512,
        },
        tasks=["austen_cloze", "austen_complete"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        limit=NUM_DOCS,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )
    results, samples = out["results"], out["samples"]

    acc = results["austen_cloze"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and math.isfinite(acc)
    cloze = samples["austen_cloze"]
    assert len(cloze) == NUM_DOCS
    right = 0
    for s in cloze:
        ours = [loglikelihood(llm.model, *encode_pair(llm.tokenizer, ctx, cont)) for ctx, cont in s["arguments"]]
        theirs = [resp[0][0] for resp in s["resps"]]
        assert theirs == pytest.approx(ours, abs=2e-3), s["doc"]
        right += int(max(range(len(ours)), key=ours.__getitem__) == s["doc"]["label"])
    assert acc == pytest.approx(right / NUM_DOCS)

    em = results["austen_complete"]["exact_match,none"]
    assert 0.0 <= em <= 1.0
    complete = samples["austen_complete"]
    assert len(complete) == NUM_DOCS
    generated = [s["resps"][0][0] for s in complete]
    assert all(isinstance(g, str) for g in generated) and any(g.strip() for g in generated), generated
    assert all("\n" not in g and "." not in g for g in generated), generated  # `until` reached the server's stop
