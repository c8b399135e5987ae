"""Limits on one request. The body size: a pure ASGI middleware that answers 413 before the
app parses anything. (The other limit, prompts x n, is checked with the queue on arrival:
`ServerState.admit`; the size of prompt text, before it is tokenized: api.prompt_size.)

A declared `Content-Length` over the limit is refused without reading a byte; a chunked
body (no Content-Length) is counted as it arrives and refused once it passes the limit, so
no body larger than the limit is ever held in memory. Bodies within the limit are read
whole here and handed to the app unchanged (every endpoint parses a whole JSON body anyway).
"""

from __future__ import annotations

from api.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
# Engine sequences (prompts x n) one call may start: OpenAI's own cap on n is 128.
DEFAULT_MAX_REQUEST_SEQUENCES = 256
# Threads that tokenize (--tokenizer-pool-size): enough that a small request finds one free
# while big prompts are encoded, whatever the number of cores (the pool is for latency, and
# the Rust tokenizer releases the GIL). Prompt text has a cap of its own: api.prompt_size.
DEFAULT_TOKENIZER_POOL_SIZE = 4


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(int(declared)).response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body: nobody to answer
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                # NOTE: uvicorn reads and discards the rest of the body after the response, so
                # the client can finish sending and then read this answer.
                await self._too_large(None).response()(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            # The body once, then the connection's own events (the handlers watch for disconnects).
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, declared: int | None) -> APIError:
        got = f"more than {self.max_bytes}" if declared is None else str(declared)
        return APIError(
            413,
            f"The request body is too large: {got} bytes; this server accepts at most "
            f"{self.max_bytes} bytes (--max-request-body-bytes).",
            code="request_too_large",
        )
