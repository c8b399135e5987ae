"""POST /v1/chat/completions: messages through the model's chat template, replies out."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api import openapi
from api.engine_loop import SampleDelta
from api.errors import bad_request
from api.logprobs import chat_logprobs, vllm_prompt_logprobs
from api.protocol import ChatCompletionRequest, ChatMessage, ChatTemplateFields
from api.serving import (
    EventStream,
    ServerState,
    collect,
    disconnected_response,
    new_id,
    start_generation,
    stream_events,
    unless_disconnected,
)
from jaxserve.engine.tokenization import encode_chat

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
    check_template(state, body)
    structured_outputs = await state.structured_outputs(body)  # a named tool's arguments: its schema
    tool = body.called_tool()
    with state.admit(1, body.n) as reservation:  # a 503 comes now, before the template renders
        prompt = await chat_prompt(state, body)
        requested, max_param = body.requested_max_tokens
        max_tokens = state.max_tokens_for(len(prompt), requested, "messages")
        top_logprobs = body.top_logprobs or 0
        names = {"max_tokens": max_param, "logprobs": "top_logprobs"}
        params = body.sampling_params(
            max_tokens, top_logprobs if body.logprobs else None, names, state.sampling_defaults, structured_outputs
        )
        call_id, created = new_id("chatcmpl"), int(time.time())
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
            kv_transfer_params=body.kv_transfer_params,
            stream=body.stream,
        )
    header = {
        "id": call_id,
        "object": "chat.completion",
        "created": created,
        "model": state.model_name,
        "system_fingerprint": None,
    }

    if body.stream:
        chunk_header = {**header, "object": "chat.completion.chunk"}
        # OpenAI's first chunk of each choice carries the role and empty content.
        # A named tool's call opens with its id and name; its arguments follow as they come.
        tool_calls = [tool_call(tool.function.name) for _ in tally.choices] if tool else None
        opening = [
            {
                "index": index,
                "logprobs": None,
                "finish_reason": None,
                "delta": {"role": "assistant", "content": ""}
                if tool is None
                else {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **tool_calls[index]}]},
            }
            for index in range(len(tally.choices))
        ]
        events = stream_events(
            generation,
            tally,
            chunk_header,
            body,
            _chunk_choice(body, state, top_logprobs, tool is not None),
            opening,
            {"prompt_token_ids": prompt} if body.return_token_ids else None,  # vLLM's: with each role chunk
        )
        return EventStream(events, on_close=generation.close)
    if await unless_disconnected(request, collect(generation, tally)) is None:
        return disconnected_response()
    choices = []
    for index, choice in enumerate(tally.choices):
        logprobs = None
        if body.logprobs:
            logprobs = {
                "content": chat_logprobs(choice.token_ids, choice.logprobs, state.token_text, top_logprobs),
                "refusal": None,
            }
        message = {"role": "assistant", "content": choice.text}
        if tool is not None:  # as vLLM: the text is the arguments of a call to the named function
            call = tool_call(tool.function.name)
            call["function"]["arguments"] = choice.text
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
                **({"token_ids": choice.token_ids} if body.return_token_ids else {}),
            }
        )
    prompt_logprobs = vllm_prompt_logprobs(
        prompt, tally.prompt_logprobs[0], body.prompt_logprobs or 0, state.token_text
    )  # vLLM's: beside the choices
    return JSONResponse(
        {
            **header,
            "choices": choices,
            "usage": tally.usage(),
            "prompt_logprobs": prompt_logprobs,
            **({"prompt_token_ids": prompt} if body.return_token_ids else {}),
            **state.kv_transfer_fields(tally),
        }
    )


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
    state.check_prompt_bytes(message_texts(body.messages), "messages")
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


def tool_call(name: str) -> dict:
    """A call of the function `name`, its arguments still empty."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function", "function": {"name": name, "arguments": ""}}


def _chunk_choice(body: ChatCompletionRequest, state: ServerState, top_logprobs: int, tool_call_arguments: bool):
    def choice(index: int, sample: SampleDelta) -> dict | None:
        logprobs = None
        if body.logprobs and sample.new_token_ids:
            logprobs = {
                "content": chat_logprobs(sample.new_token_ids, sample.new_logprobs, state.token_text, top_logprobs),
                "refusal": None,
            }
        token_ids = {"token_ids": sample.new_token_ids} if body.return_token_ids else {}
        if not (sample.new_text or logprobs or sample.finish_reason or (token_ids and sample.new_token_ids)):
            # The detokenizer held this token's text back (a partial character); with
            # return_token_ids its id still goes out, as vLLM sends every token's.
            return None
        delta = {}
        if sample.new_text:
            delta = (
                {"tool_calls": [{"index": 0, "function": {"arguments": sample.new_text}}]}
                if tool_call_arguments
                else {"content": sample.new_text}
            )
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
            **token_ids,
        }

    return choice
