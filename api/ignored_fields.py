"""The `x-ignored-fields` response header: which request fields the server did not know.

vLLM accepts unknown fields and logs them; a client cannot see that from the answer. Here
a handler notes the names (`note_ignored_fields`) and `IgnoredFieldsHeader` writes them on
whatever response follows, a JSON body, a stream, or an error raised after the body parsed.
"""

from __future__ import annotations

HEADER = b"x-ignored-fields"
_STATE_KEY = "ignored_fields"
_MAX_HEADER_CHARS = 4096  # clients choose how many names


def note_ignored_fields(request, names: list[str]) -> None:
    if names:
        request.state.ignored_fields = names  # lives in scope["state"], where the middleware reads it


class IgnoredFieldsHeader:
    """A pure ASGI middleware (streams pass through untouched) adding the noted names."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message) -> None:
            names = state.get(_STATE_KEY)
            if message["type"] == "http.response.start" and names:
                message = {**message, "headers": [*message.get("headers", []), (HEADER, _header_value(names))]}
            await send(message)

        state = scope.setdefault("state", {})  # the dict request.state writes to, shared by reference
        await self.app(scope, receive, send_with_header)


def _header_value(names: list[str]) -> bytes:
    # Names are any JSON object keys; a header value takes printable ASCII only.
    text = "".join(c if " " <= c <= "~" else "?" for c in ", ".join(names))
    return (text if len(text) <= _MAX_HEADER_CHARS else text[: _MAX_HEADER_CHARS - 3] + "...").encode()
