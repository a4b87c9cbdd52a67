"""The HTTP process without an engine: it imports neither torch nor transformers, /openapi.json publishes the
request and response models, and the /health and /metrics probes stay out of http_requests_total."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import REPO_ROOT

# Every server module is imported, the app built, its OpenAPI document generated and `ddtree serve`'s flags
# parsed, in a fresh interpreter; then no module of torch or transformers may be loaded.
FRESH_IMPORTS = """
import importlib, pkgutil, sys
import server
for info in pkgutil.iter_modules(server.__path__):
    if info.name != "__main__":
        importlib.import_module("server." + info.name)
from server.app import create_app
from server.cli import parser, serve_configs
server_config, engine_config = serve_configs(parser().parse_args(["serve", "--drafter", "none"]))
app = create_app(server_config, engine_config)
app.openapi()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
"""


def test_the_http_process_imports_neither_torch_nor_transformers():
    out = subprocess.run([sys.executable, "-c", FRESH_IMPORTS], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.fixture
def app():
    """The app without its lifespan: no engine, so /health answers 503 (loading) and generation 503."""
    from engine.config import EngineConfig
    from server.app import create_app
    from server.config import ServerConfig

    return create_app(ServerConfig(), EngineConfig())


def call(app, *requests: tuple[str, str]) -> list[httpx.Response]:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(method, path) for method, path in requests]

    return asyncio.run(run())


def test_probes_are_not_counted_in_http_requests(app):
    from prometheus_client.parser import text_string_to_metric_families

    responses = call(app, *[("GET", "/health")] * 3, ("GET", "/metrics"), ("GET", "/v1/models"),
                     ("GET", "/v1/nothing"), ("POST", "/v1/chat/completions"), ("GET", "/openapi.json"))
    assert [r.status_code for r in responses] == [503, 503, 503, 200, 200, 404, 503, 200]
    counts = {}
    for family in text_string_to_metric_families(app.state.server.metrics.render().decode()):
        for s in family.samples:
            if s.name == "ddtree:http_requests_total":
                counts[s.labels["status"]] = s.value
    assert counts == {"200": 2, "404": 1, "503": 1}  # /v1/models, /openapi.json; the 404; the chat completion


def test_openapi_publishes_the_request_and_response_models(app):
    (r,) = call(app, ("GET", "/openapi.json"))
    doc = r.json()
    schemas = doc["components"]["schemas"]

    def body_schema(path: str) -> dict:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return schemas[ref.rsplit("/", 1)[1]]

    assert {"messages", "max_completion_tokens", "logprobs", "chat_template_kwargs"} <= \
        set(body_schema("/v1/chat/completions")["properties"])
    assert "messages" in body_schema("/v1/chat/completions")["required"]
    assert {"prompt", "echo", "logprobs"} <= set(body_schema("/v1/completions")["properties"])
    assert {"prompt", "messages"} <= set(body_schema("/tokenize")["properties"])
    assert body_schema("/detokenize")["required"] == ["tokens"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert "text/event-stream" in chat["200"]["content"]
    assert chat["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert not any("422" in op["responses"] for item in doc["paths"].values() for op in item.values())
    refs = set()

    def collect(node):
        if isinstance(node, dict):
            refs.update(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(doc)
    assert {ref.rsplit("/", 1)[1] for ref in refs} <= set(schemas)  # every reference resolves
    assert json.loads(json.dumps(doc)) == doc
