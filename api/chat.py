"""POST /v1/chat/completions: messages through the model's chat template, replies out."""

from __future__ import annotations

import dataclasses
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api import openapi
from api.chat_reply import ReplyParser, ReplyStream, merge_deltas
from api.engine_loop import Generation, SampleDelta
from api.errors import bad_request
from api.logprobs import chat_logprobs, vllm_prompt_logprobs
from api.protocol import ChatCompletionRequest, ChatMessage, ChatTemplateFields
from api.reasoning import ReasoningParser
from api.serving import (
    EventStream,
    ServerState,
    Tally,
    collect,
    disconnected_response,
    new_id,
    start_generation,
    stream_events,
    unless_disconnected,
)
from jaxserve.engine.tokenization import encode_chat
from scheduler import SamplingParams

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    response_class=JSONResponse,
    responses=openapi.generation(openapi.ChatCompletion, openapi.ChatCompletionChunk),
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    arrival = time.monotonic()
    state: ServerState = request.app.state.server
    state.check_request(request, body, body.top_logprobs if body.logprobs else None, "top_logprobs")
    run = await start_chat(state, body, new_id("chatcmpl"), arrival)
    tally = run.tally
    top_logprobs = body.top_logprobs or 0
    header = {
        "id": run.call_id,
        "object": "chat.completion",
        "created": run.created,
        "model": state.reported_model(body.model),
        "system_fingerprint": None,
    }

    if body.stream:
        chunk_header = {**header, "object": "chat.completion.chunk"}
        streams = [run.reply.stream() for _ in tally.choices]
        opening = [
            {"index": index, "logprobs": None, "finish_reason": None, "delta": stream.opening()}
            for index, stream in enumerate(streams)
        ]
        events = stream_events(
            run.generation,
            tally,
            chunk_header,
            body,
            _chunk_choice(body, state, top_logprobs, streams),
            opening,
            {"prompt_token_ids": run.prompt} if body.return_token_ids else None,  # vLLM's: with each role chunk
        )
        return EventStream(events, on_close=run.generation.close)
    if await unless_disconnected(request, collect(run.generation, tally)) is None:
        return disconnected_response()
    choices = []
    for index, choice in enumerate(tally.choices):
        logprobs = None
        if body.logprobs:
            logprobs = {
                "content": chat_logprobs(choice.token_ids, choice.logprobs, state.token_text, top_logprobs),
                "refusal": None,
            }
        message, finish_reason = run.reply.message(choice.text, choice.finish_reason)
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": choice.stop_reason,
                **({"token_ids": choice.token_ids} if body.return_token_ids else {}),
            }
        )
    prompt_logprobs = vllm_prompt_logprobs(
        run.prompt, tally.prompt_logprobs[0], body.prompt_logprobs or 0, state.token_text
    )  # vLLM's: beside the choices
    return JSONResponse(
        {
            **header,
            "choices": choices,
            "usage": tally.usage(),
            "prompt_logprobs": prompt_logprobs,
            **({"prompt_token_ids": run.prompt} if body.return_token_ids else {}),
            **(await state.kv_transfer_fields(tally)),
        }
    )


@dataclasses.dataclass
class ChatRun:
    """A chat request under way in the engine, and how its output becomes the reply."""

    call_id: str
    created: int
    prompt: list[int]
    generation: Generation
    tally: Tally
    reply: ReplyParser


async def start_chat(state: ServerState, body: ChatCompletionRequest, call_id: str, arrival: float) -> ChatRun:
    """Render, admit and start a checked chat request (chat completions and /v1/responses)."""
    check_template(state, body)
    reply = reply_parser(state, body)
    structured_outputs = await state.structured_outputs(body)  # "required" or a named tool: the tools' schemas
    with state.admit(1, body.n) as reservation:  # a 503 comes now, before the template renders
        prompt = await chat_prompt(state, body)
        requested, max_param = body.requested_max_tokens
        max_tokens = state.max_tokens_for(len(prompt), requested, "messages")
        names = {"max_tokens": max_param, "logprobs": "top_logprobs"}
        params = body.sampling_params(
            max_tokens,
            (body.top_logprobs or 0) if body.logprobs else None,
            names,
            state.sampling_defaults,
            structured_outputs,
        )
        params = with_reasoning(params, body, reply.reasoning_parser, prompt)
        if reply.tool_parser is not None and not reply.tool_parser.skip_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)  # its call markers are special tokens
        created = int(time.time())
        generation, tally = await start_generation(
            state,
            call_id,
            [prompt],
            params,
            reservation,
            arrival_time=arrival,
            priority=body.priority,
            param_names=names,
            prompt_param="messages",
            cache_salt=body.cache_salt,
            model=body.model,
            kv_transfer_params=body.kv_transfer_params,
            stream=body.stream,
        )
    return ChatRun(call_id, created, prompt, generation, tally, reply)


def reply_parser(state: ServerState, body: ChatCompletionRequest) -> ReplyParser:
    """How this request's output becomes the reply; a 400 for tool_choice "auto" on a server
    that cannot read calls out of text."""
    mode = body.tool_mode
    if mode == "auto" and not (state.enable_auto_tool_choice and state.tool_parser is not None):
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice"
        )
    named = body.called_tool()
    reasoning = state.reasoning_parser
    return ReplyParser(
        tool_mode=mode,
        tool_parser=state.tool_parser if mode == "auto" else None,
        named_tool=named.function.name if named is not None else None,
        # Per request: Qwen3's enable_thinking false means no thinking to split off.
        reasoning_parser=reasoning.for_request(body.chat_template_kwargs) if reasoning else None,
        include_reasoning=body.include_reasoning,
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )


def thinking_open(parser: ReasoningParser | None, prompt: list[int]) -> bool:
    """Whether the reply starts inside a thinking that ends with the parser's end token: a
    reasoning parser whose end is one token, and a prompt that has not closed the thinking
    already (Qwen3 with enable_thinking false renders an empty one)."""
    if parser is None or parser.end_token_id is None or not parser.starts_in_reasoning():
        return False
    for token in reversed(prompt):  # the prompt's last thinking marker
        if token == parser.end_token_id:
            return False
        if token == parser.start_token_id:
            break
    return True


def with_reasoning(params: SamplingParams, body: ChatCompletionRequest, parser: ReasoningParser | None, prompt):
    """`params` as the thinking asks (as vLLM): a constraint holds the answer only, from the
    end of the thinking on, and thinking_token_budget forces that end after so many tokens."""
    budget = body.thinking_token_budget
    if budget is not None and (parser is None or parser.end_token_id is None):
        raise bad_request(
            "thinking_token_budget needs a --reasoning-parser whose end of thinking is one token of this "
            "model's vocabulary",
            "thinking_token_budget",
        )
    if not thinking_open(parser, prompt):
        return params  # no thinking to hold back or to cut short
    changes = {}
    if params.structured_outputs is not None:
        changes["structured_outputs"] = dataclasses.replace(
            params.structured_outputs, after_token_id=parser.end_token_id
        )
    if budget is not None:
        changes.update(thinking_token_budget=budget, thinking_end_token_id=parser.end_token_id)
    return dataclasses.replace(params, **changes)


def check_template(state: ServerState, body: ChatTemplateFields) -> None:
    """A 400 unless `body`'s messages can be rendered: a template, and a trusted one."""
    own = body.chat_template
    if own is not None and not state.trust_request_chat_template:
        raise bad_request(
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template.",
            "chat_template",
        )
    if state.tokenizer is None or not (own or state.chat_template or getattr(state.tokenizer, "chat_template", None)):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")


async def chat_prompt(state: ServerState, body: ChatTemplateFields) -> list[int]:
    """The token ids of `body`'s messages rendered by the chat template (in the tokenizer
    thread), truncated as it asks (chat completions and /tokenize)."""
    truncating = getattr(body, "truncate_prompt_tokens", None) is not None
    state.check_prompt_bytes(message_texts(body.messages), "messages", truncating)
    add_special = body.add_special_tokens if body.add_special_tokens is not None else False
    kwargs = body.template_kwargs()
    if state.chat_template and "chat_template" not in kwargs:
        kwargs["chat_template"] = state.chat_template
    _, prompt = await state.off_loop(
        encode_chat,
        state.tokenizer,
        body.template_messages(),
        state.vocab_size,
        add_special_tokens=add_special,
        param="messages",
        **kwargs,
    )
    return state.truncate_prompt(
        prompt, getattr(body, "truncate_prompt_tokens", None), getattr(body, "truncation_side", None)
    )


def message_texts(messages: list[ChatMessage]) -> list[str]:
    """The text of each message's content (what the byte limit counts; the template adds little)."""
    texts = []
    for message in messages:
        if isinstance(message.content, str):
            texts.append(message.content)
        elif isinstance(message.content, list):
            texts += [part["text"] for part in message.content if isinstance(part.get("text"), str)]
    return texts


def _chunk_choice(body: ChatCompletionRequest, state: ServerState, top_logprobs: int, streams: list[ReplyStream]):
    def choice(index: int, sample: SampleDelta) -> dict | None:
        logprobs = None
        if body.logprobs and sample.new_token_ids:
            logprobs = {
                "content": chat_logprobs(sample.new_token_ids, sample.new_logprobs, state.token_text, top_logprobs),
                "refusal": None,
            }
        token_ids = {"token_ids": sample.new_token_ids} if body.return_token_ids else {}
        delta = streams[index].feed(sample.new_text) if sample.new_text else {}
        finish_reason = sample.finish_reason
        if finish_reason is not None:
            last, finish_reason = streams[index].finish(finish_reason)
            delta = merge_deltas(delta, last)
        if not (delta or logprobs or finish_reason or (token_ids and sample.new_token_ids)):
            # Held back: a partial character, or text that may open a tool call; with
            # return_token_ids the token's id still goes out, as vLLM sends every token's.
            return None
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": sample.stop_reason,
            **token_ids,
        }

    return choice
