"""POST /v1/completions: text (or token-id) prompts in, completions out, streamed or not."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api import openapi
from api.engine_loop import SampleDelta
from api.logprobs import completion_logprobs, echo_entries, vllm_prompt_logprobs
from api.protocol import CompletionRequest
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
from jaxserve.engine.tokenization import encode_prompt

router = APIRouter()


@router.post(
    "/v1/completions",
    response_class=JSONResponse,
    responses=openapi.generation(openapi.Completion, openapi.CompletionChunk),
)
async def create_completion(body: CompletionRequest, request: Request):
    arrival = time.monotonic()
    state: ServerState = request.app.state.server
    state.check_request(request, body, body.logprobs, "logprobs")
    requested = body.prompts()
    texts = [p for p in requested if isinstance(p, str)]
    state.check_prompt_bytes(texts, "prompt", truncating=body.truncate_prompt_tokens is not None)
    structured_outputs = await state.structured_outputs(body)
    with state.admit(len(requested), body.n) as reservation:  # a 503 comes now, before any tokenizing
        add_special = body.add_special_tokens if body.add_special_tokens is not None else True
        prompts, prompt_texts = await state.off_loop(
            _encode_prompts,
            state,
            requested,
            add_special,
            body.echo,
            body.truncate_prompt_tokens,
            body.truncation_side,
            param="prompt",
        )
        max_tokens = min(state.max_tokens_for(len(p), body.max_tokens, "prompt") for p in prompts)
        params = body.sampling_params(max_tokens, body.logprobs, {}, state.sampling_defaults, structured_outputs)
        call_id, created = new_id("cmpl"), int(time.time())
        generation, tally = await start_generation(
            state,
            call_id,
            prompts,
            params,
            reservation,
            arrival_time=arrival,
            priority=body.priority,
            prompt_param="prompt",
            cache_salt=body.cache_salt,
            model=body.model,
            kv_transfer_params=body.kv_transfer_params,
            stream=body.stream,
        )
    echo = prompt_texts if body.echo else None
    header = {"id": call_id, "object": "text_completion", "created": created, "model": state.reported_model(body.model)}

    if body.stream:
        events = stream_events(generation, tally, header, body, _chunk_choice(tally, body, state, echo, prompts))
        return EventStream(events, on_close=generation.close)
    if await unless_disconnected(request, collect(generation, tally)) is None:
        return disconnected_response()
    choices = []
    prompt_k = body.prompt_logprobs if body.prompt_logprobs is not None else body.logprobs
    for index, choice in enumerate(tally.choices):
        prompt, prompt_logprobs = prompts[index // body.n], tally.prompt_logprobs[index // body.n]
        logprobs = None
        if body.logprobs is not None:
            token_ids, entries = choice.token_ids, choice.logprobs
            if echo:  # the prompt's tokens first, as vLLM
                token_ids = prompt + token_ids
                entries = echo_entries(prompt, prompt_logprobs, body.logprobs) + entries
            logprobs = completion_logprobs(token_ids, entries, state.token_text, 0)
        choices.append(
            {
                "index": index,
                "text": (echo[index // body.n] if echo else "") + choice.text,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
                "prompt_logprobs": vllm_prompt_logprobs(prompt, prompt_logprobs, prompt_k, state.token_text),
                # vLLM's, per choice here (a call may have several prompts).
                **({"prompt_token_ids": prompt, "token_ids": choice.token_ids} if body.return_token_ids else {}),
            }
        )
    return JSONResponse(
        {**header, "choices": choices, "usage": tally.usage(), **(await state.kv_transfer_fields(tally))}
    )


def _encode_prompts(
    state: ServerState,
    prompts: list[str | list[int]],
    add_special_tokens: bool,
    echo: bool,
    truncate_prompt_tokens: int | None,
    truncation_side: str | None,
) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt as truncated, and their text for `echo` (runs in the tokenizer
    thread). Echo shows what the model saw: a truncated prompt's kept tokens, not the text sent."""
    ids, texts = [], []
    for prompt in prompts:
        encoded = encode_prompt(state.tokenizer, prompt, state.vocab_size, add_special_tokens=add_special_tokens)
        kept = state.truncate_prompt(encoded, truncate_prompt_tokens, truncation_side)
        ids.append(kept)
        if isinstance(prompt, str) and len(kept) == len(encoded):
            texts.append(prompt)
        else:
            texts.append(state.tokenizer.decode(kept) if echo and state.tokenizer else "")
    return ids, texts


def _chunk_choice(
    tally: Tally, body: CompletionRequest, state: ServerState, echo: list[str] | None, prompts: list[list[int]]
):
    offsets = [0] * len(tally.choices)  # logprobs text_offset, continued across chunks

    def choice(index: int, sample: SampleDelta) -> dict | None:
        text = sample.new_text
        echoing = echo and not tally.choices[index].started
        if echoing:
            text = echo[index // body.n] + text
        logprobs = None
        if body.logprobs is not None and sample.new_token_ids:
            token_ids, entries = sample.new_token_ids, sample.new_logprobs
            if echoing:  # the prompt's tokens lead the first chunk
                prompt = prompts[index // body.n]
                token_ids = prompt + token_ids
                entries = echo_entries(prompt, tally.prompt_logprobs[index // body.n], body.logprobs) + entries
            logprobs = completion_logprobs(token_ids, entries, state.token_text, offsets[index])
            offsets[index] += sum(len(t) for t in logprobs["tokens"])
        token_ids = {}
        if body.return_token_ids:  # as vLLM: the prompt's ids with the choice's first chunk, then each chunk's
            first = {} if tally.choices[index].started else {"prompt_token_ids": prompts[index // body.n]}
            token_ids = {**first, "token_ids": sample.new_token_ids}
        if not (text or logprobs or sample.finish_reason or (token_ids and sample.new_token_ids)):
            # The detokenizer held this token's text back (a partial character); with
            # return_token_ids its id still goes out, as vLLM sends every token's.
            return None
        tally.choices[index].started = True
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
            **token_ids,
        }

    return choice
