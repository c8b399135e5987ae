"""`python -m api` flags, without starting a model."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from api.__main__ import main, parse_args
from api.server import _reply_parsers, default_model_name
from jaxserve.flags import parse_bytes


def test_sizes():
    assert parse_bytes("67108864") == 64 << 20
    assert parse_bytes("64MiB") == parse_bytes("64m") == 64 << 20
    assert parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes("80GB") == 80 * 10**9  # decimal, as devices' data sheets count
    for bad in ("", "lots", "12 parsecs", "-1GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_defaults_and_flags(monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    args = parse_args([])
    assert (args.host, args.port, args.api_key, args.model, args.max_waiting) == ("127.0.0.1", 8000, None, None, None)
    assert (args.kv_cache_memory, args.gpu_memory_utilization) == (None, None)  # the engine picks by device
    assert (args.kv_cache_dtype, args.attention_backend, args.matmul_backend) == ("auto", None, None)
    assert (args.max_request_sequences, args.max_request_body_bytes) == (256, 32 << 20)
    assert not args.enable_prompt_tokens_details  # off, as in vLLM: cached_tokens reveals others' prefixes
    assert parse_args(["--enable-prompt-tokens-details"]).enable_prompt_tokens_details
    args = parse_args(["--max-request-sequences", "8", "--max-request-body-bytes", "1MiB"])
    assert (args.max_request_sequences, args.max_request_body_bytes) == (8, 1 << 20)
    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env")
    args = parse_args(["--max-num-seqs", "4", "--kv-cache-memory", "256MiB", "--max-waiting", "8", "--port", "0"])
    assert (args.max_num_seqs, args.kv_cache_memory, args.max_waiting, args.port) == (4, 256 << 20, 8, 0)
    assert args.api_key == "from-env"


def test_model_names(tmp_path):
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"")
    folder = tmp_path / "Qwen3-0.6B"
    folder.mkdir()
    assert default_model_name(SimpleNamespace(loaded=SimpleNamespace(source=str(gguf)))) == "SmolLM2-135M-Instruct"
    assert default_model_name(SimpleNamespace(loaded=SimpleNamespace(source=str(folder)))) == "Qwen3-0.6B"


def test_parser_names_are_checked_before_the_model_loads(capsys):
    for flags, named in (
        (["--tool-call-parser", "nope"], "hermes"),
        (["--reasoning-parser", "nope"], "qwen3"),
        (["--tool-parser-plugin", "/no/such/plugin.py"], "not a file"),
    ):
        assert main([*flags, "--model", "/no/such/model"]) == 2  # the model path is never reached
        assert named in capsys.readouterr().err


def test_auto_tool_choice_takes_the_parser_the_template_shows():
    hermes = "{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}"
    tools, reasoning = _reply_parsers(None, hermes, True, None, None)
    assert tools.name == "hermes" and reasoning is None
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        _reply_parsers(None, plain, True, None, None)
    tools, reasoning = _reply_parsers(None, plain, True, "pythonic", "deepseek_r1")
    assert (tools.name, reasoning.name) == ("pythonic", "deepseek_r1")
