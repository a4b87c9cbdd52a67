"""A bounded schemathesis run against a live server: requests generated from /openapi.json for every operation
(the schema's examples, then fuzzing with data that fits the schema and data that does not), checked by
schemathesis' not_a_server_error: not one answer may be a 5xx. The server runs the embedded SmolLM2 on the CPU
without speculation; generated bodies keep max_tokens <= MAX_TOKENS and n <= MAX_N, so the run stays well under a
minute. The same server runs with --chat-template, which test_chat_template_flag_reaches_the_server checks.

DDTREE_TEST_SCHEMATHESIS_SCALE=10 (say) makes a longer, randomized hunt that adds schemathesis' coverage phase
(every boundary of every field: about 1,000 requests and 90 s at scale 1)."""
from __future__ import annotations

import collections
import os

import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.config import HealthCheck
from schemathesis.engine import events, from_schema

from tests.server.conftest import start_server, stop_server

MAX_TOKENS, MAX_N = 3, 2
SCALE = float(os.environ.get("DDTREE_TEST_SCHEMATHESIS_SCALE", "1"))
EXAMPLES = round(20 * SCALE)  # per operation, both generation modes together
TEMPLATE = ("<|im_start|>system\nschemathesis<|im_end|>\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def probe_server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("schemathesis-server")
    template = logs / "template.jinja"
    template.write_text(TEMPLATE)
    s = start_server(logs, "schemathesis", "--drafter", "none", "--max-model-len", "512", "--chat-template",
                     str(template), "--no-access-log")
    try:
        yield s
    finally:
        code = stop_server(s)
    assert code == 0, f"server exited with {code}:\n{s.log_tail()}"


def bounded(case):
    """Keeps a generated body cheap to serve (what it asks for is otherwise left as generated)."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if type(body.get(key)) is int and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS  # chat's default is the rest of the context
        if type(body.get("n")) is int and body["n"] > MAX_N:
            body["n"] = MAX_N
    return case


def test_generated_requests_never_get_a_5xx(probe_server):
    schema = schemathesis.openapi.from_url(probe_server.base_url + "/openapi.json")
    schema.config.update(suppress_health_check=[HealthCheck.all], request_timeout=120)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES,
                                    deterministic=SCALE == 1, database="none")
    schema.config.phases.update(phases=["examples", "fuzzing"] + (["coverage"] if SCALE > 1 else []))
    schema.config.checks.update(included_check_names=["not_a_server_error"])
    schema.hook("map_case")(lambda context, case: bounded(case))
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures, errors = [], []
    for event in from_schema(schema).execute():
        if isinstance(event, (events.NonFatalError, events.FatalError)):
            errors.append(f"{event.label if hasattr(event, 'label') else ''}: {event.value!r}")
        if isinstance(event, events.ScenarioFinished):
            for interaction in event.recorder.interactions.values():
                if interaction.response is not None:
                    statuses[event.label][interaction.response.status_code] += 1
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.status.name == "FAILURE":
                        case = event.recorder.cases[case_id].value
                        failures.append(f"{event.label}: {check.name}: {check.failure_info}\n"
                                        f"{case.as_curl_command()}")
    summary = {label: dict(counts) for label, counts in statuses.items()}
    print(f"schemathesis: {sum(sum(c.values()) for c in statuses.values())} requests: {summary}")
    assert not failures, "\n\n".join(failures[:5])
    assert not errors, errors
    assert not [code for counts in statuses.values() for code in counts if code >= 500], summary
    assert set(summary) >= {"POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize",
                            "POST /detokenize", "GET /v1/models", "GET /v1/models/{model}", "GET /health"}, summary
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):  # generation really ran
        assert summary[label].get(200, 0) > 0, summary
    assert "Traceback" not in probe_server.log_tail(400)


def test_chat_template_flag_reaches_the_server(probe_server):
    import httpx

    messages = [{"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=probe_server.base_url, timeout=60) as http:
        rendered = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        expect = "<|im_start|>system\nschemathesis<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert rendered == http.post("/tokenize", json={"prompt": expect, "add_special_tokens": False}).json()["tokens"]
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(rendered)
