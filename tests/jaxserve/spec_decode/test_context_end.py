"""Every proposer runs requests to the end of the context, at every block alignment.

A request that reaches max_model_len (a multiple of the block size, the common case) has no
room left for its drafts: the step that writes its last token must not reserve slots past
the context. The oracle is the same requests without speculation: output tokens equal, the
engine alive, every block free at the end."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.spec_decode.heads import make_heads, save_heads
from scheduler import SamplingParams
from tests.jaxserve.spec_decode.test_published_heads import eagle3_state, write_eagle3
from tests.jaxserve.spec_decode.test_spec_decode import engine, run, tokens

MAX_MODEL_LEN = 32  # 8 blocks of 4
K = 3


def random_heads(method, loaded, folder):
    heads = make_heads(method, loaded.config, K)
    state = nnx.state(heads, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(state))))
    nnx.update(heads, jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state))
    target = {"hidden_size": loaded.config.hidden_size, "vocab_size": loaded.config.vocab_size}
    save_heads(folder, heads, {"method": method, "num_heads": K, "target_config": target, "target_source": "tiny"})
    return str(folder)


def workload():
    """Prompts of every length mod the block size, each asking for more than the context holds."""
    rng = np.random.default_rng(0)
    prompts = [(rng.integers(3, 40, 3).tolist() * 10)[:n] for n in range(MAX_MODEL_LEN - 8, MAX_MODEL_LEN - 4)]
    params = [SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def plain(tiny_llama):
    prompts, params = workload()
    return tokens(run(engine(tiny_llama, max_model_len=MAX_MODEL_LEN), prompts, params))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3", "medusa", "medusa-tree"])
def test_every_proposer_runs_to_the_context_end(tiny_llama, tiny_llama_dir, plain, method, tmp_path):
    spec = {"method": method.removesuffix("-tree"), "num_speculative_tokens": K}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3, disable_by_measured_cost=False)  # every draft verified
    elif method == "draft_model":
        spec["draft_num_layers"] = 1
    elif method == "eagle3":  # published heads only
        state = eagle3_state(tiny_llama_dir, own_embeddings=False, seed=6)[0]
        spec["model"] = str(write_eagle3(tmp_path / "eagle3", state, tiny_llama_dir))
    else:
        spec["model"] = random_heads(spec["method"], tiny_llama, tmp_path)
    if method == "medusa-tree":
        spec.update(speculative_token_tree="[(0,), (1,), (0, 0), (0, 0, 0)]")
    eng = engine(tiny_llama, spec, max_model_len=MAX_MODEL_LEN)
    prompts, params = workload()
    got = tokens(run(eng, prompts, params))
    assert got == plain
    assert all(len(p) + len(t[0]) == MAX_MODEL_LEN for p, t in zip(prompts, got)), "each ran to the context end"
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.config.num_blocks - 1
    assert eng.scheduler.spec_stats.num_draft_tokens > 0
