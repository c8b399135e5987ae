"""The FastAPI app: OpenAI-compatible routes over an `LLMEngine` running in its own thread.

    app = create_app(LLMEngine.from_model(), api_key="secret", max_waiting=64)
    uvicorn.run(app)            # or: python -m api

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}], vLLM's
POST /tokenize, POST /detokenize and GET /version (api.tokenize_routes), vLLM's
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (api.lora_routes, when allowed),
GET /health (200 while the engine thread is alive, 503 after it failed), GET /metrics
(Prometheus text), GET /openapi.json (their schema: api.openapi). With an API key, every /v1
request needs `Authorization: Bearer <key>`, checked before its body is read; the routes outside
/v1 stay open, as in vLLM: /health and /metrics, so probes and scrapers need no secret, and
/tokenize, /detokenize and /version.

Limits on what one request may ask: a body of at most `max_request_body_bytes` (413), at
most `max_request_sequences` prompts x n (400), and, with `max_waiting`, a 503 on arrival
when the queue is full.

Data parallelism (`python -m api --data-parallel-size M`) runs M such servers, one process
each, behind a router (api.replica_processes, api.router).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from api import chat, completions, lora_routes, openapi, responses, router_compat, tokenize_routes
from api.disagg import DisaggRole
from api.disagg import router as disagg_routes
from api.engine_loop import EngineLoop
from api.errors import SERVER_ERROR, APIError, error_body, install_error_handlers
from api.ignored_fields import IgnoredFieldsHeader
from api.limits import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_REQUEST_SEQUENCES,
    DEFAULT_TOKENIZER_POOL_SIZE,
    BodySizeLimit,
)
from api.logprobs import TokenText
from api.metrics import Metrics
from api.prompt_size import max_prompt_bytes
from api.reasoning import get_reasoning_parser
from api.serving import ServerState
from api.stats_log import log_stats
from api.tool_parsers import TOOL_PARSERS, get_tool_parser, parser_for_template
from jaxserve.lora.request import LoRARequest
from scheduler import SamplingParams

logger = logging.getLogger(__name__)
DEFAULT_ENGINE_STEP_TIMEOUT = 120.0  # seconds; steps are compiled at warm-up, so a step this long is a hang


def default_model_name(engine) -> str:
    """The name clients pass as `model`: the GGUF file's or the model folder's name."""
    source = Path(engine.loaded.source)
    name = source.stem if source.is_file() else source.name
    return name.split(".")[0] if source.suffix == ".gguf" else name  # "X.Q4_1.gguf" -> "X"


def create_app(
    engine,
    *,
    model_name: str | Sequence[str] | None = None,
    lora_modules: Sequence[LoRARequest] = (),
    allow_runtime_lora_updating: bool = False,
    api_key: str | None = None,
    max_waiting: int | None = None,
    max_request_sequences: int = DEFAULT_MAX_REQUEST_SEQUENCES,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
    max_logprobs: int = SamplingParams.MAX_LOGPROBS,
    log_requests: bool = True,
    enable_prompt_tokens_details: bool = False,
    tokenizer_pool_size: int = DEFAULT_TOKENIZER_POOL_SIZE,
    cors: dict | None = None,
    disagg: DisaggRole | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    engine_step_timeout: float | None = DEFAULT_ENGINE_STEP_TIMEOUT,
    stats_interval: float = 0.0,
) -> FastAPI:
    """An app serving `engine` (an LLMEngine); its engine thread starts with the app's lifespan.

    `model_name`: the name clients pass as `model`, or several (the first is the one
    responses report); `lora_modules`: LoRA adapters a request's `model` may name instead (the
    engine needs enable_lora; each is read and checked now, a ValueError if it cannot be served);
    `allow_runtime_lora_updating`: serve /v1/load_lora_adapter and /v1/unload_lora_adapter;
    `chat_template` replaces the tokenizer's; `enable_prompt_tokens_details`:
    report usage.prompt_tokens_details.cached_tokens (the prefix cache's hits); `cors`: CORSMiddleware's
    arguments (allow_origins, ...), None for no CORS headers;
    `disagg`: the server's part in prefill/decode disaggregation (api.disagg);
    `enable_auto_tool_choice`: serve tool_choice "auto" with the `tool_call_parser` (by default
    the one the chat template implies); `reasoning_parser`: split the thinking off replies;
    `engine_step_timeout`: /health turns 503 while one engine step has run longer (a hung
    engine, so that a router in front takes this server out of rotation), None: never;
    `stats_interval`: log a stats line this often, in seconds (api.stats_log), 0: never.
    """
    if max_request_sequences < 1:
        raise ValueError(f"max_request_sequences must be >= 1, got {max_request_sequences}")
    if tokenizer_pool_size < 1:
        raise ValueError(f"tokenizer_pool_size must be >= 1, got {tokenizer_pool_size}")
    if not 0 <= max_logprobs <= SamplingParams.MAX_LOGPROBS:  # the sampler computes that many at most
        raise ValueError(f"max_logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}], got {max_logprobs}")
    if chat_template is not None and engine.tokenizer is None:
        raise ValueError("a chat template needs a tokenizer; this model has none (see --tokenizer)")
    tools, reasoning = _reply_parsers(
        engine.tokenizer, chat_template, enable_auto_tool_choice, tool_call_parser, reasoning_parser
    )
    names = [model_name] if isinstance(model_name, str) else list(model_name or ())
    model_name, aliases = (names[0], tuple(names[1:])) if names else (default_model_name(engine), ())
    if allow_runtime_lora_updating and engine.loras is None:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    for lora in lora_modules:
        if lora.lora_name == model_name or lora.lora_name in aliases:
            raise ValueError(f"the LoRA adapter name {lora.lora_name!r} is already the model's name")
        engine.register_lora(lora)
    metrics = Metrics(model_name, engine.cache_config_info(), device_bytes=engine.device_bytes())
    engine_loop = EngineLoop(engine, metrics, max_waiting=max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        if engine.tokenizer is not None:  # structured output needs one
            engine.grammars.prepare()  # in the background: the first structured request need not wait for it
        stats = asyncio.create_task(log_stats(engine_loop, stats_interval)) if stats_interval > 0 else None
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            engine_loop.stop()

    app = FastAPI(title="jaxserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = ServerState(
        engine_loop,
        engine.tokenizer,
        model_name,
        engine.max_model_len,
        engine.loaded.config.vocab_size,
        engine.generation.sampling,
        TokenText(engine.tokenizer),
        max_request_sequences,
        aliases=aliases,
        lora_modules={lora.lora_name: lora for lora in lora_modules},
        allow_runtime_lora_updating=allow_runtime_lora_updating,
        lora_ids=itertools.count(max((lora.lora_int_id for lora in lora_modules), default=0) + 1),
        chat_template=chat_template,
        trust_request_chat_template=trust_request_chat_template,
        max_logprobs=max_logprobs,
        log_requests=log_requests,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        disagg=disagg,
        max_prompt_bytes=max_prompt_bytes(engine.tokenizer, engine.max_model_len),
        tokenizer_pool=ThreadPoolExecutor(tokenizer_pool_size, thread_name_prefix="tokenizer"),
        tool_parser=tools,
        enable_auto_tool_choice=enable_auto_tool_choice,
        reasoning_parser=reasoning,
    )
    install_error_handlers(app)
    openapi.install_openapi(
        app,
        vocab_size=engine.loaded.config.vocab_size,
        max_model_len=engine.max_model_len,
        api_key=bool(api_key),
        trust_request_chat_template=trust_request_chat_template,
    )
    app.add_middleware(IgnoredFieldsHeader)
    # Added late, so outside: an oversized body is refused before anything else reads it.
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    if api_key:  # outside the body limit, which reads the body: a request without the key is refused unread
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if cors is not None:  # outermost, so that refusals (401, 413) carry CORS headers a browser can read
        app.add_middleware(CORSMiddleware, **cors)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses.router)
    app.state.responses = responses.ResponseStore()  # for previous_response_id
    app.include_router(tokenize_routes.router)
    app.include_router(lora_routes.router)
    if disagg is not None:  # offers are bound to the name clients use; decode servers claim them here
        disagg.model_name = model_name
        app.include_router(disagg_routes)

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "The engine thread is alive and not stuck in a step (an empty body)."},
            **openapi.errors(503),
        },
    )
    async def health():
        if not engine_loop.is_alive:
            body = error_body(str(engine_loop.dead_error()), SERVER_ERROR, code="engine_dead")
            return JSONResponse(body, status_code=503)
        stalled = engine_loop.stalled_for()
        if engine_step_timeout is not None and stalled > engine_step_timeout:
            message = f"the engine has been in one step for {stalled:.1f} s (more than {engine_step_timeout:g} s)"
            return JSONResponse(error_body(message, SERVER_ERROR, code="engine_stalled"), status_code=503)
        return Response(status_code=200)

    @app.get(
        "/metrics",
        response_class=openapi.PrometheusResponse,
        responses={200: {"description": "Prometheus text exposition format."}},
    )
    async def metrics():
        return openapi.PrometheusResponse(router_compat.with_vllm_names(metrics_page()))

    def metrics_page() -> str:
        page = engine_loop.metrics.render(engine_loop.stats)
        return page + (disagg.render_metrics() if disagg is not None else "")

    router_compat.install(app, metrics_page)  # the routes vllm-router and sglang-router probe

    @app.get("/v1/models", responses={200: {"model": openapi.ModelList}})
    async def list_models(request: Request):
        state: ServerState = request.app.state.server
        cards = [_model_card(state, name) for name in (state.model_name, *state.aliases, *state.lora_modules)]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model:path}", responses={200: {"model": openapi.ModelCard}, **openapi.errors(404)})
    async def retrieve_model(model: str, request: Request):
        state: ServerState = request.app.state.server
        state.check_model(model)
        return _model_card(state, model)

    return app


def _reply_parsers(tokenizer, chat_template, enable_auto_tool_choice, tool_call_parser, reasoning_parser):
    """The server's tool-call and reasoning parsers (None where not asked for); a ValueError
    for an unknown name, or auto tool choice with no parser named or implied by the template."""
    if enable_auto_tool_choice and tool_call_parser is None:
        template = chat_template or getattr(tokenizer, "chat_template", None)
        tool_call_parser = parser_for_template(template if isinstance(template, str) else None)
        if tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser: this model's chat template does not show "
                f"which format its tool calls take (one of {', '.join(sorted(TOOL_PARSERS))})"
            )
        logger.info("tool calls: the %s parser (the chat template's format)", tool_call_parser)
    tools = get_tool_parser(tool_call_parser)(tokenizer) if tool_call_parser else None
    reasoning = get_reasoning_parser(reasoning_parser)(tokenizer) if reasoning_parser else None
    return tools, reasoning


def _model_card(state: ServerState, name: str) -> dict:
    card = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "jaxserve",
        "max_model_len": state.max_model_len,
    }
    lora = state.lora_modules.get(name)
    if lora is not None:  # vLLM's card of an adapter: its folder as root, the base model as parent
        card.update(root=lora.lora_path, parent=state.model_name)
    return card


class APIKeyMiddleware:
    """Refuses /v1 requests without `Authorization: Bearer <api_key>` from the headers alone,
    before anything reads the body (a pure ASGI middleware, so streamed responses pass through
    untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _route_path(scope).startswith("/v1") and scope["method"] != "OPTIONS":
            error = self._check(dict(scope["headers"]).get(b"authorization", b""))
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, header: bytes) -> APIError | None:
        scheme, _, token = header.partition(b" ")
        if not header:
            message = (
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        elif scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            message = "Incorrect API key provided."
        else:
            return None
        return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _route_path(scope) -> str:
    """The path the routes see: uvicorn puts --root-path in front of the request's path."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path
