"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize, and GET /version.

    POST /tokenize   {"prompt": "Hi"}  or  {"messages": [...], "add_generation_prompt": true, ...}
                     -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize {"tokens": [1, 2]} -> {"prompt": "..."}

A chat is rendered exactly as /v1/chat/completions renders it (the same template fields),
so /tokenize shows the prompt a chat request would run.
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from api import openapi
from api.chat import chat_prompt, check_template
from api.errors import bad_request
from api.ignored_fields import note_ignored_fields
from api.protocol import ChatMessage, ChatTemplateFields, TokenId, _Body
from api.serving import ServerState
from jaxserve.engine.tokenization import encode_prompt

router = APIRouter()


class TokenizeRequest(ChatTemplateFields):
    """A text `prompt` (encoded as /v1/completions encodes it), or chat `messages` (rendered
    as /v1/chat/completions renders them, with the same template fields): exactly one."""

    # The schema states "exactly one" (a present field must not be null, so required alone is not enough).
    model_config = ConfigDict(
        json_schema_extra={
            **ChatTemplateFields.model_config["json_schema_extra"],
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ],
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # None: as the generation endpoints (a prompt gets the tokenizer's special tokens, a chat does not).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


@router.post("/tokenize", responses={200: {"model": TokenizeResponse}, **openapi.errors(400, 404, 413)})
async def tokenize(body: TokenizeRequest, request: Request):
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    note_ignored_fields(request, body.warn_ignored())
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", "prompt" if body.prompt is not None else "messages")
    if body.messages is not None:
        body.check_template_fields()
        check_template(state, body)
        tokens = await chat_prompt(state, body)
    else:
        state.check_prompt_bytes([body.prompt], "prompt")
        tokens = await state.off_loop(
            encode_prompt,
            state.tokenizer,
            body.prompt,
            state.vocab_size,
            add_special_tokens=body.add_special_tokens is not False,
            param="prompt",
        )
    token_strs = None
    if body.return_token_strs:
        token_strs = await state.off_loop(state.tokenizer.convert_ids_to_tokens, tokens)
    # A JSONResponse as it is: FastAPI's own encoder walks every token id on the event loop
    # (a third of a second for a context of 400,000 ids).
    return JSONResponse(
        {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": token_strs}
    )


@router.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **openapi.errors(400, 404, 413)})
async def detokenize(body: DetokenizeRequest, request: Request):
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    note_ignored_fields(request, body.warn_ignored())
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    tokens = await state.off_loop(encode_prompt, state.tokenizer, body.tokens, state.vocab_size, param="tokens")
    return {"prompt": await state.off_loop(state.tokenizer.decode, tokens)}


@router.get("/version", responses={200: {"model": VersionResponse}})
async def version():
    return {"version": importlib.metadata.version("jaxserve")}
