"""/openapi.json from the request and response models.

The routes read their bodies themselves (the body-size cap, auth and readiness before validation, 400s instead of
FastAPI's 422s), so FastAPI cannot infer a request body from their signatures: each route names its request model
with `body(Model)` (an `openapi_extra` that refers to the model's schema) and its responses with `replies(...)`;
`install_openapi` adds the request models' JSON schemas (validation mode: what a client may send) to the
document's components, beside the response models FastAPI puts there itself."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.errors import ErrorResponse

REF = "#/components/schemas/{model}"
_BODY_MODELS: dict[str, type[BaseModel]] = {}  # schema name -> request model, filled by body()


def body(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra of a route whose JSON body is `model`."""
    _BODY_MODELS[model.__name__] = model
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def path_param(name: str) -> dict[str, Any]:
    """openapi_extra of a route with a string path parameter that it reads from request.path_params."""
    return {"parameters": [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]}


def replies(model: Optional[type[BaseModel]], streams: bool = False) -> dict[Any, Any]:
    """`responses` of a route: `model` as JSON (or an SSE stream when the request asks for one), and the OpenAI
    error envelope for every error status."""
    ok: dict[str, Any] = {"description": "Success"}
    if model is not None:
        ok["model"] = model
    if streams:
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    error = {"model": ErrorResponse, "description": "OpenAI error envelope"}
    return {200: ok, "4XX": error, "5XX": error}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="OpenAI-compatible LLM inference with DDTree speculative decoding")
            _, defs = models_json_schema([(m, "validation") for m in _BODY_MODELS.values()], ref_template=REF)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                if components.setdefault(name, definition) != definition:
                    raise RuntimeError(f"two OpenAPI schemas are named {name}")
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
