"""Batch invariance on a Hopper GPU, shown in the Mosaic GPU interpreter on the whole model.

The model is marked as the engine marks it on a Hopper GPU (`use_invariant_mgpu_kernels`:
every projection and the LM head through the dense Mosaic GPU kernel in its fixed-order
config, every RMSNorm summed in fixed_order_sum's order) and its attention is the Mosaic GPU
kernel with fixed splits; the kernels run in the interpreter. Oracle: the target sequence
run alone. Run with batch mates before and after it, and with its prompt cut into two
chunks that share steps with a mate, the target's logits at every position must be `==`;
and they must match the unmarked model on XLA's dots and the reference attention within
bf16 rounding. benchmarks/gpu_check.sh runs the same on a GPU (JAXSERVE_MGPU_ON_GPU=1).
"""

import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.runner.kernels import invariant_mgpu_unsupported_reason, use_invariant_mgpu_kernels
from pallas_kernels import ragged_paged_attention_mgpu as attention_mgpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.paged import PagedSequences

ON_GPU = os.environ.get("JAXSERVE_MGPU_ON_GPU") == "1"
if ON_GPU and jax.devices()[0].platform != "gpu":
    pytest.skip("JAXSERVE_MGPU_ON_GPU=1 but there is no GPU", allow_module_level=True)

# Every product's N a multiple of 64 (the dense kernel takes weights as stored), head_dim 64.
SHAPE = dict(
    hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=128
)
BLOCK = 16
# On a GPU, contexts of many key blocks, where the default attention splits a sequence by the
# whole step's work and the default dots pick their algorithm by the row count. In the
# interpreter the model is small enough to run in a minute; at this size the default kernels
# happen to keep the bits too, and the kernel tests (test_ragged_paged_attention_mgpu.py,
# test_batch_invariant_matmul_mgpu.py) show where they do not.
LENGTHS = (1500, 90, 3000) if ON_GPU else (21, 9, 30)  # the target, then its two mates
TARGET, *MATES = [[1, *np.random.default_rng(seed).integers(3, 128, n - 1).tolist()] for seed, n in enumerate(LENGTHS)]
N, SHORT, LONG = LENGTHS
NUM_BLOCKS = 1 + sum(-(-n // BLOCK) for n in LENGTHS)


@pytest.fixture(scope="module", params=["untied", "tied"])
def loaded(request, tmp_path_factory):
    from jaxserve.weights import load_model
    from tests.tiny_models import make_tiny_model

    folder = tmp_path_factory.mktemp(f"tiny-kernels-{request.param}")
    make_tiny_model("llama", folder, num_hidden_layers=2, tie_word_embeddings=request.param == "tied", **SHAPE)
    return load_model(str(folder), use_cache=False, progress=False, dtype="bfloat16")


def run_steps(model, attention, steps: list[list[tuple[int, int, int]]]) -> np.ndarray:
    """Run the steps (each a list of (sequence, start, end): sequence 0 is TARGET, 1 and 2 the
    MATES) on a fresh cache; the target's logits at every position it ran, in order."""
    prompts = [TARGET, *MATES]
    seqs = PagedSequences([len(p) for p in prompts], BLOCK, num_blocks=NUM_BLOCKS)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, kv, x: nnx.merge(graphdef, s)(x, kv, attention))
    kv = allocate_kv_cache(model.cfg, NUM_BLOCKS, BLOCK, model.dtype)
    target = []
    for step in steps:
        rows = [seq for seq, _, _ in step]
        spans = [(start, end) for _, start, end in step]
        bucket = max(16, 1 << (sum(e - s for s, e in spans) - 1).bit_length())  # the engine's token buckets
        inputs = seqs.step([prompts[r] for r in rows], spans, pad_to=bucket, all_logits=True, sequences=rows)
        logits, kv = forward(state, kv, inputs)
        for (seq, start, end), offset in zip(step, np.cumsum([0] + [e - s for s, e in spans])):
            if seq == 0:
                target.append(np.asarray(logits[offset : offset + end - start], np.float32))
    return np.concatenate(target)


ALONE = [[(0, 0, N)]]
IN_A_BATCH = [[(1, 0, SHORT), (0, 0, N), (2, 0, LONG)]]  # mates before and after it, another bucket
CHUNKED = [[(2, 0, LONG), (0, 0, N // 3)], [(0, N // 3, N), (1, 0, SHORT)]]  # its prompt in two chunks


def invariant_attention():
    interpret = None if ON_GPU else True
    return functools.partial(attention_mgpu.ragged_paged_attention, batch_invariant=True, interpret=interpret)


@pytest.mark.interpret
def test_target_logits_equal_alone_in_a_batch_and_chunked(loaded):
    model = nnx.merge(*nnx.split(loaded.model))  # a copy: the marks stay off the fixture's model
    want = run_steps(model, ragged_paged_attention_reference, ALONE)
    assert invariant_mgpu_unsupported_reason(model, tp=1) is None
    use_invariant_mgpu_kernels(model, interpret=not ON_GPU)
    attention = invariant_attention()
    alone = run_steps(model, attention, ALONE)
    np.testing.assert_array_equal(run_steps(model, attention, IN_A_BATCH), alone)
    np.testing.assert_array_equal(run_steps(model, attention, CHUNKED), alone)
    # still the model: the unmarked one on XLA's dots and the reference attention, to bf16 rounding
    assert np.abs(want).max() > 0.5, "logits too flat for the comparison to mean anything"
    np.testing.assert_allclose(alone, want, atol=0.05 * np.abs(want).max())


def test_what_the_gpu_mode_refuses(tiny_llama_dir, tmp_path):
    """No silent fallback: a model some product of which has no fixed-order kernel is named."""
    from jaxserve.weights import load_model
    from tests.tiny_models import make_tiny_model

    def reason(folder, dtype="bfloat16"):
        return invariant_mgpu_unsupported_reason(
            load_model(str(folder), use_cache=False, progress=False, dtype=dtype).model, tp=1
        )

    assert "bf16 or f16 model, this one is float32" in reason(tiny_llama_dir, "float32")
    assert "N=96 is not a multiple of 64" in reason(tiny_llama_dir)  # the tiny model's MLP width
    make_tiny_model("mixtral", tmp_path)
    assert "mixture of experts" in reason(tmp_path)
