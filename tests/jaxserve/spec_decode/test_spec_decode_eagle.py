"""An EAGLE head as the engine's proposer: greedy output equals plain decoding, and every
chain it proposes equals the head run by hand over a fresh prefill of the request's context.

The head is trained for a few steps on the tiny target, enough for some drafts to be
accepted (verification must give the target's own tokens whatever is proposed). The second oracle checks what the
proposer's paged head cache holds after prefill chunks, plain decodes and verify steps
that accept some drafts and reject the rest: the head's entry at each position i must be
(h_i, x_{i+1}), the target's hidden state and the true next token, never a draft's.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import train_draft as td
from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.spec_decode.heads import load_heads, make_heads, prefill_inputs, save_heads
from scheduler import SamplingParams
from tests.jaxserve.spec_decode.test_spec_decode import engine, run, tokens, workload

K = 3


@pytest.fixture(scope="module")
def head_dir(tiny_llama, tmp_path_factory):
    """A head trained briefly on the target's greedy continuations (so that some drafts are
    accepted and verify steps both keep and roll back), saved as train_draft saves it."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=rng.integers(4, 12)).tolist() for _ in range(40)]
    continuations = td.self_distill(tiny_llama, prompts, max_tokens=24, temperature=0.0, seed=0)
    corpus = td.record_features(tiny_llama.model, prompts, continuations)
    head = make_heads("eagle", tiny_llama.config, K, seed=3)
    td.train_heads(head, tiny_llama.model, corpus, td.Settings(method="eagle", steps=60, batch=64, lr=3e-3))
    folder = tmp_path_factory.mktemp("eagle")
    save_heads(
        folder / "heads",
        head,
        {
            "method": "eagle",
            "num_heads": K,
            "target_config": {"hidden_size": tiny_llama.config.hidden_size, "vocab_size": tiny_llama.config.vocab_size},
            "target_source": "tiny llama",
        },
    )
    return str(folder)  # train_draft's layout: <out>/heads


def spec(head_dir):
    return {"method": "eagle", "model": head_dir, "num_speculative_tokens": K}


@pytest.mark.parametrize(
    "kw",
    [{}, {"max_num_batched_tokens": 16, "token_buckets": (4, 16)}, {"enable_prefix_caching": True}],
    ids=["batched", "chunked", "prefix-cached"],
)
def test_greedy_with_eagle_equals_plain(tiny_llama, head_dir, kw):
    prompts, params = workload(seed=7, count=12, shared_prefix=[9, 4, 71, 30, 5, 66, 12] if kw else ())
    plain = run(engine(tiny_llama, **kw), prompts, params)
    eng = engine(tiny_llama, spec(head_dir), **kw)
    compiles = eng.compilations
    assert tokens(run(eng, prompts, params)) == tokens(plain)
    assert eng.compilations == compiles, "a program was compiled after warm-up"
    assert eng.scheduler.spec_stats.num_accepted_tokens > 0


def head_chain(loaded, head, context: list[int]) -> list[int]:
    """The head's greedy chain for `context` (its last token not yet computed), from scratch:
    the target's hidden states h_0 .. h_{n-2}, the head's entries (h_i, x_{i+1}), then K - 1
    steps feeding back its own features and drafts."""
    model, n = loaded.model, len(context) - 1
    kv = allocate_kv_cache(loaded.config, 1 + n, 1, model.dtype)
    inputs = dataclasses.replace(prefill_inputs([n], n), input_ids=jnp.asarray(context[:-1], jnp.int32))
    hidden, _ = model.hidden_states(inputs, kv)
    feats, ids, chain = list(np.asarray(hidden)), list(context[1:]), []
    for _ in range(K):
        m = len(ids)
        f, _ = head(
            model, jnp.asarray(np.stack(feats)), jnp.asarray(ids), prefill_inputs([m], m), head.allocate_kv(1 + m, 1)
        )
        chain.append(int(jnp.argmax(model.logits(f[-1:]), -1)[0]))
        feats.append(np.asarray(f[-1]))
        ids.append(chain[-1])
    return chain


@pytest.mark.slow
def test_every_chain_equals_the_head_run_from_scratch(tiny_llama, head_dir):
    """Record each proposal with its context (chunked prefill, verify steps), then check it."""
    eng = engine(tiny_llama, spec(head_dir), max_num_batched_tokens=16, token_buckets=(4, 16))
    proposer = eng.proposer
    seen = []
    propose = proposer.propose

    def recording(running):
        propose(running)
        seen.extend((list(r.all_token_ids), list(r.spec_token_ids)) for r in running if r.spec_token_ids)

    proposer.propose = recording
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (21, 6, 13)]  # 21: three prefill chunks
    run(eng, prompts, [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)] * 3)
    assert len(seen) >= 10 and eng.scheduler.spec_stats.num_accepted_tokens > 0
    head, _ = load_heads(head_dir, tiny_llama.config)
    for context, drafts in seen:
        assert drafts == head_chain(tiny_llama, head, context)[: len(drafts)], len(context)


def test_eagle_config_is_validated(head_dir, tmp_path):
    from jaxserve.spec_decode import SpeculativeConfig

    with pytest.raises(ValueError, match="method eagle needs model"):
        SpeculativeConfig.parse({"method": "eagle"})
    with pytest.raises(ValueError, match="proposes one chain"):
        SpeculativeConfig.parse({"method": "eagle", "model": head_dir, "speculative_token_tree": "[(0,), (1,)]"})
    with pytest.raises(ValueError, match="holds no draft heads"):
        load_heads(tmp_path, None)


def test_medusa_heads_are_refused_as_eagle(tiny_llama, tmp_path):
    heads = make_heads("medusa", tiny_llama.config, K)
    save_heads(
        tmp_path,
        heads,
        {
            "method": "medusa",
            "num_heads": K,
            "target_config": {"hidden_size": tiny_llama.config.hidden_size, "vocab_size": tiny_llama.config.vocab_size},
            "target_source": "tiny llama",
        },
    )
    with pytest.raises(ValueError, match="not eagle ones"):
        engine(tiny_llama, {"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": K})
