"""A real server on loopback: `python -m api` in a subprocess, on the default model.

One server serves the whole session (`server`); tests that need other limits start their
own per module with `run_server`. Tests talk to it with the real `openai` client and httpx,
and read its state (free KV blocks, running requests) from /metrics, as an operator would.
Tests that must reach inside the process (wrap its tokenizer, hold its engine in a step)
serve `create_app(...)` with uvicorn in a thread instead (`serve_in_thread`), still over
loopback HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import use_jax
from tests.tiny_models import make_tiny_model, make_tiny_tokenizer

use_jax()  # in-process engines (tiny_engine, serve_in_thread) run jax

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
# Small limits keep warm-up compiles and memory down on a 2-core CI machine.
SMALL_ENGINE = ["--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--kv-cache-memory", "64MiB"]
START_TIMEOUT = 900  # a first run converts the weights and compiles every bucket


@dataclasses.dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    api_key: str | None

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(**self._client_args(kw))

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(**self._client_args(kw))

    def _client_args(self, kw: dict) -> dict:
        # No retries: a test must see the first answer (the client retries 5xx by default).
        return {"base_url": f"{self.url}/v1", "api_key": self.api_key or "none", "max_retries": 0, "timeout": 300, **kw}

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def wait_idle(self, timeout: float = 120) -> dict[str, float]:
        """Metrics once nothing runs or waits (the engine applies aborts between steps)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
            if idle and m["jaxserve:kv_cache_free_blocks"] == m["jaxserve:kv_cache_total_blocks"]:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m}")
            time.sleep(0.1)


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a /metrics page, parsed by prometheus_client (so the format is checked
    too): `name` or `name{label="v"}` (model_name left out) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
            out[key] = s.value
    return out


@contextlib.contextmanager
def run_server(log_dir: Path, *args: str, api_key: str | None = API_KEY):
    log = log_dir / "server.log"
    cmd = [sys.executable, "-m", "api", "--port", "0", "--no-access-log", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("JAXSERVE_API_KEY", None)
    # NOTE: output goes to a file, not a pipe: nobody reads a pipe while tests run, and a full
    # one would block the server.
    with _starting_alone(), open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            url = _wait_for_url(process, log)
            _wait_healthy(url, process, log)
        except BaseException:
            stop_server(process)
            raise
    try:
        yield Server(url, process, log, api_key)
    finally:
        stop_server(process)


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it has not exited within 30 s."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def _starting_alone():
    """One server starts at a time per cache directory (until it answers /health), across
    pytest-xdist workers and other pytest runs: servers share $JAXSERVE_CACHE, and two that
    convert the same weights at once write the same `<entry>.tmp` folder
    (jaxserve/weights/load.py `_save`), so one of them may fail."""
    import fcntl

    cache = Path(os.environ.get("JAXSERVE_CACHE") or Path.home() / ".cache" / "jaxserve")
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".test-server-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wait_for_url(process: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        match = re.search(r"jaxserve: serving \S+ on (http://\S+)", log.read_text())
        if match:
            return match.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"server did not start in {START_TIMEOUT} s:\n{log.read_text()[-4000:]}")


def _wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    for _ in range(300):
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        if process.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"server never became healthy:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """The shared server: default model, small engine limits, API key required."""
    with run_server(tmp_path_factory.mktemp("server"), *SMALL_ENGINE) as s:
        yield s


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, read here from the GGUF by transformers: an oracle
    for prompt token counts and the chat template that does not go through the server."""
    from transformers import AutoTokenizer

    from jaxserve.weights.default_model import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@contextlib.contextmanager
def serve_in_thread(app):
    """Serve `app` with uvicorn in a daemon thread on a free loopback port; yields its URL.
    The app's lifespan (the engine thread) runs in that thread's event loop."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", access_log=False, timeout_graceful_shutdown=5
        )
    )
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A random tiny Llama with a real tokenizer that adds BOS and a chat template that
    writes it (tests/tiny_models.py): servers on it start in seconds."""
    folder = tmp_path_factory.mktemp("tiny-llama-bos")
    make_tiny_model("llama", folder)
    make_tiny_tokenizer(folder)
    return folder


# Small enough to compile in seconds on a CPU, big enough for a few short requests at once.
TINY_ENGINE = dict(
    max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), block_size=4, num_blocks=64, max_model_len=64
)


@pytest.fixture(scope="session")
def tiny_engine(tiny_folder):
    """An in-process LLMEngine on `tiny_folder`, for `create_app` + `serve_in_thread`. Apps
    share it one after another (each stops its engine thread when it shuts down)."""
    from jaxserve.engine import EngineConfig, LLMEngine
    from jaxserve.weights import load_model

    return LLMEngine(load_model(str(tiny_folder), use_cache=False, progress=False), EngineConfig(**TINY_ENGINE))


def greedy_where_clear(loaded, prompts: list[str], max_tokens: int) -> list[tuple[str, str, bool]]:
    """The oracle for servers that split the model (which reorders sums and may flip a true
    near-tie): per prompt, the one-device engine's greedy text, the text of its tokens up to
    and including the first near-tie (top-2 logprob margin under 1e-3), and whether there was none."""
    import numpy as np

    from jaxserve.engine import EngineConfig, LLMEngine
    from scheduler import SamplingParams

    engine = LLMEngine(loaded, EngineConfig(**{**TINY_ENGINE, "block_size": 4}))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2))
    out = {o.request_id: o.outputs[0] for o in engine.generate_all()}
    want = []
    for i in range(len(prompts)):
        sample = out[str(i)]
        margins = [float(np.subtract(*sorted(lp.values(), reverse=True)[:2])) for lp in sample.logprobs]
        clear = next((j for j, m in enumerate(margins) if m < 1e-3), len(margins))
        want.append((sample.text, engine.tokenizer.decode(sample.token_ids[: clear + 1]), clear == len(margins)))
    return want


def assert_same_where_clear(got: list[str], want: list[tuple[str, str, bool]]) -> None:
    """Each text equals the oracle's, or shares its text up to the first near-tie."""
    for text, (full, clear_prefix, all_clear) in zip(got, want, strict=True):
        assert text == full if all_clear else text.startswith(clear_prefix), (text, full)
