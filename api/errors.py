"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

A client mistake is a 4xx with a message that names the offending parameter; FastAPI's
own 422 validation errors and Starlette's 404/405 pages are rewritten into this shape, so
an OpenAI client raises its usual exception classes (BadRequestError, NotFoundError, ...).
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error to answer with `status` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    # OpenAI's exact wording and code for an unknown model.
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def from_value_error(
    error: ValueError, param_names: dict[str, str] | None = None, default_param: str | None = None
) -> APIError:
    """A 400 for the engine's ValueError. Its messages start with the field name
    ("temperature must be >= 0, ..."), which becomes `param` (renamed to the API's name)."""
    message = str(error)
    match = re.match(r"(\w+) must\b", message)
    param = match.group(1) if match else default_param
    if param and param_names:
        param = param_names.get(param, param)
    return bad_request(message, param=param)


# Pydantic adds the union member or validator it tried to a field's location
# ("prompt", "list[int]"); those are not parameters a client can name.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|json-or-python|list\[.*|dict\[.*|.*-.*)$")


def _param(error: dict) -> str | None:
    """The location as a client writes it: `messages[0].role`. It stops at a union's member
    (`prompt`, not `prompt[0]`): which member the client meant is only a guess."""
    param = ""
    for part in error.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        elif _TYPE_TAG.match(part):
            break
        elif part != "body":
            param += f".{part}" if param else part
    return param or None


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    error = errors[0]
    if error.get("type") == "json_invalid":
        return (
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
            "HTTP library correctly. The OpenAI API expects a JSON payload.)"
        ), None
    param = _param(error)
    # A union reports one error per member; a member whose type matched (a list of token ids
    # with a negative one) says what is wrong with the value better than "not a string".
    error = next((e for e in errors if _param(e) == param and not e.get("type", "").endswith("_type")), error)
    if error.get("type") == "missing" and param is None:  # the whole body is absent, not one field
        return (
            "The request has no body: send a JSON object (Content-Type: application/json) with the "
            "request's parameters."
        ), None
    if error.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param
    value = error.get("input")
    shown = json.dumps(value)[:100] if _jsonable(value) else repr(value)[:100]
    message = (
        f"Invalid value for '{param}': {error.get('msg', 'invalid value')} (got {shown})."
        if param
        else f"Invalid request body: {error.get('msg', 'invalid value')}."
    )
    others = sum(1 for e in errors[1:] if _param(e) != param)  # a union's other members are one error
    if others:
        message += f" ({others} more error(s) in the request)"
    return message, param


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise into the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = list(exc.errors())
        message, param = _validation_message(errors) if errors else ("Invalid request.", None)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method not allowed ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(f"internal server error: {type(exc).__name__}", SERVER_ERROR, code="internal_error"),
            status_code=500,
        )
