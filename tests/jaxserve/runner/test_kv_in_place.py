"""The KV cache is donated to every step and updated in place, at any cache size: no
program copies it (a copy would cost time that grows with --kv-cache-memory). Also with
one KV head per device (a multi-query model, or heads split by tensor parallelism), where
XLA once chose a layout of its own for the written cache and copied it twice a step."""

import re

import jax
import numpy as np
import pytest

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.weights import load_model
from scheduler import SamplingParams
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_mqa(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-mqa")
    make_tiny_model("llama-tied-mqa-llama3rope", folder)  # one KV head
    return load_model(str(folder), use_cache=False, progress=False)


def cache_shaped_copies(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """Copy-like instructions whose result has the cache's shape (its page-folded form too)."""
    folded = (shape[0] * shape[1], *shape[2:])
    dims = {",".join(map(str, s)) for s in (shape, folded)}
    lines = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]+)\]\S* (copy|fusion|transpose)\(", line)
        if m and m.group(1) in dims and ("copy" in line.split("=")[0] or m.group(2) != "fusion"):
            lines.append(line.strip()[:160])
    return lines


@pytest.mark.parametrize(
    "model,tp,num_blocks,kv_cache_dtype",
    [
        ("tiny_llama", 1, 64, "auto"),
        ("tiny_llama", 1, 4096, "auto"),
        ("tiny_llama", 1, 4096, "fp8"),
        ("tiny_mqa", 1, 4096, "auto"),
        ("tiny_mqa", 1, 4096, "int8"),
        ("tiny_llama", 2, 4096, "auto"),
    ],
)
def test_steps_update_the_cache_in_place(request, model, tp, num_blocks, kv_cache_dtype):
    engine = LLMEngine(
        request.getfixturevalue(model),
        EngineConfig(
            max_num_seqs=4,
            max_num_batched_tokens=16,
            token_buckets=(8, 16),
            block_size=4,
            num_blocks=num_blocks,
            max_model_len=64,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tp,
        ),
    )
    runner = engine.runner

    def buffers():
        return [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(runner.kv) for s in x.addressable_shards]

    pointers = buffers()
    assert len(pointers) == (2 if kv_cache_dtype == "auto" else 4) * tp
    engine.add_request(
        "a", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=6, n=2, seed=1, ignore_eos=True)
    )
    batches = []
    dispatch = runner.dispatch
    runner.dispatch = lambda batch, *rest: (batches.append(batch), dispatch(batch, *rest))[1]
    engine.generate_all()
    assert any(b.block_copies for b in batches), "the workload should copy a block (n=2 forks)"
    # The same buffers after every step, copy-on-write copies included.
    assert buffers() == pointers
    # And no compiled program copies the cache (each device's part of it).
    shapes = [x.addressable_shards[0].data.shape for x in jax.tree.leaves(runner.kv)]
    assert min(shape[3 if len(shape) == 5 else 2] for shape in shapes) == (1 if model == "tiny_mqa" or tp > 1 else 2)
    for batch in batches:
        inputs, pending = runner.pad_inputs(batch, *runner.bucket_for(batch.num_tokens))
        hlo = runner._body.lower(runner.params, runner.kv, inputs, pending, runner.last_tokens).compile().as_text()
        assert "input_output_alias" in hlo
        assert all(cache_shaped_copies(hlo, shape) == [] for shape in shapes)
    pairs = np.zeros((runner.max_num_seqs, 2), np.int32)
    hlo = runner._copy_blocks.lower(runner.kv, pairs).compile().as_text()
    assert all(cache_shaped_copies(hlo, shape) == [] for shape in shapes)
