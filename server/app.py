"""The FastAPI application: `create_app(server_config, engine_config)`.

Owns the HTTP surface: the lifespan (engine process up at startup, down at shutdown), the routes, auth,
the request-body cap, the race of each generation request against the client's `http.disconnect`, the
error envelope for every failure (validation errors are 400s, never 422s; no route returns a bare 500
page), per-status HTTP metrics of the API routes (not of the /health and /metrics probes), and /openapi.json
(server/openapi.py). Generation: server/chat.py and server/completions.py on server/generation.py.

Public without a key: /health and /metrics (orchestrators and Prometheus). With --api-key everything
else needs "Authorization: Bearer <key>".
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.config import EngineConfig
from server.chat import create_chat_completion
from server.completions import create_completion
from server.config import ServerConfig
from server.engine_client import EngineInternalError, ServiceUnavailableError
from server.errors import ApiError, ErrorResponse, error_response
from server.generation import json_response
from server.openapi import body, install_openapi, path_param, replies
from server.requests import ChatCompletionRequest, CompletionRequest, parse_request
from server.responses import (ChatCompletion, Completion, DetokenizeResponse, ModelCard, ModelList,
                              TokenizeResponse)
from server.state import ServerState
from server.tokenize_requests import DetokenizeRequest, TokenizeRequest
from server.tokenizer import encode_prompt, render_chat

logger = logging.getLogger("ddtree.server")

CLIENT_CLOSED = 499  # nginx's "client closed request": what the metrics see for a request whose client left
PROBES = ("/health", "/metrics")  # not counted in http_requests_total (vLLM's instrumentator excludes them too)
DISCARD_LIMIT = 64 << 20  # an oversized body is read (and dropped) up to this, so the client sees the 413


def error_json(error: ErrorResponse) -> JSONResponse:
    return JSONResponse(error.model_dump(), status_code=error.status_code)


# ----------------------------------------------------------------------------------------- plumbing

class HTTPMetricsMiddleware:
    """Counts every response but the probes' by status, and turns an exception that escaped a route into a 500
    envelope (pure ASGI, so streaming and disconnect detection pass through untouched)."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = None

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if status is not None:
                raise  # the response has started: nothing to do but drop the connection
            await error_json(ErrorResponse.make("Internal server error.", 500))(scope, receive, send_and_note)
        finally:
            if status is not None and scope.get("path") not in PROBES:
                self.state.metrics.record_http_response(status)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: ApiError) -> Response:
        return error_json(exc.error)

    async def invalid(_: Request, exc: Exception) -> Response:  # ValueError covers pydantic and ProtocolError
        return error_json(error_response(exc))

    async def unavailable(_: Request, exc: ServiceUnavailableError) -> Response:  # engine dead, request cut
        return error_json(ErrorResponse.make(exc.client_message(), 503, code="service_unavailable"))

    async def engine_internal(_: Request, exc: EngineInternalError) -> Response:  # one request failed alone
        return error_json(ErrorResponse.make(exc.client_message(), 500, code="internal_error"))

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"{exc.detail}: {request.method} {request.url.path}" if exc.status_code in (404, 405) else \
            str(exc.detail)
        return error_json(ErrorResponse.make(message, exc.status_code))

    async def client_gone(_: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    async def internal(_: Request, exc: Exception) -> Response:
        return error_json(ErrorResponse.make("Internal server error.", 500))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(ValueError, invalid)
    app.add_exception_handler(ServiceUnavailableError, unavailable)
    app.add_exception_handler(EngineInternalError, engine_internal)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, internal)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def authorize(state: ServerState, request: Request) -> None:
    key = state.config.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError.make("Invalid or missing API key: send 'Authorization: Bearer <key>'.", 401,
                            code="invalid_api_key")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: at most `limit` bytes (413 beyond), valid UTF-8, valid JSON, else a 400."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DISCARD_LIMIT:
        raise ApiError.make(f"Request body too large: {declared} bytes (the limit is {limit}).", 413,
                            code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > DISCARD_LIMIT:
            break
    if size > limit:
        raise ApiError.make(f"Request body too large: more than {limit} bytes.", 413, code="request_too_large")
    body = b"".join(chunks)
    if not body.strip():
        raise ApiError.make("The request body is empty; expected a JSON object.", 400, code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError.make(f"The request body is not valid UTF-8 (byte {e.start}).", 400,
                            code="invalid_encoding") from None

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise ApiError.make("The request body is nested too deeply.", 400, code="invalid_json") from None
    except ValueError as e:
        raise ApiError.make(f"The request body is not valid JSON: {e}", 400, code="invalid_json") from None


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Runs `work` until done or until the client goes away (then it is cancelled, which aborts its engine
    requests). Listening for http.disconnect works under middleware, unlike request.is_disconnected()."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we are cancelled ourselves (shutdown): take the handler with us
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # we are being cancelled too, not just the handler
            raise
    except Exception as e:  # nobody is listening any more: an error while unwinding is only logged
        logger.debug("error while cancelling a disconnected request: %r", e)
    return Response(status_code=CLIENT_CLOSED)


# ------------------------------------------------------------------------------------------- routes

router = APIRouter()

Handler = Callable[[ServerState, Any, float], Awaitable[Response]]


async def _generate(request: Request, handler: Handler) -> Response:
    arrival = time.monotonic()
    state = server_state(request)
    authorize(state, request)
    state.check_ready()
    body = await read_json(request, state.config.max_body_bytes)
    return await unless_disconnected(request, handler(state, body, arrival))


@router.post("/v1/chat/completions", openapi_extra=body(ChatCompletionRequest), responses=replies(ChatCompletion, True))
async def chat_completions(request: Request) -> Response:
    return await _generate(request, create_chat_completion)


@router.post("/v1/completions", openapi_extra=body(CompletionRequest), responses=replies(Completion, True))
async def completions(request: Request) -> Response:
    return await _generate(request, create_completion)


def _model_card(state: ServerState) -> ModelCard:
    spec = state.engine_config.spec
    return ModelCard(id=state.model_name, root=state.engine_config.model or state.model_name,
                     max_model_len=state.info.max_model_len if state.info else None,
                     speculative_config={"method": "ddtree", "drafter": spec.drafter, "budget": spec.budget,
                                         "draft_model": spec.draft_model} if spec.enabled else None)


@router.get("/v1/models", responses=replies(ModelList))
async def list_models(request: Request) -> Response:
    state = server_state(request)
    authorize(state, request)
    return json_response(ModelList(data=[_model_card(state)]))


@router.get("/v1/models/{model:path}", openapi_extra=path_param("model"), responses=replies(ModelCard))
async def retrieve_model(request: Request) -> Response:
    state = server_state(request)
    authorize(state, request)
    state.check_model(request.path_params["model"])
    return json_response(_model_card(state))


@router.get("/health", responses=replies(None))
async def health(request: Request) -> Response:
    reason = server_state(request).unavailable_reason()
    if reason is not None:
        return error_json(ErrorResponse.make(reason, 503, code="service_unavailable"))
    return JSONResponse({"status": "ok"})


@router.get("/metrics", responses={200: {"description": "Prometheus text exposition",
                                         "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    m = server_state(request).metrics
    return Response(m.render(), headers={"Content-Type": m.content_type})


async def _parse_tool_request(request: Request, model: type):
    state = server_state(request)
    authorize(state, request)
    state.check_ready()
    req = parse_request(model, await read_json(request, state.config.max_body_bytes))
    state.check_model(req.model)
    return state, req


@router.post("/tokenize", openapi_extra=body(TokenizeRequest), responses=replies(TokenizeResponse))
async def tokenize(request: Request) -> Response:
    state, req = await _parse_tool_request(request, TokenizeRequest)
    text = req.prompt
    if req.messages is not None:
        text = render_chat(state.tokenizer, req.messages, add_generation_prompt=req.add_generation_prompt,
                           chat_template_kwargs=req.chat_template_kwargs)
    ids = await state.tokenize(encode_prompt, text, add_special_tokens=req.use_special_tokens,
                               param="messages" if req.messages is not None else "prompt")
    return json_response(TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.info.max_model_len))


@router.post("/detokenize", openapi_extra=body(DetokenizeRequest), responses=replies(DetokenizeResponse))
async def detokenize(request: Request) -> Response:
    state, req = await _parse_tool_request(request, DetokenizeRequest)
    req.check_token_ids(state.info.vocab_size)
    return json_response(DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens)))


# ------------------------------------------------------------------------------------------ factory

def on_engine_failure(state: ServerState, message: str) -> None:
    """The engine died (every open request has its error already, and /health answers 503 from now on):
    reset the scheduler gauges, which would otherwise keep their last values, and, if the engine had been
    serving, tell the runner to exit non-zero so that the orchestrator restarts the server (server/serve.py).
    A failure while loading is reported by the startup path instead."""
    state.metrics.set_scheduler_state(0, 0, 0.0)
    if state.client is not None and state.client.info is not None and state.on_fatal is not None:
        state.on_fatal(f"the engine died: {message}")


def create_app(server_config: ServerConfig, engine_config: EngineConfig) -> FastAPI:
    state = ServerState(server_config, engine_config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await state.start()
        state.client.add_failure_listener(lambda message: on_engine_failure(state, message))
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="ddtree", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(HTTPMetricsMiddleware, state=state)
    install_error_handlers(app)
    app.include_router(router)
    install_openapi(app)
    return app
