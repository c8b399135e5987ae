"""The step profile charges the device's time to the right model parts and counts steps.

Oracles: the parts come from the compiled program's own HLO metadata, so each projection,
the attention, the KV write and the LM head must each own some op of a real step; the
profiler's step count must equal the steps the engine ran. No timing is asserted.
"""

import collections

import pytest

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.engine.profiling import PARTS, StepProfiler, device_breakdown, device_report, op_parts, padding
from scheduler import SamplingParams

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(1, 8, 16), block_size=4, max_model_len=64)


@pytest.fixture(scope="module")
def profiled(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig(**CONFIG))
    engine.profiler = StepProfiler()
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return engine, steps


def test_every_model_part_owns_ops_of_the_compiled_step(profiled):
    engine, _ = profiled
    runner = engine.runner
    (shape, batch), *_ = engine.profiler.examples.items()
    inputs, pending = runner.pad_inputs(batch, *runner.bucket_for(batch.num_tokens))
    hlo = runner._body.lower(runner.params, runner.kv, inputs, pending, runner.last_tokens).compile().as_text()
    owned = set(op_parts(hlo).values())
    assert {"embed", "norm", "qkv_proj", "kv_write", "attention", "o_proj", "mlp"} <= owned
    assert owned <= {*PARTS, "other"}


def test_device_breakdown_times_each_part_of_a_replayed_step(profiled):
    engine, _ = profiled
    decode = next(b for (tokens, seqs), b in engine.profiler.examples.items() if tokens == seqs)
    ms = device_breakdown(engine.runner, decode, repeats=2)
    for part in ("qkv_proj", "attention", "mlp", "lm_head", "sampler"):
        assert ms.get(part, 0) > 0, (part, ms)


def test_profiler_counts_every_dispatched_step(profiled):
    engine, steps = profiled
    profiler = engine.profiler
    assert profiler.steps == sum(profiler.shapes.values()) <= steps
    # Each request runs its 5 prompt tokens and feeds back 5 of its 6 sampled tokens.
    assert sum(tokens * count for (tokens, _), count in profiler.shapes.items()) == 3 * (5 + 5)
    idle, span = profiler.device_idle()
    assert 0 <= idle <= span
    assert f"steps: {profiler.steps};" in profiler.table()
    assert "| attention" in device_report(engine.runner, profiler)


def test_padding_counts_the_work_each_bucket_adds(profiled):
    runner = profiled[0].runner  # token buckets 1, 8, 16; row buckets 1, 2, 4
    shapes = collections.Counter({(3, 3): 2, (9, 2): 1})  # two decodes of 3 (8 tokens, 4 rows), a 9-token step
    assert padding(runner, shapes) == {"all": (2 * 8 + 16) / (2 * 3 + 9), "decode": 8 / 3, "rows": (2 * 4 + 2) / 8}
