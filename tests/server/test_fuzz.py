"""Fuzzing from the server's own OpenAPI schema (schemathesis): whatever the body, never a 5xx.

Bounded: ``EXAMPLES`` generated requests per operation, on the tiny model with a 32-token served
context (so any accepted request generates at most 31 tokens per sequence).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from bytediet.server.config import ServerConfig

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = 8


def test_no_generated_request_makes_a_5xx(make_server):
    s = make_server(ServerConfig(max_model_len=32))
    schema = schemathesis.openapi.from_asgi("/openapi.json", s.app)
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models/{model_id}",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
    }
    seen = []

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
        )  # no shrinking: the failure is printed
        def check(case):
            response = case.call(timeout=120)
            seen.append(response.status_code)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

        check()
    assert len(seen) >= len(operations) and not s.core.has_unfinished_requests()
