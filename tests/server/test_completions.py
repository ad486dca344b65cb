"""/v1/completions and /v1/models on a tiny random model: the offline LLM is the reference."""

from __future__ import annotations

import asyncio
import math

import pytest

from bytediet.engine.params import SamplingParams
from tests.server.conftest import MODEL, CharTokenizer, client, parse_sse, run, tiny_llm


def completion(app, **body):
    async def go():
        async with client(app) as c:
            return await c.post("/v1/completions", json={"model": MODEL, **body})

    return run(go())


def stream_text(events: list) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for ch in e["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    return texts


def test_models_lists_every_served_name(server):
    async def go():
        async with client(server.app) as c:
            return await c.get("/v1/models")

    r = run(go())
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL, "tiny-alias"]
    assert all(m["object"] == "model" and m["max_model_len"] == 256 for m in body["data"])


def test_greedy_completion_equals_offline_llm(server):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    want = tiny_llm().generate("Hello there", params)[0].outputs[0]
    r = completion(server.app, prompt="Hello there", temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == want.text and choice["finish_reason"] == "length"
    n_prompt = len(CharTokenizer().encode("Hello there"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 10, "total_tokens": n_prompt + 10}
    lp = choice["logprobs"]
    tok = CharTokenizer()
    assert lp["tokens"] == [tok.decode([t]) for t in want.token_ids]
    assert all(math.isclose(a, b.logprob, rel_tol=1e-5) for a, b in zip(lp["token_logprobs"], want.logprobs))
    assert all(
        len(top) <= 2 and max(top.values()) >= lp_ - 1e-6 for top, lp_ in zip(lp["top_logprobs"], lp["token_logprobs"])
    )
    assert lp["text_offset"] == list(range(10))  # one character per token here


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_equals_whole_response_and_is_framed_like_openai(server, include_usage):
    body = dict(prompt="Once upon", temperature=0, max_tokens=9, ignore_eos=True)
    whole = completion(server.app, **body).json()
    r = completion(server.app, stream=True, stream_options={"include_usage": include_usage}, **body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        assert all(c["usage"] is None for c in chunks[:-1])
        chunks = chunks[:-1]
    else:
        assert all("usage" not in c for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert stream_text(events)[0] == whole["choices"][0]["text"]


def test_n_seeded_choices_equal_offline_llm_and_stream(server):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    want = [o.text for o in tiny_llm().generate("abc", params)[0].outputs]
    body = dict(prompt="abc", n=3, seed=11, max_tokens=6, ignore_eos=True)  # temperature: OpenAI's default 1.0
    whole = completion(server.app, **body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert [c["text"] for c in whole["choices"]] == want
    assert len(set(want)) > 1, "seeds seed+i must give different samples"
    assert whole["usage"]["completion_tokens"] == 18 and whole["usage"]["prompt_tokens"] == 4
    streamed = stream_text(parse_sse(completion(server.app, stream=True, **body).text))
    assert [streamed[i] for i in range(3)] == want


def test_token_id_prompts_and_batches(server):
    ids = CharTokenizer().encode("token ids")
    by_text = completion(server.app, prompt="token ids", temperature=0, max_tokens=5, ignore_eos=True).json()
    by_ids = completion(server.app, prompt=ids, temperature=0, max_tokens=5, ignore_eos=True).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    other = [5, 6, 7]
    batch = completion(server.app, prompt=[ids, other], n=2, temperature=0, max_tokens=5, ignore_eos=True).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == batch["choices"][1]["text"] == by_text["choices"][0]["text"]
    assert batch["usage"]["prompt_tokens"] == len(ids) + len(other)


def test_stop_string_cuts_the_text(server):
    full = completion(server.app, prompt="Stop me", temperature=0, max_tokens=12, ignore_eos=True).json()
    text = full["choices"][0]["text"]
    stop = text[4:6]
    cut = completion(server.app, prompt="Stop me", temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_both_complete(server):
    bodies = [
        dict(prompt="first prompt", temperature=0, max_tokens=8, ignore_eos=True),
        dict(prompt="a second, longer prompt", temperature=0, max_tokens=12, ignore_eos=True, stream=True),
    ]
    solo = [completion(server.app, **{**b, "stream": False}).json()["choices"][0]["text"] for b in bodies]

    async def go():
        async with client(server.app) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    plain, streamed = run(go())
    assert plain.json()["choices"][0]["text"] == solo[0]
    assert stream_text(parse_sse(streamed.text))[0] == solo[1]
    assert not server.core.has_unfinished_requests()
    assert server.core.num_free_blocks == server.core.block_manager.num_blocks


def test_health_turns_503_when_the_engine_stops(server):
    async def go():
        async with client(server.app) as c:
            return await c.get("/health")

    assert run(go()).status_code == 200
    server.engine.shutdown()
    r = run(go())
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_an_owning_app_stops_the_engine_at_shutdown():
    from bytediet.engine.async_engine import AsyncEngine
    from bytediet.server.app import build_app, engine_alive

    engine = AsyncEngine(tiny_llm().engine)
    app = build_app(engine, MODEL, own_engine=True)

    async def lifespan():
        async with app.router.lifespan_context(app):
            assert engine_alive(engine)

    run(lifespan())
    assert not engine_alive(engine)


def test_every_sampling_field_reaches_the_engine(server):
    fields = dict(
        temperature=0.8,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        seed=2,
        max_tokens=10,
        stop_token_ids=[40],
        ignore_eos=True,
    )
    want = tiny_llm().generate("map me", SamplingParams(**{**fields, "stop_token_ids": (40,)}))[0].outputs[0]
    got = completion(server.app, prompt="map me", **fields).json()["choices"][0]
    assert got["text"] == want.text and got["finish_reason"] == want.finish_reason
    plain = completion(server.app, prompt="map me", temperature=0.8, seed=2, max_tokens=10, ignore_eos=True).json()
    assert plain["choices"][0]["text"] != want.text, "the filters and penalties should change this sample"
