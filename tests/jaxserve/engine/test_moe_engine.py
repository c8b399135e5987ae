"""A mixture-of-experts model keeps the engine's promises: batched, chunked, preempted and
prefix-cached runs give each request the tokens it gets alone, with nothing compiled after
warm-up. Every MoE family runs here (tests/tiny_models.py): routing is per token, so which
other tokens share a step must not change a token's experts or their outputs."""

import pytest

from jaxserve.weights import load_model
from tests.jaxserve.engine.test_engine import engine, run_alone, run_batched, workload
from tests.tiny_models import make_tiny_model

MOE_MODELS = ["mixtral", "qwen2-moe", "qwen3-moe"]


@pytest.fixture(scope="module", params=MOE_MODELS)
def tiny_moe(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, folder)
    loaded = load_model(str(folder), use_cache=False, progress=False)
    prompts, params = workload(count=16)
    alone = run_alone(engine(loaded, enable_prefix_caching=False), prompts, params)
    return loaded, prompts, params, alone


def test_batched_and_chunked_equal_alone_with_no_compile_after_warm_up(tiny_moe):
    loaded, prompts, params, alone = tiny_moe
    eng = engine(loaded)
    compiles_after_warm_up = eng.compilations
    assert run_batched(eng, prompts, params) == alone
    assert eng.compilations == compiles_after_warm_up, "a program was compiled after warm-up"
    chunked = engine(loaded, long_prefill_token_threshold=5, max_num_batched_tokens=16)
    assert run_batched(chunked, prompts, params) == alone


def test_preemption_equals_alone(tiny_moe):
    loaded, prompts, params, alone = tiny_moe
    eng = engine(loaded, num_blocks=24)  # 23 blocks of 4 tokens for 8 running sequences
    assert run_batched(eng, prompts, params) == alone
    assert eng.scheduler.num_preemptions > 0


def test_prefix_caching_equals_alone(tiny_moe):
    loaded = tiny_moe[0]
    system = list(range(10, 30))  # a 20-token shared system prompt: 5 full blocks
    prompts, params = workload(seed=1, count=8, shared_prefix=system)
    want = run_alone(engine(loaded, enable_prefix_caching=False), prompts, params)
    eng = engine(loaded)
    assert run_batched(eng, prompts, params) == want
    assert eng.scheduler.prefix_cache_hits >= 5 * 4 * 4, "later requests should reuse the system prompt's blocks"
