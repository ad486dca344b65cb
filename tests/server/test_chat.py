"""/v1/chat/completions on a tiny random model: the chat template, streaming deltas, logprobs."""

from __future__ import annotations

import math

from bytediet.engine.params import SamplingParams
from tests.server.conftest import MODEL, CharTokenizer, client, parse_sse, run, tiny_llm

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def chat(app, **body):
    async def go():
        async with client(app) as c:
            return await c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body})

    return run(go())


def test_chat_renders_the_template_and_equals_offline_chat(server):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = tiny_llm().chat(MESSAGES, params)[0].outputs[0]
    r = chat(server.app, temperature=0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    tok = CharTokenizer()
    prompt = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8}
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in want.token_ids]
    for c, lp in zip(content, want.logprobs):
        assert math.isclose(c["logprob"], lp.logprob, rel_tol=1e-5)
        assert c["bytes"] == list(c["token"].encode())
        assert [t["token"] for t in c["top_logprobs"]] == [tok.decode([t]) for t, _ in lp.top]


def test_chat_defaults_to_generating_until_eos_or_the_context_end(server):
    body = chat(server.app, temperature=0).json()  # no max_tokens: None, not OpenAI completions' 16
    (choice,) = body["choices"]
    n_prompt = body["usage"]["prompt_tokens"]
    if choice["finish_reason"] == "length":
        assert n_prompt + body["usage"]["completion_tokens"] == 256
    else:
        assert choice["finish_reason"] == "stop"


def test_stream_deltas_join_to_the_whole_message(server):
    whole = chat(server.app, temperature=0, max_tokens=7, n=2, seed=3, ignore_eos=True).json()
    r = chat(
        server.app,
        temperature=0,
        max_tokens=7,
        n=2,
        seed=3,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert all(m["finish_reason"] is None and set(m["delta"]) == {"content"} for m in mine[1:-1])
        text = "".join(m["delta"]["content"] for m in mine[1:-1])
        assert text == whole["choices"][index]["message"]["content"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_developer_role_and_text_parts_render_like_system_and_string(server):
    parts = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
    ]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]

    async def go(messages):
        async with client(server.app) as c:
            r = await c.post(
                "/v1/chat/completions",
                json={"messages": messages, "temperature": 0, "max_tokens": 4, "ignore_eos": True},
            )
            return r.json()

    a, b = run(go(parts)), run(go(plain))
    assert a["usage"] == b["usage"]
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
