"""Schemathesis against the server's own OpenAPI schema, for the two generation endpoints: thousands
of generated requests, none may get a 5xx or a response that breaks the documented schema."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.conftest import start_server, stop_server

EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "500"))  # per endpoint (CI time); `make soak` raises it


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dirs, tmp_path_factory):
    target, draft = tiny_model_dirs
    server = start_server(
        ["--target", str(target), "--draft", str(draft), "--device", "cpu", "--served-model-name", "tiny"]
        + ["--max-model-len", "64", "--num-draft-tokens", "2"],  # short contexts keep each case fast
        tmp_path_factory.mktemp("fuzz") / "server.log",
    )
    yield server
    stop_server(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generated_requests_get_no_5xx_and_match_the_schema(fuzz_server, path):
    operation = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")[path]["POST"]
    tried = []

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def check(case) -> None:
        response = case.call(base_url=fuzz_server.url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        tried.append(response.status_code)

    check()
    print(f"{path}: {len(tried)} generated cases, statuses {dict(sorted(Counter(tried).items()))}")
    assert len(tried) >= EXAMPLES * 0.9  # hypothesis really ran that many cases
    assert any(status == 200 for status in tried)  # and some were valid enough to generate
