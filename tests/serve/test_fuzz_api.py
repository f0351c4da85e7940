"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis, on a real server process with the tiny model):
bodies that fit the schema and bodies that break it, on every endpoint, for about a minute. No 5xx but the
declared 503, every 4xx an OpenAI error object, every answer as the schema declares it (status, content type,
body, headers such as ``Retry-After``), a body that breaks the schema refused with a 4xx; afterwards the server
still answers a plain request and its log holds no traceback. CI draws the same cases every run;
``MTPFLOW_FUZZ_RANDOM=1 MTPFLOW_FUZZ_SECONDS=600 MTPFLOW_FUZZ_EXAMPLES=5000`` explores further."""
from __future__ import annotations

import os
import time
from collections import Counter

import httpx
import pytest

from server_process import ServerProcess, save_tiny_model

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the skip
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance, negative_data_rejection, response_headers_conformance, response_schema_conformance,
    status_code_conformance,
)

BUDGET_SECONDS = float(os.environ.get("MTPFLOW_FUZZ_SECONDS", "60"))
MAX_EXAMPLES = int(os.environ.get("MTPFLOW_FUZZ_EXAMPLES", "400"))
RANDOM = os.environ.get("MTPFLOW_FUZZ_RANDOM") == "1"  # CI draws the same cases every run; this explores
CHECKS = [status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    folder = save_tiny_model(tmp / "model")
    # a short default answer and a deadline: a fuzzed max_tokens of thousands ends at 3 s, not minutes
    with ServerProcess(tmp / "server.log", f"model.name={folder}", f"trace.db={tmp / 'traces.db'}", "trace.sample=1.0",
                       "max_new_tokens=8", "engine.request_timeout=3", "max_batch_size=4") as srv:
        yield srv
        assert srv.stop() == 0


def is_error_object(response) -> bool:
    try:
        err = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] and "\n" not in err["message"])


def test_fuzz_the_api_from_its_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models/{model_id}"} <= set(schema.raw_schema["paths"])
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    statuses: Counter = Counter()
    problems: list[str] = []
    stop_at = time.monotonic() + BUDGET_SECONDS

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case):
        if time.monotonic() > stop_at:  # the time bound: the remaining examples pass at once
            return
        response = case.call(base_url=server.url, timeout=60)
        statuses[response.status_code] += 1
        label = f"{case.operation.label} {response.status_code}: {case.body!r:.300}"
        if response.status_code >= 500 and response.status_code != 503:
            problems.append(f"server error {label} -> {response.text[:300]}")
        if 400 <= response.status_code < 600 and not is_error_object(response):
            problems.append(f"not an error object {label} -> {response.text[:300]}")
        try:
            negative = case.meta is not None and case.meta.generation.mode == GenerationMode.NEGATIVE
            case.validate_response(response, checks=CHECKS + ([negative_data_rejection] if negative else []))
        except Exception as exc:  # noqa: BLE001 - collected: one report of everything found
            problems.append(f"{type(exc).__name__} {label}: {str(exc)[:600]}")

    run()
    print(f"fuzzed: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
    assert not problems, "\n".join(problems[:20])
    assert sum(statuses.values()) >= 100, statuses  # the fuzzer did reach the server, and often
    assert statuses[200] >= 10 and any(400 <= s < 500 for s in statuses), statuses
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "still answering", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert "Traceback" not in server.log()
