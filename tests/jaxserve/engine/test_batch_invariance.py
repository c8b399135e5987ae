"""Batch invariance (--batch-invariant): a request's logprobs do not depend on its batch.

Oracle: the same request run alone on an engine with no chunking and no cache pressure.
Over random batch mates, the target's place among them, a prefill split into chunks
(long_prefill_token_threshold and a small token budget), prefix-cache hits (mates sharing
its first blocks, run before it) and preemption (a KV cache too small for the batch), the
target's tokens, its output logprobs (the sampled token's and the top 20 of a 97-token
vocabulary, per step) and its prompt logprobs (top 20 per position) must be equal with
`==` to the solo run's, in float32 and bfloat16. The logprobs are the logits less one
log-sum-exp per row, so a changed logit shows in them.
"""

import argparse

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.flags import add_model_flags, model_engine_kwargs
from scheduler import SamplingParams

SOLO = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, max_model_len=96, warm_up=False)
# A budget of 32 tokens and chunks of at most 8: prompts split; 36 blocks of 4: mates preempt each other.
BUSY = dict(SOLO, max_num_batched_tokens=32, long_prefill_token_threshold=8, num_blocks=36)
TARGET = SamplingParams(max_tokens=8, temperature=0.0, logprobs=20, prompt_logprobs=20)
TARGET_PROMPT = [1, *np.random.default_rng(7).integers(3, 97, 21).tolist()]


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]):
    """Every request's final output, by id; also returns the engine's preemption count."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def observed(out):
    """What must be bit-stable: tokens, per-step {token: logprob}, per-position prompt {token: logprob}."""
    sample = out.outputs[0]
    prompt = [None if p is None else {t: lp.logprob for t, lp in p.items()} for p in out.prompt_logprobs]
    return sample.token_ids, sample.logprobs, prompt


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(request, tiny_llama_dir):
    from jaxserve.weights import load_model

    loaded = load_model(str(tiny_llama_dir), use_cache=False, progress=False, dtype=request.param)
    solo = LLMEngine(loaded, EngineConfig(**SOLO, batch_invariant=True))
    alone = observed(run(solo, [("target", TARGET_PROMPT, TARGET)])["target"])
    busy = LLMEngine(loaded, EngineConfig(**BUSY, batch_invariant=True))
    return alone, busy


mate = st.tuples(
    st.lists(st.integers(3, 96), min_size=1, max_size=26),  # prompt after BOS
    st.integers(1, 12),  # max_tokens
    st.booleans(),  # starts with the target's first 12 tokens (3 blocks: a prefix hit for whichever runs later)
)


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mates=st.lists(mate, min_size=0, max_size=6), where=st.integers(0, 6), warm_prefix=st.booleans())
def test_target_logprobs_equal_its_solo_run(engines, mates, where, warm_prefix):
    alone, busy = engines
    requests = []
    for i, (tail, max_tokens, shares_prefix) in enumerate(mates):
        prompt = (TARGET_PROMPT[:12] if shares_prefix else [1]) + tail
        requests.append((f"mate-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    requests.insert(min(where, len(requests)), ("target", TARGET_PROMPT, TARGET))
    if warm_prefix:  # the target's first blocks cached by an earlier request: its prefill starts at a hit
        run(busy, [("warm", TARGET_PROMPT[:13], SamplingParams(max_tokens=1))])
    got = observed(run(busy, requests)["target"])
    assert got[0] == alone[0]
    assert got[1] == alone[1], "output logprobs changed with the batch"
    assert got[2] == alone[2], "prompt logprobs changed with the batch"


def test_busy_engine_chunks_hits_and_preempts(engines):
    """The busy engine's config does produce what the property claims to cover."""
    _, busy = engines
    sched = busy.scheduler
    preempted_before = sched.num_preemptions
    mates = [(f"p{i}", [1, *range(3 + i, 29 + i)], SamplingParams(max_tokens=12)) for i in range(6)]
    run(busy, [("target", TARGET_PROMPT, TARGET), *mates])
    assert sched.num_preemptions > preempted_before


def test_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    assert model_engine_kwargs(parser.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert model_engine_kwargs(parser.parse_args([]))["batch_invariant"] is False


def test_prefill_equals_decode(engines):
    """A token's logprobs are the same computed in a prefill chunk as in a decode step: the
    target's generated tokens, fed back as a prompt, get the prompt logprobs that the decode
    steps reported (the top 20 of each position, and the sampled token's)."""
    (tokens, steps, _), busy = engines  # the solo run: step 0 from its prefill, the rest decode steps
    again = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=20)
    out = run(busy, [("replay", TARGET_PROMPT + tokens[:-1], again)])["replay"]
    replayed = observed(out)[2][len(TARGET_PROMPT) :]
    assert len(replayed) == len(tokens) - 1
    # position len(prompt) + j of the replay is generated token j given what came before it
    for step, (decoded, prefilled) in enumerate(zip(steps, replayed)):
        assert prefilled == decoded, f"step {step}"  # both: the top 20 and the (greedy) token itself


def test_refused_where_it_cannot_be_kept(tiny_llama, tmp_path):
    """No silent fallback: an attention or a layer the fixed order does not cover is an error."""
    from jaxserve.weights import load_model
    from tests.tiny_models import make_tiny_model

    with pytest.raises(ValueError, match="batch invariance cannot be kept: .*'reference'"):
        LLMEngine(tiny_llama, EngineConfig(**SOLO, batch_invariant=True, attention_backend="reference"))
    make_tiny_model("mixtral", tmp_path)
    moe = load_model(str(tmp_path), use_cache=False, progress=False, quantization="fp8")
    with pytest.raises(ValueError, match="batch invariance cannot be kept: the model is quantized"):
        LLMEngine(moe, EngineConfig(**SOLO, batch_invariant=True))


# Hidden size 576 (SmolLM2-135M's): XLA's CPU RMSNorm sums such a row in another order from 8
# rows on, so a decode step of 8+ sequences moved the target's logits by an ulp until the final
# norm and the logprob tables ran in fixed row blocks (jaxserve.model.fixed_order).
WIDE = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_hidden_layers=1)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    from jaxserve.weights import load_model
    from tests.tiny_models import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-wide")
    make_tiny_model("llama", folder, **WIDE)
    return load_model(str(folder), use_cache=False, progress=False)


def test_many_sequences_in_a_step(wide_model):
    """Twenty mates decode beside the target, sampling with seeds and asking for logprobs: its
    steps hold 8 to 21 rows, so the head and sampler run one block or two (of 16 rows)."""
    config = EngineConfig(**dict(SOLO, max_num_seqs=32, max_num_batched_tokens=1024), batch_invariant=True)
    engine = LLMEngine(wide_model, config)
    alone = observed(run(engine, [("alone", TARGET_PROMPT, TARGET)])["alone"])
    rng = np.random.default_rng(3)
    sampled = [SamplingParams(max_tokens=8, temperature=0.7, seed=i, logprobs=3) for i in range(20)]
    mates = [(f"m{i}", [1, *rng.integers(3, 97, 5 + i).tolist()], params) for i, params in enumerate(sampled)]
    got = observed(run(engine, [("target", TARGET_PROMPT, TARGET), *mates])["target"])
    assert got == alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_verify_equals_decode(tiny_llama_dir, dtype):
    """A token's logprobs are the same when an n-gram draft of it is verified as when it is decoded:
    the target with speculation (drafts accepted) reports the plain engine's tokens and logprobs."""
    from jaxserve.weights import load_model

    loaded = load_model(str(tiny_llama_dir), use_cache=False, progress=False, dtype=dtype)
    prompt = [1, *[5, 6, 7, 8, 9] * 6]  # repetitive: the n-gram proposer finds drafts
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=20)
    ngram = dict(
        method="ngram",
        num_speculative_tokens=4,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        disable_by_measured_cost=False,
    )
    plain = LLMEngine(loaded, EngineConfig(**SOLO, batch_invariant=True))
    speculative = LLMEngine(loaded, EngineConfig(**SOLO, batch_invariant=True, speculative_config=ngram))
    expected = run(plain, [("t", prompt, params)])["t"].outputs[0]
    got = run(speculative, [("t", prompt, params)])["t"].outputs[0]
    assert speculative.scheduler.spec_stats.num_accepted_tokens > 0
    assert got.token_ids == expected.token_ids
    assert got.logprobs == expected.logprobs


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "qwen3-moe", "qwen2", "qwen3"])
def test_other_families(name, tmp_path):
    """Mixtures of float experts (a shared expert, dense layers between), Qwen2's q/k/v biases
    and Qwen3's q/k norms: the target beside mates (two sharing its first blocks) on the busy
    engine (chunks, preemption) equals its solo run, and its logprobs are the default mode's to
    float32 rounding (the fixed order is still the model)."""
    from jaxserve.weights import load_model
    from tests.tiny_models import make_tiny_model

    make_tiny_model(name, tmp_path)
    loaded = load_model(str(tmp_path), use_cache=False, progress=False)
    solo = LLMEngine(loaded, EngineConfig(**SOLO, batch_invariant=True))
    alone = observed(run(solo, [("target", TARGET_PROMPT, TARGET)])["target"])
    rng = np.random.default_rng(11)
    mates = [
        (
            f"m{i}",
            (TARGET_PROMPT[:12] if i < 2 else [1]) + rng.integers(3, 97, 4 + 3 * i).tolist(),
            SamplingParams(max_tokens=6),
        )
        for i in range(6)
    ]
    busy = LLMEngine(loaded, EngineConfig(**BUSY, batch_invariant=True))
    got = observed(run(busy, [*mates[:3], ("target", TARGET_PROMPT, TARGET), *mates[3:]])["target"])
    assert got == alone
    tokens, steps, _ = observed(run(LLMEngine(loaded, EngineConfig(**SOLO)), [("d", TARGET_PROMPT, TARGET)])["d"])
    assert tokens == alone[0]
    for step, (mine, theirs) in enumerate(zip(alone[1], steps)):
        assert mine.keys() == theirs.keys(), f"step {step}: another top 20"
        np.testing.assert_allclose([mine[t] for t in mine], [theirs[t] for t in mine], rtol=0, atol=1e-4)
