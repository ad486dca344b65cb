"""The official ``openai`` package as the client, over a real socket, with an API key required."""

from __future__ import annotations

import openai
import pytest

from bytediet.server.config import ServerConfig
from tests.server.conftest import live

KEY = "sk-test-key"


@pytest.fixture
def api(make_server):
    s = make_server(ServerConfig(api_keys=(KEY,)))
    with live(s.app) as (host, port):
        base = f"http://{host}:{port}/v1"
        with openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60) as c:
            yield c, s, base


def test_models_list_and_retrieve(api):
    c, _, _ = api
    assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]
    model = c.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_completions_whole_and_streamed_agree(api):
    c, s, _ = api
    whole = c.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, logprobs=2)
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop") and whole.usage.completion_tokens >= 1
    assert len(choice.logprobs.tokens) == whole.usage.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text
    pieces = [
        chunk.choices[0].text
        for chunk in c.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, stream=True)
        if chunk.choices
    ]
    assert "".join(pieces) == choice.text


def test_chat_whole_streamed_and_logprobs(api):
    c, _, _ = api
    messages = [{"role": "user", "content": "hi"}]
    whole = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    msg = whole.choices[0]
    assert msg.message.role == "assistant" and whole.usage.completion_tokens == len(msg.logprobs.content)
    assert all(len(lp.top_logprobs) == 3 for lp in msg.logprobs.content)
    stream = c.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_without_the_key_is_a_401(api):
    _, _, base = api
    with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


def test_bad_request_surfaces_as_the_clients_error(api):
    c, _, _ = api
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt="x", n=129, max_tokens=1)
    assert err.value.param == "n"


def test_completions_echo_scores_the_prompt(api):
    c, _, _ = api
    r = c.completions.create(model="tiny", prompt="hello", max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == "hello" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens and lp.token_logprobs[0] is None
    assert all(v <= 0 and lp.top_logprobs[i][lp.tokens[i]] == v for i, v in enumerate(lp.token_logprobs) if i)
