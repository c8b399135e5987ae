"""vLLM's runtime LoRA routes, served with --allow-runtime-lora-updating (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING):

    POST /v1/load_lora_adapter   {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter {"lora_name": "sql"}

Both answer 200 with vLLM's plain-text "Success: ..." line. A loaded adapter is read and
checked off the engine thread before its name is served, so steps go on meanwhile; each load
gets a new id, so a folder loaded again after a change never shares prefix-cache blocks with
its earlier self. Unloading takes the name away at once: new requests naming it are 404s,
requests already running finish with it, and its device slot and host copy are reused like
any least recently used adapter's.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from api import openapi
from api.errors import APIError, bad_request
from api.ignored_fields import note_ignored_fields
from api.protocol import _Body
from api.serving import ServerState
from jaxserve.lora.request import LoRARequest

router = APIRouter()


class LoadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]  # a PEFT folder on the server's disk


class UnloadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: int | None = None  # vLLM's: if given, it must be the loaded adapter's id


# The success line is plain text and the errors JSON, so no response_class: it would document
# the errors as text too (schemathesis caught that).
_SUCCESS = {
    200: {"description": "vLLM's plain-text success line.", "content": {"text/plain": {"schema": {"type": "string"}}}}
}


@router.post("/v1/load_lora_adapter", responses={**_SUCCESS, **openapi.errors(400, 404)})
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    state: ServerState = request.app.state.server
    _check_runtime_updates(state)
    note_ignored_fields(request, body.warn_ignored())
    name = body.lora_name
    _check_name_free(state, name)
    lora = LoRARequest(name, next(state.lora_ids), body.lora_path)
    engine = state.engine_loop.engine
    try:
        adapter = await state.off_loop(engine.loras.read, lora)  # disk and checks, off the engine thread
        await state.engine_loop.call(lambda e: e.register_lora(lora, adapter))
    except ValueError as e:  # LoRAConfigError: the message names the field or file
        raise bad_request(str(e), "lora_path") from None
    _check_name_free(state, name)  # another load of this name may have finished meanwhile
    state.lora_modules[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses={**_SUCCESS, **openapi.errors(400, 404)})
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    state: ServerState = request.app.state.server
    _check_runtime_updates(state)
    note_ignored_fields(request, body.warn_ignored())
    lora = state.lora_modules.get(body.lora_name)
    if lora is None or body.lora_int_id not in (None, lora.lora_int_id):
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")
    del state.lora_modules[body.lora_name]
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _check_runtime_updates(state: ServerState) -> None:
    if not state.allow_runtime_lora_updating:
        raise APIError(
            404,
            "loading and unloading LoRA adapters at run time is off: start the server with --enable-lora "
            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
        )


def _check_name_free(state: ServerState, name: str) -> None:
    if name == state.model_name or name in state.aliases:
        raise bad_request(f"'{name}' is the base model's name", "lora_name")
    if name in state.lora_modules:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
