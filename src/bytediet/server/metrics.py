"""Prometheus metrics of one served model, with vLLM's metric names under the ``bytediet:`` prefix.

Two kinds of collectors live in one private ``CollectorRegistry`` per server (no global state, so
several apps can coexist in one process):

* per-request observations made by the server as tokens stream out (:meth:`ServerMetrics.track`):
  requests finished by reason, prompt and generated tokens, time to first token, time per output
  token (the gap between consecutive engine outputs, divided by the tokens they carry) and
  end-to-end latency. One engine sequence counts as one request (``n = 3`` counts three).
* engine state read at scrape time (:class:`_EngineCollector`, the engine's ``counters()``): running /
  waiting requests, KV-cache
  usage (1 - free blocks / blocks), prefix-cache queries and hits (in tokens, as vLLM counts them),
  preemptions, and what is served: ``engine_info{kv_codec, weight_format}`` and the KV cache's
  compression ratio against fp16 (16 / the codec's stored bits per coordinate); with KV tiers (docs/kv-tiers.md),
  per tier (``ram``, ``disk``): prompt tokens loaded (hits) and recomputed by the policy, bytes held, load latency
  (a summary: count and total seconds), and the tokens no tier held (misses).
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from ..engine.engine import StepOutput

PREFIX = "bytediet:"
# Bucket edges from vLLM's metrics (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector(Collector):
    """Reads the engine's counters at scrape time (after its last step; the same in-thread or out of process)."""

    def __init__(self, async_engine, model_name: str) -> None:
        self.async_engine, self.labels = async_engine, [model_name]
        info = async_engine.info
        self.kv_codec, self.compression, self.weight_format = info.kv_codec, info.kv_compression, info.weight_format
        self.num_blocks, self.block_size = info.num_blocks, info.block_size

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric(self.labels, value)
        return c

    def collect(self):
        c = self.async_engine.counters()
        yield self._gauge("num_requests_running", "Requests being computed.", c.num_running)
        yield self._gauge("num_requests_waiting", "Requests queued for their first schedule.", c.num_waiting)
        yield self._gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            1.0 - c.num_free_blocks / max(self.num_blocks, 1),
        )
        yield self._counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            c.prefix_queries * self.block_size + c.prefix_partial_query_tokens,
        )
        yield self._counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            c.prefix_hits * self.block_size + c.prefix_partial_hit_tokens,
        )
        yield self._counter("num_preemptions", "Requests preempted to free KV blocks.", c.num_preemptions)
        yield self._counter(
            "spec_decode_num_drafts", "Request-steps that verified speculative drafts.", c.spec_verifications
        )
        yield self._counter("spec_decode_num_draft_tokens", "Speculative draft tokens proposed.", c.spec_draft_tokens)
        yield self._counter(
            "spec_decode_num_accepted_tokens", "Speculative draft tokens the target accepted.", c.spec_accepted_tokens
        )
        info = GaugeMetricFamily(
            PREFIX + "engine_info",
            "What is served (value 1): KV codec and weight format.",
            labels=["model_name", "kv_codec", "weight_format"],
        )
        info.add_metric(self.labels + [self.kv_codec, self.weight_format], 1.0)
        yield info
        yield self._gauge(
            "kv_cache_compression_ratio", "KV-cache bytes at fp16 / bytes as stored by the codec.", self.compression
        )
        engine = getattr(self.async_engine, "engine", None)  # in-process engine (thread mode): its KV tiers
        if engine is not None and getattr(engine, "tiers", None) is not None:
            yield from self._tiers(engine.tiers)

    def _tiers(self, tiers):
        """The KV tiers below the pool, one ``tier`` label each."""
        families = {
            "hits": CounterMetricFamily(
                PREFIX + "kv_offload_hit_tokens", "Prompt tokens loaded from a KV tier.", labels=["model_name", "tier"]
            ),
            "skipped": CounterMetricFamily(
                PREFIX + "kv_offload_skipped_tokens",
                "Prompt tokens a KV tier held but recomputed (loading predicted slower).",
                labels=["model_name", "tier"],
            ),
            "bytes": GaugeMetricFamily(
                PREFIX + "kv_offload_bytes", "Bytes of KV blocks held by a tier.", labels=["model_name", "tier"]
            ),
            "latency": SummaryMetricFamily(
                PREFIX + "kv_offload_load_seconds", "Time to load a request's blocks.", labels=["model_name", "tier"]
            ),
        }
        held = tiers.tier_bytes()
        for tier, s in tiers.stats.items():
            labels = self.labels + [tier]
            families["hits"].add_metric(labels, s.hit_tokens)
            families["skipped"].add_metric(labels, s.skipped_tokens)
            families["bytes"].add_metric(labels, held[tier])
            families["latency"].add_metric(labels, s.loads, s.load_seconds)
        yield from families.values()
        yield self._counter(
            "kv_offload_miss_tokens", "Prompt tokens looked up below the pool and found in no tier.", tiers.miss_tokens
        )


class ServerMetrics:
    """The metrics of one server; ``render()`` gives the Prometheus text exposition."""

    def __init__(self, async_engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, lab = self.registry, ["model_name"]
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", lab + ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.", lab, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", lab, registry=r).labels(
            model_name
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first token.",
            lab,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Time per output token after the first.",
            lab,
            buckets=TPOT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the end (finished requests).",
            lab,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.registry.register(_EngineCollector(async_engine, model_name))

    async def track(
        self, stream: AsyncIterator[StepOutput], num_prompt_tokens: int, arrival: Optional[float] = None
    ) -> AsyncIterator[StepOutput]:
        """Pass ``stream`` through, observing one request; a stream closed early counts as ``abort``."""
        arrival = time.perf_counter() if arrival is None else arrival
        last, reason = None, "abort"
        self.prompt_tokens.inc(num_prompt_tokens)
        try:
            async with aclosing(stream):
                async for out in stream:
                    now = time.perf_counter()
                    if out.new_token_ids:
                        if last is None:
                            self.ttft.observe(now - arrival)
                        else:
                            gap = (now - last) / len(out.new_token_ids)
                            for _ in out.new_token_ids:
                                self.tpot.observe(gap)
                        last = now
                        self.generation_tokens.inc(len(out.new_token_ids))
                    if out.finished:
                        reason = out.finish_reason or "abort"
                    yield out
        finally:
            self.request_success.labels(self.model_name, reason).inc()
            if reason != "abort":  # an abandoned request has no meaningful end-to-end time
                self.e2e.observe(time.perf_counter() - arrival)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
