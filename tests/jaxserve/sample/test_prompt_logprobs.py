"""SamplingParams(prompt_logprobs=k): each prompt token's logprob given the tokens before it.

The oracle is Hugging Face transformers on the same tiny weights: log_softmax of its
logits at position p - 1 holds the logprob of prompt token p and its top alternatives.
Chunked prefill, the prefix cache, preemption and speculative decoding must not change
the answer.
"""

import numpy as np
import pytest
import torch

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.engine.outputs import Logprob
from scheduler import SamplingParams

VOCAB = 97  # tests/tiny_models.py
ATOL = 1e-4  # as tests/jaxserve/model/test_model_vs_hf.py compares logits
PROMPTS = [np.random.default_rng(s).integers(3, VOCAB, n).tolist() for s, n in ((0, 41), (1, 7), (2, 23))]


def engine(loaded, **kw):
    # No warm-up: only the programs these few steps use are compiled.
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_blocks=128, max_model_len=96, warm_up=False)
    return LLMEngine(loaded, EngineConfig(**{**cfg, **kw}))


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir):
    """prompt -> float64 [len, V] log_softmax of transformers' logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return {tuple(p): torch.log_softmax(model(torch.tensor([p])).logits[0].double(), -1).numpy() for p in PROMPTS}


def run(eng, requests):
    """requests: (prompt, params); the final RequestOutput of each, in order."""
    for i, (prompt, params) in enumerate(requests):
        eng.add_request(str(i), prompt, params)
    outs = {o.request_id: o for o in eng.generate_all()}
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.config.num_blocks - 1, "blocks leaked"
    return [outs[str(i)] for i in range(len(requests))]


def params(k=None, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 4, "ignore_eos": True, **kw}, prompt_logprobs=k)


def check_against_hf(prompt, prompt_logprobs, k, want):
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry, row = prompt_logprobs[p], want[p - 1]
        token = prompt[p]
        got = entry[token]
        assert isinstance(got, Logprob)
        assert abs(got.logprob - row[token]) <= ATOL, f"position {p}"
        # Its rank: 1 + the tokens HF finds more likely (those within ATOL may go either way).
        assert 1 + np.sum(row > row[token] + ATOL) <= got.rank <= np.sum(row >= row[token] - ATOL), f"position {p}"
        # The top k (the prompt token among them if it is one), ranked as HF ranks them.
        top = sorted((v.rank, t, v.logprob) for t, v in entry.items() if v.rank <= k)
        assert [r for r, _, _ in top] == list(range(1, k + 1)), f"position {p}: top-{k} ranks {top}"
        for rank, t, lp in top:
            assert abs(lp - row[t]) <= ATOL
            assert abs(lp - np.sort(row)[::-1][rank - 1]) <= ATOL, f"position {p}: rank {rank} is not HF's"
        assert set(entry) == {token} | {t for _, t, _ in top}


@pytest.fixture(scope="module")
def eng(tiny_llama):
    return engine(tiny_llama)


@pytest.fixture(scope="module")
def chunked(eng):
    """The prompts batched, each longer one over several 16-token steps, with k = 5, 0 and none."""
    requests = [(PROMPTS[0], params(5)), (PROMPTS[1], params(0)), (PROMPTS[2], params(None)), (PROMPTS[2], params(2))]
    return run(eng, requests), requests


def test_prompt_logprobs_over_chunks_match_hf(chunked, hf_logprobs):
    outs, requests = chunked
    for out, (prompt, p) in zip(outs, requests):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check_against_hf(prompt, out.prompt_logprobs, p.prompt_logprobs, hf_logprobs[tuple(prompt)])


def test_generated_tokens_do_not_change(chunked):
    outs, _ = chunked
    assert outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids  # same prompt, with and without


def test_cached_prefix_gives_the_uncached_answer(eng):
    prompt = PROMPTS[0][::-1]  # in no block cached yet
    (uncached,) = run(eng, [(prompt, params(3))])
    (plain,) = run(eng, [(prompt, params(None))])
    assert plain.num_cached_tokens >= 40, "a request with prompt logprobs still caches its blocks for others"
    (again,) = run(eng, [(prompt, params(3))])
    assert again.num_cached_tokens == 0, "prompt logprobs must compute every position, not take cached blocks"
    assert again.prompt_logprobs == uncached.prompt_logprobs
    assert again.outputs[0].token_ids == uncached.outputs[0].token_ids == plain.outputs[0].token_ids


def test_preemption_does_not_repeat_positions(tiny_llama, hf_logprobs):
    eng = engine(tiny_llama, num_blocks=20, max_num_batched_tokens=8)  # 19 blocks of 4: too few for all three
    requests = [(p, params(2, max_tokens=24)) for p in PROMPTS]
    outs = run(eng, requests)
    assert eng.scheduler.num_preemptions > 0
    for out, (prompt, _p) in zip(outs, requests):
        check_against_hf(prompt, out.prompt_logprobs, 2, hf_logprobs[tuple(prompt)])


def test_n_samples_share_one_list(eng, hf_logprobs):
    (out,) = run(eng, [(PROMPTS[1], params(1, n=3, temperature=1.0, seed=7))])
    assert len(out.outputs) == 3
    check_against_hf(PROMPTS[1], out.prompt_logprobs, 1, hf_logprobs[tuple(PROMPTS[1])])


def test_with_speculative_decoding(tiny_llama, eng, hf_logprobs):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    (out,) = run(engine(tiny_llama, speculative_config=spec), [(PROMPTS[0], params(4, max_tokens=12))])
    (plain,) = run(eng, [(PROMPTS[0], params(None, max_tokens=12))])
    check_against_hf(PROMPTS[0], out.prompt_logprobs, 4, hf_logprobs[tuple(PROMPTS[0])])
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_out_of_range_is_refused():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_a_tied_head_on_the_cpu_kernel_matches_hf(tmp_path):
    """A tied LM head runs its decode products through the CPU kernel; prompt logprobs
    compute the head over groups of rows, and must still match transformers."""
    import transformers

    from jaxserve.weights import load_model
    from tests.tiny_models import make_tiny_model

    make_tiny_model("llama-tied-mqa-llama3rope", tmp_path)
    eng = engine(load_model(str(tmp_path), use_cache=False, progress=False))
    assert eng.matmul_backend == "cpu"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    requests = [(PROMPTS[0], params(3)), (PROMPTS[1], params(2))]
    for out, (prompt, p) in zip(run(eng, requests), requests):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()
        check_against_hf(prompt, out.prompt_logprobs, p.prompt_logprobs, want)
