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
from jaxserve.model.lora import attach_lora, bgmv_reference, write_slot
from jaxserve.weights import load_model
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
    return loaded, hf_base, peft_models, adapters


def logits_of(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].double().numpy()


def test_mixed_batch_matches_peft_row_by_row(tiny):
    loaded, hf_base, peft_models, adapters = tiny
    model = nnx.merge(*nnx.split(loaded.model))
    attach_lora(model, max_loras=len(ADAPTERS), max_rank=MAX_RANK)
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

    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, loaded.config.vocab_size, n)] for n in PROMPT_LENS]
    slots = [0, 1, 2, 3]  # row i runs with slot i
    seqs = PagedSequences(PROMPT_LENS, BLOCK_SIZE, num_blocks=40)
    inputs = seqs.step(prompts, [(0, n) for n in PROMPT_LENS], pad_to=64, all_logits=True)
    token_slots = np.zeros(64, np.int32)
    token_slots[: sum(PROMPT_LENS)] = np.repeat(slots, PROMPT_LENS)
    inputs = dataclasses.replace(inputs, lora_slots=jnp.asarray(token_slots))
    kv = allocate_kv_cache(loaded.config, 40, BLOCK_SIZE, jnp.float32)
    logits, _ = jax.jit(lambda s, kv, x: nnx.merge(graphdef, s)(x, kv))(state, kv, inputs)
    got = np.split(np.asarray(logits, np.float64), np.cumsum(PROMPT_LENS)[:-1])
    for row, slot in enumerate(slots):
        want = logits_of(hf_base if slot == 0 else peft_models[slot], prompts[row])
        err = np.abs(got[row] - want).max()
        assert err <= 1e-4, f"row {row} (slot {slot}): max abs error {err:.2e}"
        if slot:  # the adapter really changes the logits: the comparison is not with the base by accident
            assert np.abs(want - logits_of(hf_base, prompts[row])).max() > 0.05
            # peft's merged model too (W + scaling * B A folded into each weight): the same function.
            merged = copy.deepcopy(peft_models[slot]).merge_and_unload()
            err = np.abs(got[row] - logits_of(merged, prompts[row])).max()
            assert err <= 1e-4, f"row {row} (slot {slot}), merged: max abs error {err:.2e}"


def test_bgmv_reference_is_a_per_row_gather_matmul():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    a = rng.standard_normal((3, 5, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4, 7)).astype(np.float32)
    slots = np.array([0, 2, 1, 1, 0, 2], np.int32)
    want = np.stack([x[t] @ a[s] @ b[s] for t, s in enumerate(slots)])
    np.testing.assert_allclose(np.asarray(bgmv_reference(x, a, b, slots)), want, rtol=1e-5, atol=1e-5)
