"""Medusa heads as the engine's proposer: greedy output equals plain decoding, with a chain
and with a tree of candidates, and the drafts are what the heads predict.

The heads here are random (their quality does not matter to the oracle: verification
must give the target's own tokens whatever is proposed); tests/jaxserve/spec_decode/test_draft_heads.py
trains real ones.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.spec_decode.heads import make_heads, save_heads
from tests.jaxserve.spec_decode.test_spec_decode import engine, run, tokens, workload

K = 3
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


@pytest.fixture(scope="module")
def heads_dir(tiny_llama, tmp_path_factory):
    heads = make_heads("medusa", tiny_llama.config, K)
    state = nnx.state(heads, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(state))))
    nnx.update(heads, jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state))
    folder = tmp_path_factory.mktemp("medusa")
    save_heads(
        folder,
        heads,
        {
            "method": "medusa",
            "num_heads": K,
            "target_config": {"hidden_size": tiny_llama.config.hidden_size, "vocab_size": tiny_llama.config.vocab_size},
            "target_source": "tiny llama",
        },
    )
    return str(folder)


def prompt_inputs(prompt: list[int]):
    """One prefill of `prompt` in blocks 1 and 2 of a 4-block cache of block size 4."""
    from jaxserve.model.inputs import ModelInputs

    n = len(prompt)
    return ModelInputs.from_numpy(
        input_ids=prompt,
        positions=np.arange(n),
        slot_mapping=np.arange(n) + 4,
        query_start_loc=[0, n],
        seq_lens=[n],
        block_tables=[[1, 2]],
        logits_indices=[n - 1],
    )


def prompt_hidden_states(loaded, prompt: list[int]):
    """The target's hidden states [T, D] (before its final norm) of one prefill of `prompt`."""
    from jaxserve.model.kv_cache import allocate_kv_cache

    kv = allocate_kv_cache(loaded.config, 4, 4, loaded.model.dtype)
    return loaded.model.hidden_states(prompt_inputs(prompt), kv)[0][: len(prompt)]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    prompts, params = workload(seed=5, count=12)
    return run(engine(tiny_llama), prompts, params)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_greedy_with_medusa_equals_plain(tiny_llama, heads_dir, plain, tree):
    prompts, params = workload(seed=5, count=12)
    spec = {"method": "medusa", "model": heads_dir, "num_speculative_tokens": K}
    if tree:
        spec = {**spec, "speculative_token_tree": tree}
    eng = engine(tiny_llama, spec)
    compiles = eng.compilations
    assert tokens(run(eng, prompts, params)) == tokens(plain)
    assert eng.compilations == compiles, "a program was compiled after warm-up"
    assert eng.scheduler.spec_stats.num_drafts > 0


def test_drafts_are_the_heads_top_tokens(tiny_llama, heads_dir):
    """One request after its prefill: the proposer's drafts against the heads run by hand
    on the target's hidden state at the prompt's last position."""
    from jaxserve.spec_decode.heads import load_heads
    from scheduler import SamplingParams

    prompt = [5, 17, 33, 8, 61, 20]
    eng = engine(
        tiny_llama,
        {"method": "medusa", "model": heads_dir, "num_speculative_tokens": K, "speculative_token_tree": TREE},
    )
    eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eng.step()  # the prefill: its last hidden state is kept
    req = eng.scheduler.requests["a"]
    eng.proposer.propose(eng.scheduler.running)

    heads, _ = load_heads(heads_dir, tiny_llama.config)
    logits = np.asarray(heads(tiny_llama.model, prompt_hidden_states(tiny_llama, prompt)[-1:]))[:, 0]  # [K, V]
    ranked = np.argsort(-logits, axis=-1)
    tree = eng.config.speculative_config.tree
    want = [int(ranked[tree.depth[i] - 1, tree.rank[i]]) for i in range(1, tree.num_nodes + 1)]
    assert req.spec_token_ids == want
