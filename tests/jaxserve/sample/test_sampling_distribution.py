"""End to end, the first sampled token follows the model's distribution.

20,000 unseeded requests (seeds from `secrets`) of one prompt run through the engine in
big batches; their first tokens are compared with a chi-square test to the softmax of
transformers' logits for the same prompt on the same weights, after the documented
filters (tests/sampling_oracle.py). A wrong temperature, a biased draw, a filter that
keeps the wrong set or seeds that repeat across requests all fail it.
"""

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import AutoModelForCausalLM

from jaxserve.engine import EngineConfig, LLMEngine
from scheduler import SamplingParams
from tests.sampling_oracle import target_distribution

PROMPT = [5, 17, 33, 8, 61, 40, 12, 90, 3]
NUM_SAMPLES = 20_000


@pytest.fixture(scope="module")
def engine(tiny_llama):
    # One token bucket: every step is padded to 512 tokens, but only one program compiles.
    return LLMEngine(
        tiny_llama,
        EngineConfig(
            max_num_seqs=256,
            max_num_batched_tokens=512,
            token_buckets=(512,),
            block_size=4,
            num_blocks=1024,
            max_model_len=32,
        ),
    )


@pytest.fixture(scope="module")
def hf_logits(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1].double().numpy()


@pytest.mark.slow
@pytest.mark.parametrize(
    "filters", [dict(), dict(top_p=0.8), dict(top_k=10), dict(min_p=0.05), dict(top_k=30, top_p=0.9, min_p=0.02)]
)
def test_first_tokens_follow_the_softmax(engine, hf_logits, filters):
    params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, **filters)
    for i in range(NUM_SAMPLES):
        engine.add_request(f"s{i}", PROMPT, params)
    outs = engine.generate_all()
    tokens = np.array([o.outputs[0].token_ids[0] for o in outs])
    assert len(tokens) == NUM_SAMPLES
    counts = np.bincount(tokens, minlength=len(hf_logits))
    want = target_distribution(hf_logits, **filters)
    assert counts[want == 0].sum() == 0, "a token outside the kept set was drawn"
    # Chi-square over the kept tokens, the ones expected fewer than 5 times pooled into one bin.
    expected = want[want > 0] * NUM_SAMPLES
    observed = counts[want > 0]
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    p_value = stats.chisquare(observed, expected).pvalue
    assert p_value > 0.001, (filters, p_value)
