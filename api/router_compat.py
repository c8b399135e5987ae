"""What external routers (vllm-router, sglang-router) ask of a worker beyond the OpenAI routes.

Both routers probe SGLang's worker routes at start-up and while they run; without them they
fall back (a model id of "unknown", a load of -1 that load-based policies cannot use):

    GET /get_load                       {"load": running + waiting, "num_reqs", "num_waiting_reqs"}
    GET /get_server_info, /server_info  the served model, max_model_len, dp_size, role
    GET /get_model_info, /model_info    {"model_path", "is_generation": true, ...}

/get_load answers in the shape vllm-router reads (`load`); sglang-router 0.3 reads a list
per DP rank instead and shows -1 (its cache-aware policy balances on its own counts).

vllm-router also knows vLLM's gauge names on /metrics (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, for its load-aware policies), which
`with_vllm_names` adds next to jaxserve's. Everything here is read from the server's own
/metrics page.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Request
from prometheus_client.parser import text_string_to_metric_families

from api.serving import ServerState

# jaxserve's names for the gauges vLLM's routers read by vLLM's names.
VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def install(app: FastAPI, metrics_page: Callable[[], str]) -> None:
    """Add the routers' routes to `app`; `metrics_page` renders the server's /metrics page."""
    router = APIRouter()

    @router.get("/get_load", include_in_schema=False)
    async def get_load():
        g = _gauges(metrics_page())
        running, waiting = int(g["num_requests_running"]), int(g["num_requests_waiting"])
        return {"load": running + waiting, "num_reqs": running, "num_waiting_reqs": waiting}

    @router.get("/get_server_info", include_in_schema=False)
    @router.get("/server_info", include_in_schema=False)
    async def server_info(request: Request):
        state: ServerState = request.app.state.server
        return {
            "model_path": state.model_name,
            "served_model_name": state.model_name,
            "max_model_len": state.max_model_len,
            "context_length": state.max_model_len,
            "dp_size": 1,  # one engine per server (replicas are servers of their own: api.replica_processes)
            "disaggregation_mode": state.disagg.role if state.disagg is not None else "null",
            "version": importlib.metadata.version("jaxserve"),
        }

    @router.get("/get_model_info", include_in_schema=False)
    @router.get("/model_info", include_in_schema=False)
    async def model_info(request: Request):
        state: ServerState = request.app.state.server
        return {"model_path": state.model_name, "is_generation": True, "max_model_len": state.max_model_len}

    app.include_router(router)


def with_vllm_names(page: str) -> str:
    """`page` plus a copy of the gauges in VLLM_NAMES under vLLM's `vllm:` prefix."""
    wanted = {f"jaxserve:{name}" for name in VLLM_NAMES}
    extra = []
    for line in page.splitlines():
        words = line.split(maxsplit=3)
        name = words[2] if line.startswith("# ") and len(words) > 2 else line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            extra.append(line.replace("jaxserve:", "vllm:", 1))
    return page + "".join(line + "\n" for line in extra)


def _gauges(page: str) -> dict[str, float]:
    """VLLM_NAMES' values on `page`, summed over their samples."""
    sums = dict.fromkeys(VLLM_NAMES, 0.0)
    lines = [line for line in page.splitlines() if any(f"jaxserve:{n}" in line for n in VLLM_NAMES)]
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        name = family.name.removeprefix("jaxserve:")
        for sample in family.samples:
            sums[name] += sample.value
    return sums
