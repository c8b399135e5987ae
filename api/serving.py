"""What the completions and chat endpoints share: starting engine requests, following their
output into choices and usage, server-sent events, and aborting when the client goes away.

A call with P prompts and `n` samples runs P engine requests; choice `p * n + i` is sample
`i` of prompt `p` (OpenAI's order). Its P * n engine sequences are admitted (or refused) as
one, when the call arrives (`ServerState.admit`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from api.admission import EngineDeadError, QueueFullError, Reservation
from api.disagg import DisaggRole, check_colocated
from api.engine_loop import EngineLoop, Generation, SampleDelta, StepDelta
from api.errors import SERVER_ERROR, APIError, bad_request, error_body, from_value_error, model_not_found
from api.ignored_fields import note_ignored_fields
from api.limits import DEFAULT_TOKENIZER_POOL_SIZE
from api.logprobs import TokenText
from api.prompt_size import check_prompt_bytes
from api.protocol import invalid_constraint
from api.reasoning import ReasoningParser
from api.tool_parsers import ToolParser
from jaxserve.engine.tokenization import PromptError
from jaxserve.lora.request import LoRARequest
from jaxserve.structured import GrammarError
from scheduler import SamplingParams, SpecDecodingStats
from scheduler.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


@dataclasses.dataclass
class ServerState:
    """What the route handlers need, kept on `app.state.server`."""

    engine_loop: EngineLoop
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    sampling_defaults: dict[str, Any]  # from the model's generation config
    token_text: TokenText
    max_request_sequences: int  # prompts x n of one call
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()  # more names clients may pass as `model` (--served-model-name a b)
    lora_modules: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)  # --lora-modules, by name
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served (api.lora_routes)
    allow_runtime_lora_updating: bool = False
    lora_ids: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))  # for adapters loaded later
    chat_template: str | None = None  # --chat-template: used instead of the tokenizer's
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered
    max_logprobs: int = SamplingParams.MAX_LOGPROBS  # most logprobs/top_logprobs a request may ask for
    log_requests: bool = True  # one log line per generation call
    # usage.prompt_tokens_details (cached_tokens): off by default, as vLLM, since the count tells
    # a caller whether others sent the same prefix (unless their cache_salt differs).
    enable_prompt_tokens_details: bool = False
    disagg: DisaggRole | None = None  # --role prefill|decode: KV handed between servers
    tool_parser: ToolParser | None = None  # --tool-call-parser: reads calls out of the text
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (the default with tools) is served
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser: splits the thinking off
    # Prompt text longer than this many UTF-8 bytes is a 400 before it is tokenized (None: no
    # limit): api.prompt_size.
    max_prompt_bytes: int | None = None
    # Several threads, so that one huge prompt does not hold up the small ones behind it (the
    # Rust tokenizer releases the GIL while it encodes). NOTE: requests share the tokenizer;
    # that is safe because nothing here asks it for truncation or padding, the only encode
    # arguments that make transformers change the Rust tokenizer's state.
    tokenizer_pool: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(DEFAULT_TOKENIZER_POOL_SIZE, thread_name_prefix="tokenizer")
    )

    async def kv_transfer_fields(self, tally: Tally) -> dict:
        """A finished call's `kv_transfer_params` (a prefill server's offer), if it has one."""
        return {} if self.disagg is None else await self.disagg.response_fields(tally.kv_handoff)

    def check_model(self, model: str | None) -> None:
        names = (self.model_name, *self.aliases, *self.lora_modules)
        if model is not None and model not in names:
            raise model_not_found(model)

    def reported_model(self, model: str | None) -> str:
        """The `model` a reply reports: the adapter's name for an adapter, as vLLM, else the served name."""
        return model if model is not None and model in self.lora_modules else self.model_name

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return self.lora_modules.get(model) if model is not None else None

    def truncate_prompt(self, prompt: list[int], keep: int | None, side: str | None = None) -> list[int]:
        """vLLM's truncate_prompt_tokens: `keep` tokens (-1: the context length), the last ones
        or, with truncation_side "right", the first ones."""
        if keep is None:
            return prompt
        if keep > self.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
                f"({self.max_model_len}); please request a smaller truncation size",
                "truncate_prompt_tokens",
            )
        keep = self.max_model_len if keep == -1 else keep
        if len(prompt) <= keep:
            return prompt
        return prompt[:keep] if side == "right" else prompt[-keep:]

    def check_prompt_bytes(self, texts: list[str], param: str, truncating: bool = False) -> None:
        """A 400 naming `param` for prompt text too long to fit the context, before any of it
        is tokenized (api.prompt_size); not when the request asks for it to be cut
        (`truncating`: truncate_prompt_tokens)."""
        if self.max_prompt_bytes is not None and not truncating:
            check_prompt_bytes(texts, self.max_prompt_bytes, self.max_model_len, param)

    def check_request(self, request: Request, body, logprobs: int | None, logprobs_param: str) -> None:
        """What every generation endpoint checks first, in this order: the model name, the
        fields it ignores (a header says which), the body's own constraints, and the logprobs
        asked for (`logprobs` under the endpoint's name for it, then prompt_logprobs)."""
        self.check_model(body.model)
        note_ignored_fields(request, body.warn_ignored())
        body.check()
        self.check_logprobs(logprobs, logprobs_param)
        self.check_logprobs(body.prompt_logprobs, "prompt_logprobs")

    def check_logprobs(self, wanted: int | None, param: str) -> None:
        """--max-logprobs: a 400 naming `param` for more alternatives than the server allows."""
        if wanted is not None and wanted > self.max_logprobs:
            raise bad_request(
                f"{param} ({wanted}) is greater than this server's maximum ({self.max_logprobs}, --max-logprobs)", param
            )

    def admit(self, num_prompts: int, n: int) -> Reservation:
        """On arrival: a 400 for a call that fans out to too many sequences, a 503 at once if
        the queue is full; otherwise the queue room the call holds until it starts (`with`)."""
        wanted = num_prompts * n
        if wanted > self.max_request_sequences:
            raise bad_request(
                f"This request asks for {wanted} sequences ({num_prompts} prompt(s) x n={n}); this server runs at "
                f"most {self.max_request_sequences} per request (--max-request-sequences).",
                "prompt" if num_prompts > self.max_request_sequences else "n",
            )
        try:
            return self.engine_loop.admit(wanted)
        except QueueFullError as e:
            raise APIError(
                503, str(e), type=SERVER_ERROR, code="server_overloaded", headers={"Retry-After": "1"}
            ) from None

    async def off_loop(self, fn: Callable, *args, param: str | None = None, **kwargs):
        """Run tokenizer work (encoding, chat templates) in the tokenizer thread, so a huge
        prompt never stalls the event loop; a PromptError becomes a 400 naming `param`."""
        call = functools.partial(fn, *args, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, call)
        except PromptError as e:
            raise bad_request(str(e), param) from None

    async def structured_outputs(self, body) -> StructuredOutputsParams | None:
        """The request's constraint on the output (None: free text), its grammar compiled.

        The compile runs in the engine's pool while this request waits and others go on; an
        invalid schema, regex or grammar is a 400 naming the field that gave it, and never
        reaches the engine (whose add_request then finds the grammar compiled)."""
        found = body.structured_outputs_spec()
        if found is None:
            return None
        spec, constraint = found
        try:
            await asyncio.wrap_future(self.engine_loop.engine.compile_grammar(spec))
        except GrammarError as e:
            raise invalid_constraint(constraint, e.kind, e.detail) from None
        except ValueError as e:  # the grammar engine cannot read this model's tokenizer (made on the first compile)
            raise bad_request(
                f"{constraint.field}: structured output is not available with this model: {e}", constraint.field
            ) from None
        return spec

    def max_tokens_for(self, num_prompt_tokens: int, max_tokens: int | None, what: str) -> int:
        """The output limit (None: the rest of the context); a 400 if the request cannot fit.

        A limit below 1 passes here and is refused by SamplingParams with its own message.
        """
        limit = self.max_model_len
        wanted = max_tokens if max_tokens is not None else max(1, limit - num_prompt_tokens)
        if num_prompt_tokens + wanted > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the {what}, {wanted} in the "
                f"completion). Please reduce the length of the {what} or completion.",
                what,
                code="context_length_exceeded",
            )
        return wanted


# Clients choose how long a stop list, a logit_bias, allowed_token_ids or a JSON schema is:
# each field of a request's log line shows this many characters at most.
MAX_LOGGED_FIELD_CHARS = 200


def loggable_params(params: SamplingParams) -> str:
    """`params` as its repr would show it, each field cut to MAX_LOGGED_FIELD_CHARS with a
    note of how much was cut (whole, one request's line could run to megabytes)."""
    fields = []
    for field in dataclasses.fields(params):
        if not field.repr:
            continue
        value = repr(getattr(params, field.name))
        if len(value) > MAX_LOGGED_FIELD_CHARS:
            value = f"{value[:MAX_LOGGED_FIELD_CHARS]}...[{len(value) - MAX_LOGGED_FIELD_CHARS} more chars]"
        fields.append(f"{field.name}={value}")
    return f"{type(params).__name__}({', '.join(fields)})"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def start_generation(
    state: ServerState,
    call_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    reservation: Reservation,
    *,
    arrival_time: float,
    priority: int,
    prompt_param: str,
    cache_salt: str | None,
    model: str | None = None,
    param_names: dict[str, str] | None = None,
    kv_transfer_params: dict | None = None,
    stream: bool = False,
) -> tuple[Generation, Tally]:
    """Queue the call's engine requests in the room `reservation` holds, and a Tally to
    follow them; every refusal becomes an APIError (and nothing runs).

    The sampling fields were checked already, so the engine's other ValueErrors are about
    the prompt (`prompt_param`: empty, too long, token ids out of range). With
    `kv_transfer_params` (api.disagg), the prompt's KV is pulled first, or handed over after.
    `model`: the request's, which may name a LoRA adapter (--lora-modules).
    """
    if state.disagg is None:
        check_colocated(kv_transfer_params)
        export_kv, handoff = False, None
    else:
        export_kv, handoff = await state.disagg.prepare(kv_transfer_params, prompts, stream, cache_salt)
    ids = [call_id] if len(prompts) == 1 else [f"{call_id}-{i}" for i in range(len(prompts))]
    if state.log_requests:  # the sizes and settings, never the prompt text
        logger.info(
            "request %s: %s prompt token(s), params %s",
            call_id,
            "+".join(str(len(p)) for p in prompts),
            loggable_params(params),
        )
    generation = state.engine_loop.generation(ids)
    try:
        await generation.add(
            prompts,
            params,
            reservation,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            kv_handoff=handoff,
            export_kv=export_kv,
            lora_request=state.lora_for(model),
        )
    except BaseException as e:
        generation.close()
        if isinstance(e, ValueError):
            raise from_value_error(e, param_names or {}, prompt_param) from None
        if isinstance(e, EngineDeadError):
            raise APIError(503, str(e), type=SERVER_ERROR, code="engine_dead") from None
        raise
    prompt_lens = [len(p) for p in prompts]
    return generation, Tally(generation.request_ids, params.n, prompt_lens, state.enable_prompt_tokens_details)


@dataclasses.dataclass
class Choice:
    """One choice as it stands: what was generated so far, and how it ended."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    text: str = ""  # the engine's final text (set when finished)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # a streamed chunk has been sent for it


class Tally:
    """Follows a call's StepDeltas: per-choice progress and the usage totals (with the prefix
    cache's hits in them when `prompt_tokens_details`)."""

    def __init__(self, request_ids: list[str], n: int, prompt_lens: list[int], prompt_tokens_details: bool):
        self.n = n
        self.prompt_tokens_details = prompt_tokens_details
        self.prompt_index = {rid: p for p, rid in enumerate(request_ids)}
        self.prompt_lens = prompt_lens
        self.choices = [Choice() for _ in range(len(request_ids) * n)]
        self.cached_tokens = dict.fromkeys(request_ids, 0)
        self.prompt_logprobs: list[list | None] = [None] * len(request_ids)  # per prompt, when asked for
        self.kv_handoff = None  # the prompt's KV, when the call asked a prefill server for it
        self.spec_decoding: dict[str, SpecDecodingStats] = {}  # per request that verified drafts

    def update(self, delta: StepDelta) -> list[tuple[int, SampleDelta]]:
        """Record one delta; returns (choice index, sample delta) for each sample that changed."""
        self.cached_tokens[delta.request_id] = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[self.prompt_index[delta.request_id]] = delta.prompt_logprobs
        if delta.kv_handoff is not None:
            self.kv_handoff = delta.kv_handoff
        if delta.spec_decoding is not None:
            self.spec_decoding[delta.request_id] = delta.spec_decoding
        changed = []
        for sample in delta.samples:
            index = self.prompt_index[delta.request_id] * self.n + sample.index
            choice = self.choices[index]
            choice.token_ids += sample.new_token_ids
            if sample.new_logprobs:
                choice.logprobs += sample.new_logprobs
            if sample.finish_reason is not None:
                choice.text, choice.finish_reason, choice.stop_reason = (
                    sample.text,
                    sample.finish_reason,
                    sample.stop_reason,
                )
            changed.append((index, sample))
        return changed

    def choice_usage(self, index: int) -> dict:
        """One choice's usage so far (vLLM's continuous_usage_stats): its prompt and its tokens."""
        prompt, completion = self.prompt_lens[index // self.n], len(self.choices[index].token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": None,  # the cache's hits: in the last usage chunk
        }

    def usage(self) -> dict:
        prompt = sum(self.prompt_lens)
        completion = sum(len(c.token_ids) for c in self.choices)
        details = {"cached_tokens": sum(self.cached_tokens.values())} if self.prompt_tokens_details else None
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": details,
        }
        if self.spec_decoding:  # jaxserve's: the call's verified drafts (vLLM's metric names)
            drafts = SpecDecodingStats.total(list(self.spec_decoding.values()))
            usage["speculative_decoding"] = {
                "num_drafts": drafts.num_drafts,
                "num_draft_tokens": drafts.num_draft_tokens,
                "num_accepted_tokens": drafts.num_accepted_tokens,
                "num_accepted_tokens_per_pos": drafts.accepted_per_position,
            }
        return usage


async def stream_events(
    generation: Generation,
    tally: Tally,
    header: dict,
    body,
    chunk_choice: Callable[[int, SampleDelta], dict | None],
    opening: list[dict] = (),
    opening_fields: dict | None = None,
) -> AsyncIterator[str]:
    """The body of a streamed call: the `opening` choices (their chunks with `opening_fields`
    too), then one chunk per sample that changed (`chunk_choice(index, sample)` is its choice,
    or None for nothing to send), the usage chunk if `body` asks for it, and [DONE]. With
    continuous usage stats each chunk carries its choice's usage so far, else usage is null.
    An error on the way becomes an error event."""
    include_usage, continuous = body.include_usage, body.continuous_usage

    def usage_field(index: int) -> dict:
        if not include_usage:
            return {}
        return {"usage": tally.choice_usage(index) if continuous else None}

    try:
        for choice in opening:
            yield sse({**header, "choices": [choice], **(opening_fields or {}), **usage_field(choice["index"])})
        async for delta in generation:
            for index, sample in tally.update(delta):
                choice = chunk_choice(index, sample)
                if choice is not None:
                    yield sse({**header, "choices": [choice], **usage_field(index)})
        if include_usage:
            yield sse({**header, "choices": [], "usage": tally.usage()})
    except Exception as e:
        yield sse_error(e)
    yield SSE_DONE


async def collect(generation: Generation, tally: Tally) -> Tally:
    try:
        async with generation:
            async for delta in generation:
                tally.update(delta)
    except EngineDeadError as e:
        raise APIError(500, str(e), type=SERVER_ERROR, code="engine_dead") from None
    return tally


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, but cancel it if the client disconnects first (then None).

    Cancelling a `collect` leaves its `async with generation`, which aborts the engine
    requests, so a client that gives up on a long non-streamed call frees its blocks.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    logger.info("client disconnected from %s; request aborted", request.url.path)
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A `text/event-stream` response that calls `on_close` however it ends.

    Starlette cancels the body when the client disconnects; this makes sure the engine
    requests are aborted then (and after errors), not only when the stream runs to its end.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(error: BaseException) -> str:
    """An error after the 200 header went out: OpenAI clients raise it from the stream."""
    if isinstance(error, APIError):
        return sse(error.body())
    if isinstance(error, EngineDeadError):  # its engine failed mid-stream
        return sse(error_body(str(error), SERVER_ERROR, code="engine_dead"))
    logger.error("stream failed: %r", error)
    return sse(error_body(f"{type(error).__name__}: {error}", SERVER_ERROR, code="internal_error"))


def disconnected_response() -> Response:
    # Nobody reads it; 499 is nginx's "client closed request", which shows in access logs.
    return Response(status_code=499)
