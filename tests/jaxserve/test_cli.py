"""The `jaxserve` command: its subcommands, vLLM's flag names, `--config FILE.yaml`, the
start-up checks, `jaxserve chat`, and what --seed and --enforce-eager do to an engine.

Flags are checked against the real parsers (an alias parses to the same Namespace as the
name it stands for); the start-up checks and chat run the real command in a subprocess."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api.__main__ import parse_args as serve_args
from jaxserve import generate
from jaxserve.chat import Conversation
from jaxserve.cli import COMMANDS
from jaxserve.engine import LLM, EngineConfig, LLMEngine
from jaxserve.flags import model_engine_kwargs
from scheduler import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def jaxserve(*args: str, stdin: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`jaxserve ARGS` as a user runs it (the console script's module), from this checkout."""
    return subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- vLLM's names and the YAML config parse as the flags do ---------------------------------


def test_vllm_names_parse_as_the_current_names():
    pairs = [
        (["--kv-cache-memory-bytes", "512MiB"], ["--kv-cache-memory", "512MiB"]),
        (["--num-gpu-blocks-override", "64"], ["--num-blocks", "64"]),
        (["--no-enable-prefix-caching"], ["--no-prefix-caching"]),
        (["--tensor-parallel-size", "2"], ["-tp", "2"]),
    ]
    for vllm, ours in pairs:
        assert vars(serve_args(vllm)) == vars(serve_args(ours)), vllm
    assert serve_args(["--no-prefix-caching"]).enable_prefix_caching is False
    assert serve_args(["--enable-prefix-caching"]).enable_prefix_caching is True
    assert serve_args([]).enable_prefix_caching is True
    assert serve_args(["--kv-cache-memory-bytes", "512MiB"]).kv_cache_memory == 512 << 20
    assert serve_args([]).kv_cache_memory is None  # the engine picks by device (1 GiB on the CPU)


def test_serve_model_positional_is_model():
    positional, flag = (
        vars(serve_args(["./Qwen3-0.6B", "--port", "0"])),
        vars(serve_args(["--model", "./Qwen3-0.6B", "--port", "0"])),
    )
    assert positional.pop("model_tag") == "./Qwen3-0.6B" and flag.pop("model_tag") is None
    assert positional == flag
    assert serve_args(["m", "--model", "m"]).model == "m"  # the same twice is no conflict


def test_the_model_given_twice_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        serve_args(["./a", "--model", "./b"])
    assert e.value.code == 2 and "the model is given twice: ./a and --model ./b" in capsys.readouterr().err


SERVE_FLAGS = [
    "--model",
    "./Qwen3-0.6B",
    "--max-num-seqs",
    "8",
    "--kv-cache-memory-bytes",
    "512MiB",
    "--no-enable-prefix-caching",
    "--served-model-name",
    "qwen",
    "default",
    "--speculative-config",
    '{"method": "ngram", "num_speculative_tokens": 3}',
    "--allowed-origins",
    '["http://example.com"]',
    "--enforce-eager",
    "--seed",
    "7",
    "-tp",
    "2",
]
SERVE_YAML = """\
model: ./Qwen3-0.6B
max_num_seqs: 8                   # underscores or dashes
kv-cache-memory-bytes: 512MiB
enable-prefix-caching: false
served-model-name: [qwen, default]
speculative-config: {method: ngram, num_speculative_tokens: 3}
allowed-origins: ["http://example.com"]
enforce-eager: true
disable-log-requests: false       # an off switch: as if not given
seed: 7
tensor_parallel_size: 2
"""


def config_file(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def without_config(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "config"}


def test_a_yaml_config_parses_as_its_flags(tmp_path):
    path = config_file(tmp_path, SERVE_YAML)
    assert without_config(serve_args(["--config", path])) == without_config(serve_args(SERVE_FLAGS))
    # The command line wins over the file, whichever side of --config it is on.
    for argv in (["--config", path, "--max-num-seqs", "4"], ["--max-num-seqs", "4", "--config", path]):
        assert without_config(serve_args(argv)) == without_config(serve_args([*SERVE_FLAGS, "--max-num-seqs", "4"]))
    assert serve_args(["./other", "--config", path]).model == "./other"  # a positional MODEL too
    assert serve_args(["--config", path, "--enable-prefix-caching"]).enable_prefix_caching is True


def test_generate_takes_a_yaml_config_too(tmp_path):
    path = config_file(tmp_path, "max-tokens: 12\ntemperature: 0.5\nchat: true\ndtype: bfloat16\n")
    flags = ["Hi", "--max-tokens", "12", "--temperature", "0.5", "--chat", "--dtype", "bfloat16"]
    assert without_config(generate.parse_args(["Hi", "--config", path])) == without_config(generate.parse_args(flags))


@pytest.mark.parametrize(
    "text, message",
    [
        ("max-num-seqs: 8\nmax-num-sequences: 8\n", "unknown key 'max-num-sequences'"),
        ("max-num-seqs: lots\n", "argument --max-num-seqs: invalid int value: 'lots'"),
        ("enforce-eager: 3\n", "enforce-eager: 3 is not a value for --enforce-eager"),
        ("dtype: float64\n", "invalid choice: 'float64'"),
        ("- a list\n", "want a mapping of flag names to values"),
    ],
)
def test_a_bad_config_names_the_key(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as e:
        serve_args(["--config", config_file(tmp_path, text)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_help_shows_each_default_once():
    help_text = subprocess.run(
        [sys.executable, "-m", "api", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    flat = " ".join(help_text.split())
    for shown in ("--port PORT 0: any free port (default: 8000)", "most requests in one batch (default: 32)"):
        assert shown in flat
    assert "tokens per KV-cache block (default: 16)" in flat
    assert "default: 1GiB on the CPU" in flat  # a default that depends on the device: said in the help, once
    assert "(default 32)" not in flat and "(default: None)" not in flat


# -- the command and its start-up checks ------------------------------------------------------


def test_jaxserve_is_the_console_script():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["jaxserve"] == "jaxserve.cli:main"
    assert (scripts["jaxserve-serve"], scripts["jaxserve-generate"]) == ("api.__main__:main", "jaxserve.generate:main")


def test_jaxserve_help_lists_every_command_without_starting_jax():
    result = jaxserve("--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert f"\n  {name} " in result.stdout, name
    quiet = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from jaxserve.cli import main; main(['--help']); print('jax' in sys.modules)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert quiet.stdout.rstrip().endswith("False")
    assert "did you mean serve?" in jaxserve("serv").stderr
    as_module = subprocess.run([sys.executable, "-m", "jaxserve", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert as_module.returncode == 0 and as_module.stdout == result.stdout  # python -m jaxserve is the command


def test_a_port_in_use_fails_before_the_model_loads():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        result = jaxserve("serve", "--port", str(port), timeout=120)
        elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert f"127.0.0.1:{port}" in result.stderr and "--port 0" in result.stderr
    assert elapsed < 20  # loading and compiling the default model takes longer than this
    assert "serving" not in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["./no/such/model"], "no model file or folder at './no/such/model'"),
        (["./no/such/model.gguf"], "no model file or folder"),
        (["--revision", "v1"], "--revision v1 applies to a hub id; the default model is local"),
    ],
)
def test_a_missing_model_path_fails_before_anything_loads(args, message):
    start = time.monotonic()
    result = jaxserve("serve", *args, "--port", "0", timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert time.monotonic() - start < 20


@pytest.mark.server
def test_serve_a_hub_model_at_a_revision(tiny_llama_tok_dir, tmp_path):
    """`jaxserve serve owner/tiny --revision v1` from a hub cache (offline: huggingface_hub answers
    from the cache alone), where only v1 holds a model: served under the name it was given."""
    import os
    import shutil

    repo = tmp_path / "hub" / "models--owner--tiny"
    for ref, commit in (("main", "a" * 40), ("v1", "b" * 40)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        (repo / "snapshots" / commit).mkdir(parents=True)
    for file in tiny_llama_tok_dir.iterdir():
        shutil.copy(file, repo / "snapshots" / ("b" * 40) / file.name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "JAXSERVE_CACHE": str(tmp_path)}
    argv = ["serve", "owner/tiny", "--revision", "v1", "--port", "0", "--enforce-eager"]
    with subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    ) as server:
        try:
            line = server.stdout.readline()  # the first line on stdout says what it serves, once it does
        finally:
            server.terminate()
    assert line.startswith("jaxserve: serving owner/tiny on http://127.0.0.1:"), line


def test_bench_runs_the_checkouts_script():
    result = jaxserve("bench", "latency", "--help")
    assert result.returncode == 0 and "python benchmarks/single_stream.py" in result.stdout


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(tmp_path):
    """An installed (not editable) package has no benchmarks/ beside it."""
    package = tmp_path / "site-packages" / "jaxserve"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text((ROOT / "jaxserve" / "cli.py").read_text())
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from jaxserve.cli import main; sys.exit(main(['bench', 'throughput']))"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(package.parent), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "ship with the source checkout" in result.stderr, result.stderr


# -- chat -----------------------------------------------------------------------------------------


def test_chat_answers_a_message_on_stdin(tiny_llama_tok_dir, weights_cache):
    """The command's reply is the library's own for the same conversation (vLLM's LLM.chat)."""
    result = jaxserve(
        "chat",
        "--model",
        str(tiny_llama_tok_dir),
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--enforce-eager",
        "--cache-dir",
        str(weights_cache),
        stdin="the cat sat on the mat\n",
    )
    assert result.returncode == 0, result.stderr
    llm = LLM(str(tiny_llama_tok_dir), cache_dir=weights_cache, max_num_seqs=1, warm_up=False)
    expected = llm.chat(
        [{"role": "user", "content": "the cat sat on the mat"}],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )[0]
    assert expected.outputs[0].text and result.stdout == expected.outputs[0].text + "\n"


def test_chat_keeps_the_conversation(tiny_llama_tok):
    engine = LLMEngine(tiny_llama_tok, EngineConfig(max_num_seqs=1, warm_up=False))
    params = SamplingParams(temperature=0, max_tokens=6)
    out = io.StringIO()
    Conversation(engine, params, system="you are a dog").loop(["the cat", "", "/clear", "a dog", "/exit", "never"], out)
    # The oracle: each turn generated by itself, from the conversation the REPL should have sent.
    first = reply(engine, [{"role": "system", "content": "you are a dog"}, {"role": "user", "content": "the cat"}])
    after_clear = reply(engine, [{"role": "system", "content": "you are a dog"}, {"role": "user", "content": "a dog"}])
    assert out.getvalue() == f"{first}\n{after_clear}\n"

    out = io.StringIO()
    chat = Conversation(engine, params)
    chat.loop(["the cat", "and the dog"], out)
    turn_one = reply(engine, [{"role": "user", "content": "the cat"}])
    history = [
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": turn_one},
        {"role": "user", "content": "and the dog"},
    ]
    assert out.getvalue() == f"{turn_one}\n{reply(engine, history)}\n"
    assert chat.messages[:3] == history


def reply(engine, messages) -> str:
    from jaxserve.engine.tokenization import encode_chat

    _, ids = encode_chat(engine.tokenizer, messages, engine.loaded.config.vocab_size)
    engine.add_request(
        f"oracle-{len(messages)}-{messages[-1]['content']}", ids, SamplingParams(temperature=0, max_tokens=6)
    )
    return engine.generate_all()[-1].outputs[0].text


# -- what --seed and --enforce-eager do ---------------------------------------------------------


def test_seed_makes_unseeded_requests_repeat_on_a_fresh_engine(tiny_llama):
    def sample_twice(seed):
        engine = LLMEngine(tiny_llama, EngineConfig(max_num_seqs=2, warm_up=False, seed=seed))
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        for i in range(2):
            engine.add_request(str(i), [5, 6, 7], params)
        done = {o.request_id: o.outputs[0].token_ids for o in engine.generate_all() if o.finished}
        return done["0"], done["1"]

    first, second = sample_twice(7), sample_twice(7)
    assert first == second  # the same requests in the same order: the same samples
    assert first[0] != first[1]  # yet each request draws its own seed
    assert sample_twice(8) != first


def test_enforce_eager_compiles_nothing_at_start_up(tiny_llama):
    """Programs are counted in the runner's jitted step functions (the process-wide compile
    count also sees other engines, and the persistent cache hides compiles)."""
    flags = model_engine_kwargs(serve_args(["--enforce-eager"]))
    assert flags["warm_up"] is False and model_engine_kwargs(serve_args([]))["warm_up"] is True
    config = dict(max_num_seqs=2, max_num_batched_tokens=64)
    eager = LLMEngine(tiny_llama, EngineConfig(**config, warm_up=flags["warm_up"]))
    assert programs(eager) == 0
    eager.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    eager.generate_all()
    warmed = LLMEngine(tiny_llama, EngineConfig(**config))
    assert programs(warmed) >= len(warmed.runner.buckets) + 2 * len(warmed.runner.row_buckets)
    assert 0 < programs(eager) < programs(warmed)  # what the request needed, on first use


def programs(engine) -> int:
    """The step programs an engine's runner holds compiled (its body and head's jit caches)."""
    return engine.runner._body._cache_size() + engine.runner._head._cache_size()


def test_a_prompt_given_as_a_flag_gets_a_clear_error_not_a_traceback():
    """`--prompt TEXT` is an abbreviation of --prompts-file to argparse; a prompts file that
    does not exist is a usage error that says how to give a prompt."""
    with pytest.raises(SystemExit) as exited:
        generate.read_prompts(generate.parse_args(["--prompt", "The capital of France is"]))
    want = "error: --prompts-file 'The capital of France is' is not a file; to give one prompt, pass it as the last"
    assert str(exited.value).startswith(want)
