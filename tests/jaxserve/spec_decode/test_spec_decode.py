"""Speculative decoding must not change greedy output, token for token.

The oracle is the same workload run without speculation. Two proposers drive the
verification: an oracle proposer that knows the true greedy continuation and corrupts
one draft position chosen per step (so every run both accepts and rejects drafts at
known places, and the acceptance counters can be predicted exactly), and the real n-gram
proposer. Runs are batched, chunked, preempted and prefix-cached, with stop tokens and
strings, max_tokens and min_tokens, logprobs, penalties, n > 1 and streaming.
"""

import json

import numpy as np
import pytest

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.spec_decode import SpeculativeConfig
from jaxserve.spec_decode.proposers import decoding
from jaxserve.spec_decode.step_costs import StepCosts
from scheduler import SamplingParams

VOCAB = 97  # tests/tiny_models.py
K = 4
# Every draft verified (the drafting decision by measured step times, a matter of timing, off).
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_measured_cost": False,
}


def workload(seed=0, count=24, shared_prefix=(), **overrides):
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        piece = rng.integers(3, VOCAB, rng.integers(2, 12)).tolist()
        prompts.append(list(shared_prefix) + piece * int(rng.integers(1, 4)))  # repeats: n-gram matches
    params = []
    for _ in range(count):
        fields = {"temperature": 0, "max_tokens": int(rng.integers(1, 30)), "ignore_eos": True, **overrides}
        fields["min_tokens"] = min(fields.get("min_tokens", 0), fields["max_tokens"])
        params.append(SamplingParams(**fields))
    return prompts, params


def engine(loaded, spec=None, **kw):
    cfg = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=4,
        num_blocks=256,
        max_model_len=128,
        token_buckets=(4, 16, 64),
    )  # few programs to compile
    return LLMEngine(loaded, EngineConfig(**{**cfg, **kw}, speculative_config=spec))


def run(eng, prompts, params, stream=False):
    """Every request at once; the outputs in prompt order, and (stream) each step's deltas."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    final, deltas = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            for c in out.outputs:
                ids, text = deltas.setdefault((out.request_id, c.index), ([], []))
                ids += c.new_token_ids
                text.append(c.new_text)
            if out.finished:
                final[out.request_id] = out
    eng.scheduler.check_integrity()
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.config.num_blocks - 1, "blocks leaked"
    outs = [final[str(i)] for i in range(len(prompts))]
    if stream:
        for out in outs:
            for c in out.outputs:
                ids, text = deltas[(out.request_id, c.index)]
                assert ids == c.token_ids and "".join(text) == c.text, "streamed deltas differ from the output"
    return outs


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


class OracleProposer:
    """Proposes the true greedy continuation with one position corrupted per step (or none)."""

    overlaps = False  # drafts for every step: the serial loop

    def __init__(self, config: SpeculativeConfig, truth: dict[tuple, list[int]]):
        self.config, self.truth = config, truth
        self.expected_accepted = 0
        self.calls = 0
        self.per_prompt: dict[tuple, list[int]] = {}  # [verifications, draft tokens, accepted] of each request
        self.trimmed = 0  # proposals the adaptive draft length cut short

    def propose(self, running):
        for req in decoding(running, self.config):
            self.calls += 1
            done = req.num_output_tokens
            room = req.sampling_params.max_tokens - done - 1
            drafts = list(self.truth[tuple(req.prompt_token_ids)][done : done + min(K, room)])
            if req.max_drafts is not None and req.max_drafts < len(drafts):  # the adaptive draft length
                drafts = drafts[: req.max_drafts]
                self.trimmed += 1
            bad = (done * 7 + len(req.prompt_token_ids)) % (K + 2)  # K or K+1: nothing corrupted
            if bad < len(drafts):
                drafts[bad] = (drafts[bad] + 1) % VOCAB
            req.spec_token_ids = drafts
            accepted = bad if bad < len(drafts) else len(drafts)
            self.expected_accepted += accepted
            counts = self.per_prompt.setdefault(tuple(req.prompt_token_ids), [0, 0, 0])
            for i, n in enumerate((1, len(drafts), accepted)):
                counts[i] += n

    def draft_probs(self, batch):
        return None

    def follow(self, batch, handle):
        pass


def with_oracle(eng, prompts, plain_outs):
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain_outs)}
    eng.proposer = OracleProposer(eng.config.speculative_config, truth)
    return eng.proposer


@pytest.fixture(scope="module")
def plain(tiny_llama):
    prompts, params = workload()
    return run(engine(tiny_llama), prompts, params)


@pytest.mark.parametrize("setting", ["batched", "chunked", "preempted", "adaptive"])
def test_greedy_with_oracle_drafts_equals_plain(tiny_llama, plain, setting):
    kw = {
        "batched": {},
        "chunked": dict(long_prefill_token_threshold=5, max_num_batched_tokens=16),
        "preempted": dict(num_blocks=30),
        "adaptive": {},
    }[setting]
    prompts, params = workload()
    # adaptive: each request verifies as many of the oracle's drafts as its acceptance pays for
    spec = {**NGRAM, "draft_token_cost": 0.15} if setting == "adaptive" else NGRAM
    eng = engine(tiny_llama, spec, **kw)
    oracle = with_oracle(eng, prompts, plain)
    compiles = eng.compilations
    outs = run(eng, prompts, params, stream=True)
    assert tokens(outs) == tokens(plain)
    assert eng.compilations == compiles, "a program was compiled after warm-up"
    stats = eng.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "the run must both accept and reject drafts"
    if setting == "adaptive":  # lengths below k were chosen
        assert oracle.trimmed > 0
    if setting in ("batched", "adaptive"):  # every proposal was verified as proposed
        assert stats.num_accepted_tokens == oracle.expected_accepted
        assert stats.num_drafts == oracle.calls
        assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
        for prompt, out in zip(prompts, outs):  # and each request's own counters (RequestMetrics)
            got = out.metrics.spec_decoding
            want = oracle.per_prompt.get(tuple(prompt))
            assert (got and [got.num_drafts, got.num_draft_tokens, got.num_accepted_tokens]) == want
            assert got is None or sum(got.accepted_per_position) == got.num_accepted_tokens
        assert any(out.metrics.spec_decoding for out in outs)
    if setting == "preempted":
        assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("measured", [False, True], ids=["every-draft", "measured-cost"])
def test_greedy_with_ngram_drafts_equals_plain(tiny_llama, plain, measured):
    prompts, params = workload()
    eng = engine(tiny_llama, {**NGRAM, "disable_by_measured_cost": measured})
    assert tokens(run(eng, prompts, params)) == tokens(plain)
    stats = eng.scheduler.spec_stats
    if not measured:  # with the measured cost, how many are verified is a matter of timing
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


class NeverPays(StepCosts):
    """Step times kept as measured; drafts never verified."""

    def __init__(self, bucket):
        super().__init__(bucket)
        self.asked, self.timed = 0, []

    def observe(self, verified, waited, tokens, seconds):
        self.timed.append((verified, tokens))
        super().observe(verified, waited, tokens, seconds)

    def drafts_pay(self, step, rows, drafting, waited):
        self.asked += 1
        return False


def test_declined_drafts_run_as_plain_decoding(tiny_llama, plain):
    """Where drafts do not pay, none is verified and the loop overlaps as without speculation."""
    prompts, params = workload()
    eng = engine(tiny_llama, {**NGRAM, "disable_by_measured_cost": True})
    eng.step_costs = costs = NeverPays(eng._token_bucket)
    seen = watch_in_flight(eng)
    assert tokens(run(eng, prompts, params)) == tokens(plain)
    assert costs.asked > 0 and eng.scheduler.spec_stats.num_drafts == 0
    # Pure decode steps only (one token per row, at most max_num_seqs rows), none verifying.
    assert costs.timed and all(not verified and tokens <= 8 for verified, tokens in costs.timed)
    without = engine(tiny_llama)
    seen_without = watch_in_flight(without)
    run(without, prompts, params)
    assert [len(batches) for batches in seen] == [len(batches) for batches in seen_without]

    # Penalties make every step wait for the one before, so drafts are proposed on known
    # tokens: they are declined all the same.
    prompts, params = workload(seed=3, count=12, repetition_penalty=1.3)
    want = run(engine(tiny_llama), prompts, params)
    eng = engine(tiny_llama, {**NGRAM, "disable_by_measured_cost": True})
    eng.step_costs = NeverPays(eng._token_bucket)
    assert tokens(run(eng, prompts, params)) == tokens(want)
    assert eng.scheduler.spec_stats.num_drafts == 0


def watch_in_flight(eng) -> list[list]:
    """For each schedule() of `eng`'s scheduler, the batches then scheduled and not yet
    updated (in flight, with the overlapped loop)."""
    in_flight, seen = [], []
    schedule, update = eng.scheduler.schedule, eng.scheduler.update

    def watched_schedule():
        seen.append(list(in_flight))
        batch = schedule()
        if batch is not None:
            in_flight.append(batch)
        return batch

    def watched_update(batch, *args):
        if batch is not None:
            in_flight[:] = [b for b in in_flight if b is not batch]
        return update(batch, *args)

    eng.scheduler.schedule, eng.scheduler.update = watched_schedule, watched_update
    return seen


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_steps_without_drafts_overlap(tiny_llama, adaptive):
    """The n-gram proposer keeps nothing on the device, so a step is scheduled while the one
    before it runs, unless that one verified drafts or a request is about to draft; the
    tokens stay those of plain decoding."""
    rng = np.random.default_rng(5)
    prompts = [rng.permutation(np.arange(3, VOCAB))[: int(rng.integers(6, 20))].tolist() for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] * len(prompts)
    want = run(engine(tiny_llama), prompts, params)
    # Prompts without a repeated token: lookups of 2 tokens and more first find nothing,
    # until the model's output repeats itself.
    spec = {**NGRAM, "prompt_lookup_min": 2, **({"draft_token_cost": 0.15} if adaptive else {})}
    eng = engine(tiny_llama, spec)
    seen = watch_in_flight(eng)
    assert tokens(run(eng, prompts, params)) == tokens(want)
    overlapped = [batches for batches in seen if batches]
    assert all(len(batches) == 1 for batches in overlapped)
    assert all(batches[0].verify is None for batches in overlapped), "a step that verified drafts ran on"
    assert len(overlapped) > len(seen) // 4, (len(overlapped), len(seen))
    stats = eng.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0

    serial = engine(tiny_llama, spec, async_scheduling=False)
    seen = watch_in_flight(serial)
    assert tokens(run(serial, prompts, params)) == tokens(want)
    assert not any(seen)


class SometimesWaitingOracle(OracleProposer):
    """The oracle's drafts in the overlapped loop, asking for the tokens in flight every
    other step: steps after a verification sometimes have no request about to draft."""

    overlaps = True

    def __init__(self, config, truth):
        super().__init__(config, truth)
        self.asked = 0

    def wants_known_tokens(self, running):
        self.asked += 1
        return [(req, K) for req in running] if self.asked % 2 == 0 else []


def test_a_step_that_verified_drafts_is_waited_for(tiny_llama, plain):
    prompts, params = workload()
    eng = engine(tiny_llama, NGRAM)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}
    eng.proposer = oracle = SometimesWaitingOracle(eng.config.speculative_config, truth)
    seen = watch_in_flight(eng)
    assert tokens(run(eng, prompts, params)) == tokens(plain)
    assert oracle.calls > 0 and eng.scheduler.spec_stats.num_accepted_tokens > 0
    overlapped = [batches for batches in seen if batches]
    assert overlapped and all(batches[0].verify is None for batches in overlapped)


def test_prefix_cached_with_drafts_equals_plain(tiny_llama):
    system = list(range(10, 30))  # 5 full blocks shared by every prompt
    prompts, params = workload(seed=1, count=12, shared_prefix=system)
    want = run(engine(tiny_llama, enable_prefix_caching=False), prompts, params)
    eng = engine(tiny_llama, NGRAM)
    with_oracle(eng, prompts, want)
    assert tokens(run(eng, prompts, params)) == tokens(want)
    assert tokens(run(eng, prompts, params)) == tokens(want), "a second run, from the prefix cache"
    assert eng.scheduler.prefix_cache_hits > 5 * 4 * 12


@pytest.mark.parametrize(
    "overrides",
    [
        dict(stop_token_ids=[40, 41, 42, 43, 44, 45]),  # stops in the middle of accepted runs
        dict(min_tokens=8, stop_token_ids=[40, 41, 42, 43, 44, 45]),
        dict(logprobs=3),
        dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
        dict(n=3),
    ],
    ids=["stop-tokens", "min-tokens", "logprobs", "penalties", "n3"],
)
def test_sampling_parameters_with_drafts_equal_plain(tiny_llama, overrides):
    prompts, params = workload(seed=3, count=12, **overrides)
    want = run(engine(tiny_llama), prompts, params)
    eng = engine(tiny_llama, NGRAM)
    with_oracle(eng, prompts, want)
    got = run(eng, prompts, params, stream=True)
    assert tokens(got) == tokens(want)
    assert eng.scheduler.spec_stats.num_accepted_tokens > 0
    if "stop_token_ids" in overrides:
        reasons = [o.outputs[0].finish_reason for o in got]
        assert reasons.count("stop") >= 2, reasons
    if "logprobs" in overrides:
        for g, w in zip(got, want):
            for gl, wl in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert gl.keys() == wl.keys()
                np.testing.assert_allclose(list(gl.values()), [wl[t] for t in gl], atol=2e-4)


def test_stop_strings_with_drafts_equal_plain(tiny_llama_tok):
    words = "the cat sat on a mat and then the dog ran to the cat".split()
    prompts = [" ".join(words[i:] + words[:i]) for i in range(6)]
    base = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in prompts]
    free = run(engine(tiny_llama_tok), prompts, base)
    # A stop string from the middle of each free run's text.
    stops = [o.outputs[0].text.split()[len(o.outputs[0].text.split()) // 2] for o in free]
    params = [p.replace(stop=[s]) for p, s in zip(base, stops)]
    want = run(engine(tiny_llama_tok), prompts, params)
    eng = engine(tiny_llama_tok, NGRAM)
    truth = {tuple(eng.outputs.tokenizer.encode(p)): o.outputs[0].token_ids for p, o in zip(prompts, free)}
    eng.proposer = OracleProposer(eng.config.speculative_config, truth)
    got = run(eng, prompts, params, stream=True)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert tokens(got) == tokens(want)
    assert [o.outputs[0].stop_reason for o in got] == [o.outputs[0].stop_reason for o in want]
    assert sum(o.outputs[0].finish_reason == "stop" for o in got) >= 3


def test_greedy_default_model_with_ngram_equals_plain(default_model):
    """The real n-gram proposer on the real model, on text it copies."""
    prompt = (
        "Repeat the sentence exactly. Sentence: The quick brown fox jumps over the lazy dog near the old "
        "river bank. Repeat:"
    )
    params = SamplingParams(temperature=0, max_tokens=48)
    outs = {}
    for spec in (None, NGRAM):
        eng = LLMEngine(
            default_model,
            EngineConfig(
                max_num_seqs=4,
                max_model_len=256,
                max_num_batched_tokens=64,
                token_buckets=(1, 8, 64),
                speculative_config=spec,
            ),
        )
        eng.add_request("r", prompt, params)
        (out,) = eng.generate_all()
        outs[json.dumps(spec)] = (out.outputs[0].token_ids, eng.scheduler.spec_stats)
    (plain_ids, _), (spec_ids, stats) = outs.values()
    assert spec_ids == plain_ids
    assert stats.num_accepted_tokens >= 8


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"method": "lookahead"}', "method must be one of"),
        ('{"method": "medusa"}', "method medusa needs model"),
        ('{"method": "ngram", "model": "x"}', "method ngram takes no model"),
        ('{"method": "ngram", "speculative_token_tree": "[(0,), (1,)]"}', "proposes one chain"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_max"),
        ('{"method": "ngram", "speculative_tokens": 3}', "unknown speculative config key"),
        ('{"num_speculative_tokens": 3}', "needs a method"),
        ('{"method": "ngram"', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "ngram", "draft_num_layers": 2}', "for method draft_model"),
        ('{"method": "ngram", "draft_token_cost": -1}', "draft_token_cost must be a number"),
        ('{"method": "ngram", "draft_token_cost": "cheap"}', "draft_token_cost must be a number"),
    ],
)
def test_bad_speculative_config_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_disable_by_batch_size(tiny_llama):
    prompts, params = workload(seed=4, count=8)
    want = run(engine(tiny_llama), prompts, params)
    eng = engine(tiny_llama, {**NGRAM, "disable_by_batch_size": 2})
    oracle = with_oracle(eng, prompts, want)
    assert tokens(run(eng, prompts, params)) == tokens(want)
    assert 0 < oracle.calls and eng.scheduler.spec_stats.num_drafts == oracle.calls
    # Only once at most 2 requests were left running did it propose.
    assert oracle.calls < sum(p.max_tokens for p in params) // 2


# -- draft models ---------------------------------------------------------------------------


def draft(num_layers=None, model=None):
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    if num_layers is not None:
        spec["draft_num_layers"] = num_layers
    if model is not None:
        spec["model"] = str(model)
    return spec


def test_full_depth_self_draft_is_always_accepted(tiny_llama, plain):
    """The target as its own draft proposes exactly the target's greedy tokens: only if the
    draft's cache holds what the target's does (prefill, chunks, preemption) is every draft
    accepted."""
    prompts, params = workload()
    eng = engine(tiny_llama, draft(), long_prefill_token_threshold=5, max_num_batched_tokens=16, num_blocks=24)
    assert tokens(run(eng, prompts, params)) == tokens(plain)
    stats = eng.scheduler.spec_stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert eng.scheduler.num_preemptions > 0


def test_self_draft_skipped_by_the_adaptive_length_stays_in_step(tiny_llama, plain):
    """A draft_token_cost so high that requests draft only when they probe (every
    PROBE_EVERY steps): the full-depth self-draft's cache must still follow every token in
    between, so each probe's drafts are all accepted."""
    prompts, params = workload()
    eng = engine(tiny_llama, {**draft(), "draft_token_cost": 10})
    assert tokens(run(eng, prompts, params)) == tokens(plain)
    stats = eng.scheduler.spec_stats
    decode_steps = sum(len(c.token_ids) for o in plain for c in o.outputs)
    assert 0 < stats.num_drafts < decode_steps / 8  # probes only
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_truncated_self_draft_greedy_equals_plain(tiny_llama, plain):
    prompts, params = workload()
    eng = engine(tiny_llama, draft(num_layers=1))
    assert tokens(run(eng, prompts, params, stream=True)) == tokens(plain)
    stats = eng.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_separate_draft_model(tiny_llama, plain, tmp_path):
    """Another model with the same vocabulary (other random weights) as the draft."""
    from tests.tiny_models import make_tiny_model

    make_tiny_model("qwen3", tmp_path, seed=1)
    prompts, params = workload()
    eng = engine(tiny_llama, draft(model=tmp_path))
    assert tokens(run(eng, prompts, params)) == tokens(plain)
    assert eng.scheduler.spec_stats.num_drafts > 0
    # Sampling: seeded requests give the same tokens twice (the drafts' draws are seeded too).
    sampled = [p.replace(temperature=1.0, seed=i) for i, p in enumerate(params)]
    first, second = tokens(run(eng, prompts, sampled)), tokens(run(eng, prompts, sampled))
    assert first == second and first != tokens(plain)


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    from tests.tiny_models import make_tiny_model

    make_tiny_model("llama", tmp_path, vocab_size=101)
    with pytest.raises(ValueError, match="must share a tokenizer"):
        engine(tiny_llama, draft(model=tmp_path), warm_up=False)
