"""Logits of the JAX decoder family against Hugging Face transformers on the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.runner.kernels import select_matmul
from jaxserve.weights import load_model
from pallas_kernels import cpu_kernels
from tests.paged import PagedSequences
from tests.tiny_models import TINY_MODELS, make_tiny_model

PROMPT_LENS = [23, 5, 17, 1, 12]
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = make_tiny_model(request.param, folder)
    loaded = load_model(str(folder), use_cache=False, progress=False)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, loaded.config.vocab_size, n)) for n in PROMPT_LENS]
    with torch.no_grad():
        want = [hf_model(torch.tensor([p])).logits[0].double().numpy() for p in prompts]
    return loaded, prompts, want


def jitted_step(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, kv, inputs: nnx.merge(graphdef, state)(inputs, kv), donate_argnums=(1,)), state


def test_full_prefill_matches_hf(tiny):
    loaded, prompts, want = tiny
    step, state = jitted_step(loaded.model)
    seqs = PagedSequences(PROMPT_LENS, BLOCK_SIZE, num_blocks=40)
    kv = allocate_kv_cache(loaded.config, 40, BLOCK_SIZE, jnp.float32)
    inputs = seqs.step(prompts, [(0, n) for n in PROMPT_LENS], pad_to=64, all_logits=True)
    logits, kv = step(state, kv, inputs)
    got = np.split(np.asarray(logits, np.float64), np.cumsum(PROMPT_LENS)[:-1])
    for s, (g, w) in enumerate(zip(got, want)):
        err = np.abs(g - w).max()
        assert err <= 1e-4, f"sequence {s}: max abs error {err:.2e}"
    assert np.abs(want[0]).max() > 1.0, "logits too flat for the comparison to mean anything"


def test_prefill_then_decode_matches_hf(tiny):
    """Prefill part of each prompt, then feed the rest one token per step, all sequences batched."""
    loaded, prompts, want = tiny
    step, state = jitted_step(loaded.model)
    seqs = PagedSequences(PROMPT_LENS, BLOCK_SIZE, num_blocks=40, seed=3)
    kv = allocate_kv_cache(loaded.config, 40, BLOCK_SIZE, jnp.float32)
    done = [max(1, n - 6) for n in PROMPT_LENS]  # decode the last 6 (or fewer) tokens of each
    logits, kv = step(state, kv, seqs.step(prompts, [(0, d) for d in done], pad_to=64))
    for s, d in enumerate(done):
        np.testing.assert_allclose(np.asarray(logits[s]), want[s][d - 1], atol=1e-4, rtol=0)
    while any(d < n for d, n in zip(done, PROMPT_LENS)):
        # Every sequence is in every step (a finished one re-runs its last token) so the
        # shapes stay fixed; re-running a token rewrites the same K/V into the same slot.
        spans = [(d, d + 1) if d < n else (n - 1, n) for d, n in zip(done, PROMPT_LENS)]
        logits, kv = step(state, kv, seqs.step(prompts, spans, pad_to=8))
        for s, (start, _end) in enumerate(spans):
            err = np.abs(np.asarray(logits[s], np.float64) - want[s][start]).max()
            assert err <= 1e-4, f"sequence {s} position {start}: max abs error {err:.2e}"
        done = [min(d + 1, n) for d, n in zip(done, PROMPT_LENS)]


def test_decode_on_the_cpu_layer_kernels_matches_hf(tiny):
    """A model marked for the CPU kernels (select_matmul) runs the layers of a step of up to
    LAYER_MAX_ROWS tokens as two C++ calls each (cpu_kernels.norm_qkv, o_proj_mlp)."""
    loaded, prompts, want = tiny
    lens, rows = PROMPT_LENS[:3], cpu_kernels.LAYER_MAX_ROWS
    assert select_matmul("cpu", loaded.model) == "cpu"
    try:
        step, state = jitted_step(loaded.model)
        seqs = PagedSequences(lens, BLOCK_SIZE, num_blocks=40, seed=5)
        kv = allocate_kv_cache(loaded.config, 40, BLOCK_SIZE, jnp.float32)
        done = [max(1, n - 4) for n in lens]
        _, kv = step(state, kv, seqs.step(prompts, [(0, d) for d in done], pad_to=64))
        while any(d < n for d, n in zip(done, lens)):
            spans = [(d, d + 1) if d < n else (n - 1, n) for d, n in zip(done, lens)]
            inputs = seqs.step(prompts, spans, pad_to=rows)
            logits, kv = step(state, kv, inputs)
            for s, (start, _end) in enumerate(spans):
                err = np.abs(np.asarray(logits[s], np.float64) - want[s][start]).max()
                assert err <= 1e-4, f"sequence {s} position {start}: max abs error {err:.2e}"
            done = [min(d + 1, n) for d, n in zip(done, lens)]
        program = step.lower(state, kv, inputs).as_text()  # the layers' calls share one function
        # An o_proj bias stays on XLA, and so does a layer whose MLP is a mixture of experts.
        plain = loaded.model.layers[0].self_attn.o_proj.bias is None and not loaded.config.is_moe
        for target in (cpu_kernels.NORM_QKV_TARGET, cpu_kernels.O_PROJ_MLP_TARGET):
            assert (target in program) == plain
    finally:
        select_matmul("reference", loaded.model)


def test_steps_of_up_to_64_rows_on_the_cpu_dense_kernel_match_hf(tiny):
    """A model marked for the CPU kernels sends its float projections' products of
    DENSE_MIN_ROWS to DENSE_MAX_ROWS rows (cpu_kernels.dense_matmul; q/k/v and gate/up one call each) past the
    layer kernels' few rows: a step of all five prompts (58 tokens, 64 rows) against
    transformers. A step of 128 rows stays on XLA's dot in the layers. (Marked by hand: select_matmul does
    it only where the kernel has its AVX-512 path, and the plain loop gives the same bits.)"""
    from jaxserve.runner.kernels import set_dense_dot_general

    loaded, prompts, want = tiny
    assert select_matmul("cpu", loaded.model) == "cpu"
    set_dense_dot_general(loaded.model, True)
    try:
        step, state = jitted_step(loaded.model)
        calls = {}
        for rows in (64, 128):
            seqs = PagedSequences(PROMPT_LENS, BLOCK_SIZE, num_blocks=40)
            kv = allocate_kv_cache(loaded.config, 40, BLOCK_SIZE, jnp.float32)
            inputs = seqs.step(prompts, [(0, n) for n in PROMPT_LENS], pad_to=rows, all_logits=True)
            calls[rows] = step.lower(state, kv, inputs).as_text().count(cpu_kernels.DENSE_MATMUL_TARGET)
            logits, kv = step(state, kv, inputs)
            got = np.split(np.asarray(logits, np.float64), np.cumsum(PROMPT_LENS)[:-1])
            for s, (g, w) in enumerate(zip(got, want)):
                err = np.abs(g - w).max()
                assert err <= 1e-4, f"{rows} rows, sequence {s}: max abs error {err:.2e}"
        head = 0 if loaded.config.tie_word_embeddings else 1  # an untied head's 58 rows take it too
        assert calls[128] == head and calls[64] > head, calls
    finally:
        select_matmul("reference", loaded.model)
    assert all(
        m.dot_general is jax.lax.dot_general for _, m in nnx.iter_modules(loaded.model) if isinstance(m, nnx.Linear)
    )
