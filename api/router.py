"""`python -m api.router`: one OpenAI endpoint in front of several jaxserve API servers.

    python -m api.router --replica http://h1:8001 http://h2:8001        # data-parallel replicas
    python -m api.router --prefill http://h:8100 --decode http://h:8200  # prefill/decode servers

`python -m api --data-parallel-size M` starts M engine processes and this router in front.

Replicas: each /v1/completions or /v1/chat/completions call goes to one upstream, the one
that recently got the longest prefix of its prompt (its prefix cache likely holds it) while
that one has at most `load_bound` calls in flight more than the least loaded one, else the
least loaded (scheduler.router.PrefixRouter). The router routes on the request's text, not
on token ids: it has no tokenizer or chat template (it starts in a second and imports no
jax), and a prompt's text prefix is shared exactly when its tokens' is, near enough. The
canonical text is a digest chain over the whole prompt (`prompt_digests`): a completion's
prompt in chunks, a chat's messages one after another, each in chunks; a second chat turn
behind a long system prompt then matches the upstream that served the first turn.

Prefill/decode (vLLM's kv_transfer_params): a call goes to a prefill server first, with
`max_tokens` 1, not streamed, one choice and `kv_transfer_params: {"do_remote_decode":
true}`; then to a decode server unchanged but for the prefill server's kv_transfer_params
(where to pull the prompt's KV). The decode server's answer, streamed or not, is the call's.

Failures: every upstream's /health is polled (`--health-interval`); one that does not answer
is out of rotation until it does (api.upstreams). A call that cannot connect, breaks, or
gets a 5xx before anything streamed to the client is tried on another upstream of the same
role (at most `--max-tries` upstreams); once tokens streamed, a break ends the stream with
an SSE `data: {"error": ...}` event. /health is 200 while every role has an upstream in
rotation (its body lists them), else 503. /metrics counts per upstream. Other routes
(/v1/models, /tokenize, ...) go to an upstream in rotation (a decode server in PD mode).
Responses carry `x-jaxserve-upstream`, the URL of the server that answered. /v1/responses
is routed like a chat (its `input`), to a decode server in PD mode; its stored responses
(`previous_response_id`) live on the replica that made them.

With --port 0 the system picks a free port; the line `jaxserve: router on URL` on stdout
says which.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import Callable, Sequence

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.upstreams import Upstream, UpstreamDown, UpstreamPool, render_metrics, until_down
from jaxserve.flags import HelpFormatter
from jaxserve.logs import configure_logging
from scheduler.router import chain_digests

FORWARDED_HEADERS = ("authorization", "content-type", "accept")
CHUNK_BYTES = 128  # a prompt's text is matched in pieces of this size
DEFAULT_LOAD_BOUND = 4
# A busy server on a loaded machine may take a second or two to answer /health; a hung one
# never does. Two misses of this many seconds in a row take an upstream out of rotation.
DEFAULT_HEALTH_TIMEOUT = 5.0
UPSTREAM_HEADER = "x-jaxserve-upstream"
HOP_HEADERS = {"content-length", "content-type", "transfer-encoding", "connection", "keep-alive", "date", "server"}


def create_router(
    replicas: Sequence[str] = (),
    prefill: Sequence[str] = (),
    decode: Sequence[str] = (),
    *,
    load_bound: int = DEFAULT_LOAD_BOUND,
    health_interval: float = 1.0,
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
    max_tries: int = 3,
    describe: Callable[[str], dict] | None = None,
) -> FastAPI:
    """The router app over `replicas`, or over `prefill` and `decode` servers (URLs).
    `describe(url)`: more facts for /health about an upstream (its process, restarts)."""
    if bool(replicas) == bool(prefill or decode):
        raise ValueError("give either replica servers, or prefill and decode servers")
    if max_tries < 1:
        raise ValueError(f"{max_tries=} must be at least 1")
    if replicas:
        pools = [UpstreamPool("replica", replicas, load_bound)]
    else:
        pools = [UpstreamPool("prefill", prefill, load_bound), UpstreamPool("decode", decode, load_bound)]
    serving = pools[-1]  # the pool whose answer is the call's
    # No pool limit (httpx's default is 100 connections) and no read timeout: a stream may
    # run for minutes; a dead upstream is found by the health poll instead.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
    )

    async def poll_forever():
        while True:
            await asyncio.sleep(health_interval)
            await asyncio.gather(*(pool.poll(client, health_timeout) for pool in pools))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.gather(*(pool.poll(client, health_timeout) for pool in pools))
        poller = asyncio.create_task(poll_forever())
        try:
            yield
        finally:
            poller.cancel()
            await client.aclose()

    app = FastAPI(title="jaxserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pools = pools

    async def send(pool: UpstreamPool, method: str, path: str, request: Request, content: bytes, digests, stream: bool):
        """The call's answer from the first upstream of `pool` that gives one (see the module docstring)."""
        tried: set[Upstream] = set()
        last_failure = "none is in rotation"
        for attempt in range(max_tries):
            upstream = pool.pick(digests, tried)
            if upstream is None:
                break
            tried.add(upstream)
            more = attempt + 1 < max_tries and any(u.healthy and u not in tried for u in pool.upstreams)
            upstream.in_flight += 1
            down = asyncio.ensure_future(upstream.down.wait())
            answer, handed_off = None, False
            try:
                outgoing = client.build_request(
                    method, upstream.url + path, content=content, headers=_headers(request), params=request.query_params
                )
                answer = await until_down(client.send(outgoing, stream=True), upstream, down)
                if answer.status_code >= 500 and more:
                    last_failure = f"{upstream.url} answered {answer.status_code}: {(await answer.aread())[:500]!r}"
                    upstream.retries += 1
                    continue
                chunks = answer.aiter_raw()
                if stream and answer.status_code == 200:
                    # Wait for the first chunk here: until then the call can still go elsewhere.
                    first = await until_down(anext(chunks, b""), upstream, down)
                    handed_off = True  # the relay finishes the call
                    return StreamingResponse(
                        _relay(pool, upstream, answer, first, chunks, down),
                        media_type=answer.headers.get("content-type"),
                        headers=_answer_headers(answer, upstream),
                    )
                body = b"".join([chunk async for chunk in _until_down_each(chunks, upstream, down)])
                return Response(
                    body,
                    answer.status_code,
                    media_type=answer.headers.get("content-type"),
                    headers=_answer_headers(answer, upstream),
                )
            except (httpx.HTTPError, UpstreamDown) as e:
                pool.call_failed(upstream, e, retried=more)
                last_failure = f"{upstream.url}: {e!r}"
            finally:
                if not handed_off:
                    upstream.in_flight -= 1
                    down.cancel()
                    if answer is not None:
                        with anyio.CancelScope(shield=True):
                            await answer.aclose()
        return _error(503, f"no {pool.role} server could answer the call ({last_failure})", "no_upstream")

    async def _relay(pool, upstream, answer, first, chunks, down):
        """The upstream's stream to the client; a break ends it with an SSE error event."""
        try:
            yield first
            async for chunk in _until_down_each(chunks, upstream, down):
                yield chunk
        except (httpx.HTTPError, UpstreamDown) as e:
            pool.call_failed(upstream, e, retried=False)
            message = f"the {pool.role} server {upstream.url} failed mid-stream: {e!r}"
            yield f"data: {json.dumps(_error_body(message, 'upstream_failed'))}\n\n".encode()
        finally:
            upstream.in_flight -= 1
            down.cancel()
            with anyio.CancelScope(shield=True):
                await answer.aclose()

    async def prefill_first(path: str, request: Request, body: dict, digests) -> Response | dict:
        """The prefill server's kv_transfer_params for the call, or the answer that ends it."""
        answer = await send(
            pools[0], "POST", path, request, json.dumps(prefill_call(body)).encode(), digests, stream=False
        )
        if answer.status_code != 200:
            return answer
        try:
            return json.loads(answer.body)["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            return _error(502, f"the prefill server's answer has no kv_transfer_params: {answer.body[:500]!r}")

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    @app.post("/v1/responses")
    async def generate(request: Request):
        path, content = request.url.path, await request.body()
        try:
            body = json.loads(content)
        except json.JSONDecodeError as e:
            return _error(400, f"the body is not JSON: {e}", "invalid_json", kind="invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_json", kind="invalid_request_error")
        digests = prompt_digests(body)
        if len(pools) == 2 and path != "/v1/responses":
            params = await prefill_first(path, request, body, digests)
            if isinstance(params, Response):
                return params
            content = json.dumps({**body, "kv_transfer_params": params}).encode()
        return await send(serving, "POST", path, request, content, digests, stream=bool(body.get("stream")))

    @app.get("/health")
    async def health():
        upstreams = [{**u.describe(), **(describe(u.url) if describe else {})} for p in pools for u in p.upstreams]
        missing = [p.role for p in pools if not p.available]
        if missing:
            message = f"degraded: no {' and no '.join(missing)} server is in rotation"
            return JSONResponse({**_error_body(message, "no_upstream"), "upstreams": upstreams}, status_code=503)
        status = "ok" if all(u["healthy"] for u in upstreams) else "degraded"
        return {"status": status, "upstreams": upstreams}

    @app.get("/metrics")
    async def metrics():
        return Response(render_metrics(pools), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def other(path: str, request: Request):
        return await send(serving, request.method, f"/{path}", request, await request.body(), [], stream=False)

    return app


async def _until_down_each(chunks, upstream: Upstream, down: asyncio.Future):
    while True:
        chunk = await until_down(anext(chunks, None), upstream, down)
        if chunk is None:
            return
        yield chunk


def prompt_digests(body: dict) -> list[bytes]:
    """The digest chain of a call's prompt (its first, for several): a chat's messages one
    after another, each in CHUNK_BYTES pieces of its canonical JSON; a completion's prompt
    text (or token ids) in pieces. The cache salt starts the chain."""
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    pieces: list[bytes] = []
    messages = body.get("messages", body.get("input"))  # chat, or the Responses API
    if isinstance(messages, list):
        for message in messages:
            pieces += _split(json.dumps(message, sort_keys=True, ensure_ascii=False).encode())
    else:
        prompt = body.get("prompt", messages)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: route on its first prompt
        if isinstance(prompt, str):
            pieces = _split(prompt.encode())
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            pieces = _split(b"".join(t.to_bytes(8, "little", signed=True) for t in prompt))
        pieces = [p for p in pieces if len(p) == CHUNK_BYTES]  # a prompt's ragged tail is not a shared prefix
    return chain_digests(pieces, salt)


def _split(data: bytes) -> list[bytes]:
    return [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]


def prefill_call(body: dict) -> dict:
    """The call a prefill server gets: the prompt only (one token, one choice, not streamed),
    and the request to hand its KV over."""
    call = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens", "min_tokens")}
    return {**call, "max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}


def _error_body(message: str, code: str, kind: str = "server_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _error(status: int, message: str, code: str = "upstream_failed", kind: str = "server_error") -> JSONResponse:
    return JSONResponse(_error_body(message, code, kind), status_code=status)


def _answer_headers(answer: httpx.Response, upstream: Upstream) -> dict[str, str]:
    """The upstream's response headers (x-ignored-fields, x-request-id ...) but those of its
    own connection, and which upstream answered."""
    kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
    return {**kept, UPSTREAM_HEADER: upstream.url}


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def serve(app, host: str, port: int, line: str, log_level: str = "warning") -> None:
    """Bind and listen first (so --port 0 can say which port it got, and a client that reads
    the line can connect at once: the kernel queues it until uvicorn accepts), print `line`
    with {url}, serve."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    print(line.format(url=f"http://{f'[{host}]' if ':' in host else host}:{port}"), flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)).run(sockets=[sock])


def add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--router-load-bound",
        type=int,
        default=DEFAULT_LOAD_BOUND,
        metavar="N",
        help="an upstream that recently got a prompt's prefix gets the call while it has at most N calls in "
        "flight more than the least loaded one",
    )
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS", help="poll /health this often")
    p.add_argument(
        "--health-timeout",
        type=float,
        default=DEFAULT_HEALTH_TIMEOUT,
        metavar="SECONDS",
        help="an upstream whose /health does not answer in this time twice in a row leaves the rotation",
    )
    p.add_argument("--max-tries", type=int, default=3, help="upstreams a call is tried on before it fails")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m api.router", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--replica", nargs="+", default=[], metavar="URL", help="replica servers, e.g. http://h:8001")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill servers, e.g. http://h:8100")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode servers, e.g. http://h:8200")
    p.add_argument("--host", default="127.0.0.1", help="the interface to listen on")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    add_router_flags(p)
    args = p.parse_args(argv)
    configure_logging("info")  # upstreams leaving and rejoining the rotation
    if bool(args.prefill) != bool(args.decode) or bool(args.replica) == bool(args.prefill):
        p.error("give --replica URL..., or --prefill URL... and --decode URL...")
    app = create_router(
        args.replica,
        args.prefill,
        args.decode,
        load_bound=args.router_load_bound,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        max_tries=args.max_tries,
    )
    serve(app, args.host, args.port, "jaxserve: router on {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
