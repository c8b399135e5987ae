"""Logits of the decoder with LoRA adapters in its slots against transformers + peft.

One step holds a base row and rows of adapters of different ranks and targets, each row
through its own slot (the BGMV reference): every row must equal peft's model for its adapter,
unmerged and merged."""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxserve.lora.peft_adapter import load_peft_adapter
from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.model.lora import attach_lora, bgmv_reference, projection_shapes, write_slot
from jaxserve.weights import load_model
from pallas_kernels import sgmv_mgpu
from tests.paged import PagedSequences
from tests.tiny_lora import ALL_SEVEN, ATTENTION_QV, make_peft_adapter
from tests.tiny_models import make_tiny_model

PROMPT_LENS = [9, 5, 12, 7]
BLOCK_SIZE = 4
MAX_RANK = 8
# slot -> (rank, targets, more LoraConfig fields); slot 0 is the base model
ADAPTERS = {
    1: (4, ATTENTION_QV, {}),
    2: (8, ALL_SEVEN, {"use_rslora": True, "lora_alpha": 5}),
    3: (2, ["k_proj", "o_proj", "down_proj"], {"layers_to_transform": [0, 2]}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf_base = make_tiny_model("qwen2", root / "base")
    loaded = load_model(str(root / "base"), use_cache=False, progress=False)
    peft_models, adapters = {}, {}
    for slot, (r, targets, extra) in ADAPTERS.items():
        peft_models[slot] = make_peft_adapter(hf_base, root / f"a{slot}", r=r, seed=slot, targets=targets, **extra)
        adapters[slot] = load_peft_adapter(root / f"a{slot}", loaded.config, MAX_RANK)
    return loaded, hf_base, peft_models, adapters, root


def logits_of(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].double().numpy()


def mixed_batch_logits(loaded, adapters, prompts, **lora_layout) -> list[np.ndarray]:
    """One prefill step: row i runs prompt i with slot i (0: the base model); each row's logits."""
    model = nnx.merge(*nnx.split(loaded.model))
    attach_lora(model, max_loras=len(ADAPTERS), max_rank=MAX_RANK, **lora_layout)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    write = jax.jit(write_slot, donate_argnums=0)
    for slot, adapter in adapters.items():  # the engine's way: one jitted in-place update per slot
        values = adapter.slot_arrays(loaded.config, MAX_RANK, np.float32)
        stacks = {i: layer["lora"] for i, layer in params["layers"].items()}
        new = write(stacks, jnp.int32(slot), {i: values[i] for i in stacks})
        for i in stacks:
            params["layers"][i]["lora"] = new[i]
    nnx.replace_by_pure_dict(state, params)
    seqs = PagedSequences(PROMPT_LENS, BLOCK_SIZE, num_blocks=40)
    inputs = seqs.step(prompts, [(0, n) for n in PROMPT_LENS], pad_to=64, all_logits=True)
    token_slots = np.zeros(64, np.int32)
    token_slots[: sum(PROMPT_LENS)] = np.repeat(np.arange(len(PROMPT_LENS)), PROMPT_LENS)
    inputs = dataclasses.replace(inputs, lora_slots=jnp.asarray(token_slots))
    kv = allocate_kv_cache(loaded.config, 40, BLOCK_SIZE, loaded.model.dtype)
    logits, _ = jax.jit(lambda s, kv, x: nnx.merge(graphdef, s)(x, kv))(state, kv, inputs)
    return np.split(np.asarray(logits, np.float64), np.cumsum(PROMPT_LENS)[:-1])


def random_prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(0, vocab_size, n)] for n in PROMPT_LENS]


def test_mixed_batch_matches_peft_row_by_row(tiny):
    loaded, hf_base, peft_models, adapters, _ = tiny
    prompts = random_prompts(loaded.config.vocab_size)
    got = mixed_batch_logits(loaded, adapters, prompts)
    for row, slot in enumerate([0, 1, 2, 3]):  # row i runs with slot i
        want = logits_of(hf_base if slot == 0 else peft_models[slot], prompts[row])
        err = np.abs(got[row] - want).max()
        assert err <= 1e-4, f"row {row} (slot {slot}): max abs error {err:.2e}"
        if slot:  # the adapter really changes the logits: the comparison is not with the base by accident
            assert np.abs(want - logits_of(hf_base, prompts[row])).max() > 0.05
            # peft's merged model too (W + scaling * B A folded into each weight): the same function.
            merged = copy.deepcopy(peft_models[slot]).merge_and_unload()
            err = np.abs(got[row] - logits_of(merged, prompts[row])).max()
            assert err <= 1e-4, f"row {row} (slot {slot}), merged: max abs error {err:.2e}"


@pytest.mark.interpret
def test_sgmv_kernel_layout_equals_the_reference_layout(tiny, tmp_path_factory):
    """The Mosaic GPU SGMV kernel in the interpreter (LayerLoRA's "mgpu" layout, the stacks'
    rank rounded up to 64 and each adapter zero padded into them by write_slot) against the
    reference layout, on the bf16 model. q, o and down run the kernel; the tiny model's K/V
    (32) and gate/up (96) outputs are not multiples of its 64, so those fall back to the
    reference, as the engine's step shapes the kernel does not take do."""
    _, _, _, adapters, root = tiny
    loaded = load_model(str(root / "base"), dtype="bfloat16", use_cache=False, progress=False)
    x = jax.ShapeDtypeStruct((64, loaded.config.hidden_size), jnp.bfloat16)
    for module, (d_in, d_out) in projection_shapes(loaded.config).items():
        a = jax.ShapeDtypeStruct((len(ADAPTERS) + 1, d_in, 64), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((len(ADAPTERS) + 1, 64, d_out), jnp.bfloat16)
        reason = sgmv_mgpu.unsupported_reason(x.update(shape=(64, d_in)), a, b)
        assert (reason is None) == (module in ("q_proj", "o_proj", "down_proj")), (module, reason)
    prompts = random_prompts(loaded.config.vocab_size)
    want = mixed_batch_logits(loaded, adapters, prompts)
    got = mixed_batch_logits(loaded, adapters, prompts, kernel=True, interpret=True)
    ulp = float(jnp.finfo(jnp.bfloat16).eps)
    for row, (g, w) in enumerate(zip(got, want)):
        # bf16 rounding in another place shifts a logit by about one ulp of the largest
        # (XLA fuses the base projection's add differently around the kernel's call).
        err = np.abs(g - w).max()
        assert err <= 4 * ulp * np.abs(w).max(), f"row {row}: max abs error {err:.3f}"


def test_bgmv_reference_is_a_per_row_gather_matmul():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    a = rng.standard_normal((3, 5, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4, 7)).astype(np.float32)
    slots = np.array([0, 2, 1, 1, 0, 2], np.int32)
    want = np.stack([x[t] @ a[s] @ b[s] for t, s in enumerate(slots)])
    np.testing.assert_allclose(np.asarray(bgmv_reference(x, a, b, slots)), want, rtol=1e-5, atol=1e-5)
