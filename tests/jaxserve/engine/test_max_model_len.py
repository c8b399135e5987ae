"""--max-model-len past the model's own length (max_position_embeddings) is refused unless
allowed (vLLM's rule: here allow_long_max_model_len, --allow-long-max-model-len or
$JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN=1); within it, a length the KV cache cannot hold is
capped to the cache with a warning that says what to change. The tiny Llama's length is 256."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest

from api.__main__ import parse_args
from jaxserve.engine import LLM, EngineConfig, LLMEngine
from jaxserve.engine.config import ALLOW_LONG_MAX_MODEL_LEN_ENV
from tests.api.conftest import REPO

SMALL = dict(max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,), num_blocks=80, warm_up=False)


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)


def test_past_the_models_length_is_refused_saying_how_to_allow_it(tiny_llama):
    assert tiny_llama.config.max_position_embeddings == 256
    with pytest.raises(ValueError) as refused:
        LLMEngine(tiny_llama, EngineConfig(max_model_len=257, **SMALL))
    message = str(refused.value)
    assert "max_model_len 257 is longer than the model's 256" in message
    assert "--allow-long-max-model-len" in message and ALLOW_LONG_MAX_MODEL_LEN_ENV in message
    assert LLMEngine(tiny_llama, EngineConfig(max_model_len=256, **SMALL)).max_model_len == 256  # the model's own
    assert LLMEngine(tiny_llama, EngineConfig(**SMALL)).max_model_len == 256  # the default


def test_allowed_by_the_field_or_the_environment(tiny_llama, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.builder"):
        engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=1000, allow_long_max_model_len=True, **SMALL))
    assert engine.max_model_len == 1000
    assert "max_model_len 1000 is longer than the model's 256 (allowed)" in caplog.text
    for value, allowed in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, value)
        if allowed:
            assert LLMEngine(tiny_llama, EngineConfig(max_model_len=1000, **SMALL)).max_model_len == 1000
        else:
            with pytest.raises(ValueError, match="longer than the model's 256"):
                LLMEngine(tiny_llama, EngineConfig(max_model_len=1000, **SMALL))


def test_within_the_model_but_past_the_cache_is_capped_with_a_warning(tiny_llama, caplog):
    # 5 blocks of 16: the null block and 4 more, 64 tokens; 200 tokens do not fit.
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.builder"):
        engine = LLMEngine(tiny_llama, EngineConfig(**{**SMALL, "num_blocks": 5}, max_model_len=200))
    assert engine.max_model_len == 64
    assert "cannot hold one sequence of max_model_len 200 tokens" in caplog.text
    assert "using max_model_len 64: for the full length give the cache more memory" in caplog.text


def test_the_library_refuses_it_before_reading_the_weights(tiny_llama_dir, tmp_path):
    config_only = tmp_path / "config-only"  # no weights: a refusal from them would come later
    config_only.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", config_only / "config.json")
    with pytest.raises(ValueError, match="max_model_len 99999999 is longer than the model's 256"):
        LLM(str(config_only), max_model_len=99999999)


def test_the_flag_parses_into_the_engine_setting():
    assert parse_args([]).allow_long_max_model_len is False
    args = parse_args(["--max-model-len", "1000", "--allow-long-max-model-len"])
    assert (args.max_model_len, args.allow_long_max_model_len) == (1000, True)


def test_the_server_refuses_it_before_loading(tiny_llama_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "api", "--model", str(tiny_llama_dir), "--max-model-len", "99999999", "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: max_model_len 99999999 is longer than the model's 256" in proc.stderr
    assert "--allow-long-max-model-len" in proc.stderr
