"""Medusa and EAGLE heads on a tiny random target, trained on its own greedy continuations.

Greedy continuations are deterministic functions of their context, so even a random
target is learnable: the heads must beat n-gram lookup where there is nothing to copy.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import train_draft as td
from jaxserve.spec_decode.heads import (
    EagleHead,
    MedusaHeads,
    load_heads,
    make_heads,
    prefill_inputs,
    save_heads,
    trainable_attention,
)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

K = 3


@pytest.fixture(scope="module")
def corpus(tiny_llama):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tiny_llama.config.vocab_size, size=rng.integers(4, 12)).tolist() for _ in range(40)]
    continuations = td.self_distill(tiny_llama, prompts, max_tokens=24, temperature=0.0, seed=0)
    data = td.record_features(tiny_llama.model, prompts, continuations)
    held_out = np.arange(len(prompts)) % 10 == 9
    return data.subset(~held_out), data.subset(held_out)


def _params(module) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(module))]


@pytest.fixture(scope="module", params=["medusa", "eagle"])
def trained(request, tiny_llama, corpus):
    train, _ = corpus
    before = _params(tiny_llama.model)
    settings = td.Settings(
        method=request.param, num_heads=K, steps=60, batch=64, lr=1e-2 if request.param == "medusa" else 3e-3
    )
    heads = make_heads(request.param, tiny_llama.config, K)
    losses = td.train_heads(heads, tiny_llama.model, train, settings)
    return heads, losses, before


def test_loss_falls_and_target_is_untouched(trained, tiny_llama):
    heads, losses, before = trained
    assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:3]), (losses[:3], losses[-5:])
    after = _params(tiny_llama.model)
    assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))


def test_heads_beat_ngram_where_there_is_nothing_to_copy(trained, tiny_llama, corpus):
    heads, _, _ = trained
    _, held_out = corpus
    ngram = td.ngram_drafts(held_out, K)
    fresh = [p for p in held_out.draft_positions() if not ngram[p]]
    assert len(fresh) >= 20
    drafts = td.head_drafts(heads, tiny_llama.model, held_out, K)
    assert td.acceptance(held_out, ngram, K, fresh) == [1.0] * K
    assert td.acceptance(held_out, drafts, K, fresh)[-1] > 1.08


def test_save_load_round_trips_bitwise(trained, tiny_llama, tmp_path):
    heads, _, _ = trained
    info = {
        "method": "medusa" if isinstance(heads, MedusaHeads) else "eagle",
        "num_heads": K,
        "target_source": "tiny",
        "target_config": dataclasses.asdict(tiny_llama.config),
        "settings": {},
    }
    save_heads(tmp_path / "heads", heads, info)
    loaded, loaded_info = load_heads(tmp_path / "heads", tiny_llama.config)
    assert type(loaded) is type(heads) and loaded_info["num_heads"] == K
    assert all(np.array_equal(a, b) for a, b in zip(_params(heads), _params(loaded)))


def test_fresh_medusa_head_repeats_the_base_prediction(tiny_llama, corpus):
    heads = MedusaHeads(tiny_llama.config, K, rngs=nnx.Rngs(0))
    h = jnp.asarray(corpus[0].features[0])
    logits = heads(tiny_llama.model, h)
    for j in range(K):
        np.testing.assert_array_equal(logits[j], tiny_llama.model.logits(h))


def test_trainable_attention_matches_the_serving_reference(tiny_llama, corpus):
    """The EAGLE layer gives the same features with the differentiable attention as with the reference."""
    head = EagleHead(tiny_llama.config, rngs=nnx.Rngs(1))
    train, _ = corpus
    rows, length = 2, train.tokens.shape[1]
    batch = td.eagle_batch(train.subset(slice(0, rows)))
    inputs = prefill_inputs([length] * rows, length)
    outs = [
        head(
            tiny_llama.model,
            batch["features"],
            batch["next_ids"],
            inputs,
            head.allocate_kv(1 + rows * length, 1),
            attention,
        )[0]
        for attention in (trainable_attention, ragged_paged_attention_reference)
    ]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_eagle_chains_match_a_fresh_prefill_of_each_chain(tiny_llama, corpus):
    """Drafts from the shared paged cache equal running the head over prefix + chain anew."""
    head = EagleHead(tiny_llama.config, rngs=nnx.Rngs(2))
    _, held_out = corpus
    one = held_out.subset(slice(0, 1))
    drafts = td.head_drafts(head, tiny_llama.model, one, K)[0]
    model, h, x = tiny_llama.model, one.features[0], one.tokens[0]
    for t in (int(one.starts[0]), int(one.lengths[0]) - 4):
        feats, ids = list(h[: t + 1]), list(x[1 : t + 2])
        for s in range(K):
            n = len(ids)
            f, _ = head(
                model,
                jnp.asarray(np.stack(feats)),
                jnp.asarray(ids),
                prefill_inputs([n], n),
                head.allocate_kv(1 + n, 1),
            )
            token = int(jnp.argmax(model.logits(f[-1:]), -1)[0])
            assert token == drafts[t, s], (t, s)
            feats.append(np.asarray(f[-1]))
            ids.append(token)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "lookahead"], "invalid choice"),
        (["--method", "medusa", "--steps", "0"], "--steps must be positive"),
        (["--method", "eagle", "--prompts", "/nonexistent.jsonl"], "no such file"),
    ],
)
def test_bad_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        td.parse_args(argv)
    assert message in capsys.readouterr().err


def test_prompts_go_through_the_chat_template(tiny_llama_tok, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "the cat sat"}\n')
    tok = tiny_llama_tok.tokenizer
    [ids] = td.read_prompts(path, tok, tiny_llama_tok.config.vocab_size, 10)
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "user", ":", "the", "cat", "sat", ".", "assistant", ":"]
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="'prompt' field"):
        td.read_prompts(path, tok, tiny_llama_tok.config.vocab_size, 10)
