"""A bounded schemathesis run against the served OpenAPI schema: requests generated from it
never get a 5xx, and every error is JSON."""

from __future__ import annotations

from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")


def test_generated_requests_get_no_server_error_and_json_errors(serve_with: Any,
                                                                 demo_bundle: Any,
                                                                 demo_service: Any) -> None:
    from mlxrunner.serve import Limits, Service

    # two tokens at most: the run is about the API, not the model
    server = serve_with(Service(demo_bundle, name="demo", limits=Limits(max_tokens_limit=2),
                                engine=demo_service.engine))
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    problems: list[tuple[str, int, str]] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15

    for operation in operations:
        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(max_examples=25, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def call(case: Any) -> None:
            reply = case.call(base_url=server.url, timeout=60)
            kind = reply.headers.get("content-type", [""])
            kind = kind[0] if isinstance(kind, list) else kind
            if reply.status_code >= 500 or (reply.status_code >= 400 and "json" not in kind):
                problems.append((case.operation.label, reply.status_code, reply.text[:200]))

        call()
    assert problems == []
