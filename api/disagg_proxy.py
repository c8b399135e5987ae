"""`python -m api.disagg_proxy --prefill URL... --decode URL...`: one OpenAI endpoint over
prefill and decode servers (`python -m api --role prefill|decode`).

Each call to /v1/completions or /v1/chat/completions goes to a prefill server first, as
vLLM's proxy sends it: one token (`max_tokens` 1), not streamed, one choice, with
`kv_transfer_params: {"do_remote_decode": true}`. Then it goes to a decode server unchanged
but for the prefill server's `kv_transfer_params` (where to pull the prompt's KV), and the
decode server's answer, streamed or not, is the call's. An error from either server is
passed back as it came. Servers of each kind are taken in turn. Any other route goes to a
decode server; GET /health is 200 when every server answers its own /health with 200.

With --port 0 the system picks a free port; the line `jaxserve: proxy on URL` on stdout says
which.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import sys

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

FORWARDED_HEADERS = ("authorization", "content-type")


def create_proxy(prefill: list[str], decode: list[str], timeout: float | None = 600.0) -> FastAPI:
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode server")
    prefill_urls, decode_urls = itertools.cycle(prefill), itertools.cycle(decode)
    client = httpx.AsyncClient(timeout=timeout)
    app = FastAPI(title="jaxserve disaggregation proxy", docs_url=None, redoc_url=None)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def generate(request: Request):
        path, headers = request.url.path, _headers(request)
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as e:
            return JSONResponse(
                {
                    "error": {
                        "message": f"the body is not JSON: {e}",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                },
                status_code=400,
            )
        if not isinstance(body, dict):
            return JSONResponse(
                {
                    "error": {
                        "message": "the body must be a JSON object",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                },
                status_code=400,
            )
        prefill_url, decode_url = next(prefill_urls), next(decode_urls)
        try:
            first = await client.post(prefill_url + path, json=prefill_call(body), headers=headers)
        except httpx.HTTPError as e:
            return _unreachable("prefill", prefill_url, e)
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type=first.headers.get("content-type"))
        decode_body = {**body, "kv_transfer_params": first.json().get("kv_transfer_params")}
        upstream = client.build_request("POST", decode_url + path, json=decode_body, headers=headers)
        try:
            answer = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return _unreachable("decode", decode_url, e)
        return StreamingResponse(
            answer.aiter_raw(),
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type"),
            background=BackgroundTask(answer.aclose),
        )

    @app.get("/health")
    async def health():
        async def status(url):
            try:
                return (await client.get(url + "/health", timeout=10)).status_code
            except httpx.HTTPError:
                return None

        servers = {"prefill": prefill, "decode": decode}
        codes = {kind: await asyncio.gather(*(status(u) for u in urls)) for kind, urls in servers.items()}
        body = {kind: [{"url": u, "status": c} for u, c in zip(servers[kind], codes[kind])] for kind in servers}
        healthy = all(c == 200 for cs in codes.values() for c in cs)
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def other(path: str, request: Request):
        answer = await client.request(
            request.method,
            f"{next(decode_urls)}/{path}",
            content=await request.body(),
            headers=_headers(request),
            params=request.query_params,
        )
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    return app


def prefill_call(body: dict) -> dict:
    """The call a prefill server gets: the prompt only (one token, one choice, not streamed),
    and the request to hand its KV over."""
    call = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens", "min_tokens")}
    return {**call, "max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}


def _unreachable(kind: str, url: str, error: Exception) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": f"the {kind} server {url} did not answer: {error!r}",
                "type": "server_error",
                "param": None,
                "code": "upstream_unreachable",
            }
        },
        status_code=502,
    )


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m api.disagg_proxy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers, e.g. http://h:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers, e.g. http://h:8200")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    args = p.parse_args(argv)
    import uvicorn

    app = create_proxy([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode])
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(f"jaxserve: proxy on http://{f'[{host}]' if ':' in host else host}:{port}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
