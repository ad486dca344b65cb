"""The small endpoints: /v1/models/{id}, /version, /tokenize, /detokenize, and /docs rendered without a CDN."""

from __future__ import annotations

from bytediet import __version__
from tests.server.conftest import client, run


def get_all(app, *paths):
    async def go():
        async with client(app) as c:
            return [await c.get(p) for p in paths]

    return run(go())


def test_models_retrieve_by_id_and_alias(server):
    one, alias, missing = get_all(server.app, "/v1/models/tiny", "/v1/models/tiny-alias", "/v1/models/gpt-4")
    assert one.status_code == 200 and one.json()["id"] == "tiny" and one.json()["object"] == "model"
    assert alias.json()["id"] == "tiny-alias"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_version(server):
    (r,) = get_all(server.app, "/version")
    assert r.status_code == 200 and r.json()["version"] == __version__


def test_docs_assets_are_served_locally(server):
    docs, schema = get_all(server.app, "/docs", "/openapi.json")
    assert docs.status_code == 200 and "cdn" not in docs.text.lower() and "http" not in docs.text.split("<body>")[1]
    assets = [part.split('"')[0] for part in docs.text.split('src="')[1:]] + [
        part.split('"')[0] for part in docs.text.split('href="')[1:]
    ]
    local = [a for a in assets if a.startswith("/docs/static/")]
    assert local, docs.text
    for r in get_all(server.app, *local):
        assert r.status_code == 200 and len(r.content) > 100
    assert "/v1/models/{model_id}" in schema.json()["paths"]


def test_tokenize_and_detokenize_round_trip(server):
    async def go():
        async with client(server.app) as c:
            tok = await c.post("/tokenize", json={"prompt": "hello"})
            chat = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
            detok = await c.post("/detokenize", json={"tokens": tok.json()["tokens"][1:]})
            bad = await c.post("/detokenize", json={"tokens": [1000]})
            neither = await c.post("/tokenize", json={})
            return tok, chat, detok, bad, neither

    tok, chat, detok, bad, neither = run(go())
    assert tok.json() == {"count": 6, "max_model_len": 256, "tokens": server.llm.tokenizer.encode("hello")}
    assert chat.json()["tokens"] == server.llm.chat_token_ids([{"role": "user", "content": "hi"}])
    assert detok.json() == {"prompt": "hello"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"


def test_tokenizer_info_gives_the_special_tokens_as_text(server):
    async def go():
        async with client(server.app) as c:
            return await c.get("/tokenizer_info")

    info = run(go()).json()
    assert info == {
        "tokenizer_class": "CharTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": None,
        "chat_template": None,
        "model_max_length": 256,
    }
