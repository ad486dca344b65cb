"""``echo`` on /v1/completions: the prompt comes first, and with ``logprobs`` its tokens are scored (prompt
logprobs, what lm-evaluation-harness reads for log-likelihoods); ``max_tokens`` 0 returns the prompt alone.
The reference is one forward pass of the same model over the prompt."""

from __future__ import annotations

import pytest
import torch

from tests.server.conftest import CharTokenizer, parse_sse
from tests.server.test_completions import completion, stream_text

PROMPT = "It is a truth"


def reference(model, ids: list[int]) -> list[float]:
    lp = model.score(torch.tensor(ids)).log_softmax(dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def check_prompt_logprobs(model, ids: list[int], lp: dict) -> None:
    tok = CharTokenizer()
    n = len(ids)
    assert lp["tokens"][:n] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx(reference(model, ids), abs=1e-4)
    for token, value, top in zip(lp["tokens"][1:n], lp["token_logprobs"][1:n], lp["top_logprobs"][1:n]):
        assert top[token] == value and 2 <= len(top) <= 3  # the top 2 and the prompt token itself
        assert max(top.values()) >= value
    assert lp["text_offset"][:n] == [0] + list(range(3, n + 2))  # "<s>" (BOS), then one character per token


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server):
    r = completion(server.app, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    ids = CharTokenizer().encode(PROMPT)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    check_prompt_logprobs(server.llm.model, ids, choice["logprobs"])


def test_echo_puts_the_prompt_before_the_same_generation(server):
    body = dict(prompt=PROMPT, temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    plain = completion(server.app, **body).json()["choices"][0]
    echoed = completion(server.app, echo=True, **body).json()["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    ids = CharTokenizer().encode(PROMPT)
    lp = echoed["logprobs"]
    check_prompt_logprobs(server.llm.model, ids, lp)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][len(ids) :] == plain["logprobs"][key]
    assert lp["text_offset"][len(ids) :] == [len(PROMPT) + i for i in plain["logprobs"]["text_offset"]]


def test_token_id_prompts_echo_their_decoded_text_per_choice(server):
    prompts = [[40, 41, 42, 43], [50, 51]]
    r = completion(server.app, prompt=prompts, n=2, echo=True, logprobs=0, max_tokens=0)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        ids = prompts[c["index"] // 2]
        assert c["text"] == CharTokenizer().decode(ids)
        lp = c["logprobs"]
        assert lp["token_logprobs"][1:] == pytest.approx(reference(server.llm.model, ids), abs=1e-4)
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])  # logprobs 0: the prompt token alone


def test_echo_without_logprobs_is_text_only(server):
    r = completion(server.app, prompt=PROMPT, echo=True, max_tokens=2, temperature=0)
    (choice,) = r.json()["choices"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) == len(PROMPT) + 2
    assert choice["logprobs"] is None


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_equals_the_whole_response(server, max_tokens):
    body = dict(prompt=[PROMPT, "Emma"], echo=True, logprobs=1, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    whole = completion(server.app, **body).json()
    events = parse_sse(completion(server.app, stream=True, stream_options={"include_usage": True}, **body).text)
    assert stream_text(events[:-1]) == {c["index"]: c["text"] for c in whole["choices"]}
    for c in whole["choices"]:
        mine = [ch for e in events[:-2] for ch in e["choices"] if ch["index"] == c["index"]]
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == [c["finish_reason"]]
        got = {key: [v for ch in mine if ch["logprobs"] for v in ch["logprobs"][key]] for key in c["logprobs"]}
        assert got == c["logprobs"]
    assert events[-2]["usage"] == whole["usage"]


def test_max_tokens_0_without_echo_is_a_400(server):
    r = completion(server.app, prompt=PROMPT, max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
