"""/metrics: Prometheus text whose counters move by exactly what the responses report."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import client, run

LABEL = {"model_name": "tiny"}


def scrape(app) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels other than model_name): value}."""

    async def go():
        async with client(app) as c:
            return await c.get("/metrics")

    r = run(go())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.get("model_name") == "tiny", s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def delta(before, after, name, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_counters_and_histograms_increase_by_what_was_served(server):
    before = scrape(server.app)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert (f"bytediet:{name}", ()) in before

    async def go():
        async with client(server.app) as c:
            a = await c.post(
                "/v1/completions", json={"prompt": "count me", "max_tokens": 7, "ignore_eos": True, "n": 2}
            )
            b = await c.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "and me"}],
                    "max_tokens": 5,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            return a.json(), b

    a, _ = run(go())
    after = scrape(server.app)
    chat_prompt = len("[user]and me[assistant]")
    assert delta(before, after, "bytediet:request_success_total", finished_reason="length") == 3
    # n = 2 runs the prompt twice through the engine
    assert delta(before, after, "bytediet:prompt_tokens_total") == 2 * a["usage"]["prompt_tokens"] + chat_prompt
    assert delta(before, after, "bytediet:generation_tokens_total") == 14 + 5
    assert delta(before, after, "bytediet:time_to_first_token_seconds_count") == 3
    assert delta(before, after, "bytediet:time_per_output_token_seconds_count") == (7 - 1) * 2 + (5 - 1)
    assert delta(before, after, "bytediet:e2e_request_latency_seconds_count") == 3
    assert delta(before, after, "bytediet:e2e_request_latency_seconds_sum") > 0
    assert after[("bytediet:kv_cache_usage_perc", ())] == 0.0  # everything finished and freed
    assert after[("bytediet:num_requests_running", ())] == 0


def test_prefix_cache_counters_count_tokens(server):
    prompt = "a shared system prompt, long enough for blocks"

    async def go():
        async with client(server.app) as c:
            for _ in range(2):
                await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})

    before = scrape(server.app)
    run(go())
    after = scrape(server.app)
    cacheable = len(prompt) + 1 - 1  # BOS + characters; the last token is always computed
    assert delta(before, after, "bytediet:prefix_cache_queries_total") == 2 * cacheable
    # the second request hits its full blocks and, token-granular, the head of the first one's last block
    assert delta(before, after, "bytediet:prefix_cache_hits_total") == cacheable


def test_two_apps_keep_separate_registries(server):
    from bytediet.server.app import build_app

    build_app(server.engine, "tiny")  # a second app on the same engine must not clash with the first
    assert ("bytediet:prompt_tokens_total", ()) in scrape(server.app)


def test_speculative_counters_count_drafts_and_accepted_tokens(make_server):
    srv = make_server(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    before = scrape(srv.app)

    async def go():
        async with client(srv.app) as c:
            return await c.post(
                "/v1/completions",
                json={"prompt": "abcabcabcabcabc", "max_tokens": 16, "ignore_eos": True, "temperature": 0},
            )

    r = run(go())
    assert r.status_code == 200, r.text
    after = scrape(srv.app)
    stats = srv.core.stats
    assert delta(before, after, "bytediet:spec_decode_num_draft_tokens_total") == stats.spec_draft_tokens > 0
    assert delta(before, after, "bytediet:spec_decode_num_accepted_tokens_total") == stats.spec_accepted_tokens
    assert delta(before, after, "bytediet:spec_decode_num_drafts_total") == stats.spec_verifications
    assert delta(before, after, "bytediet:generation_tokens_total") == 16
