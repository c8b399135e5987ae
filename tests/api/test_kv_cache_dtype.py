"""`python -m api --kv-cache-dtype int8`: the flag reaches the engine, the server answers
with the real openai client, and /metrics reports the cache (vLLM's cache_config_info)."""

from __future__ import annotations

import pytest

from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import num_blocks_for_memory
from tests.api.conftest import run_server


def test_server_with_an_int8_cache(tiny_folder, tmp_path):
    args = [
        "--model",
        str(tiny_folder),
        "--kv-cache-dtype",
        "int8",
        "--kv-cache-memory",
        "1MiB",
        "--block-size",
        "4",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--max-model-len",
        "64",
    ]
    with run_server(tmp_path, *args) as server:
        out = server.client().completions.create(
            model=server.client().models.list().data[0].id, prompt="the cat", max_tokens=4, temperature=0
        )
        assert out.usage.completion_tokens == 4
        m = server.metrics()
        log = server.log.read_text()
    info = [k for k in m if k.startswith("jaxserve:cache_config_info")]
    assert len(info) == 1 and 'cache_dtype="int8"' in info[0] and 'block_size="4"' in info[0]
    # The blocks of 1 MiB of int8 codes and a float32 scale per token and head: 4 D / (D + 4)
    # times those of the float32 cache (3.2x at this model's head_dim 16, 3.8x at 64).
    cfg = ModelConfig.from_json_file(tiny_folder / "config.json")
    blocks = num_blocks_for_memory(cfg, 1 << 20, 4, "int8")
    assert m["jaxserve:kv_cache_total_blocks"] == blocks - 1
    ratio = 4 * cfg.head_dim / (cfg.head_dim + 4)
    assert blocks / num_blocks_for_memory(cfg, 1 << 20, 4, "float32") == pytest.approx(ratio, rel=0.01)
    assert "int8 with float32 scales per token and KV head" in log
