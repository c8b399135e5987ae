"""GPTQ and AWQ checkpoints, read against the packages that define those formats.

Each projection of a tiny llama is replaced by random packed words (every nibble value,
zero points 1..15, float16 scales). The oracles are not ours:

- AWQ: AutoAWQ's own dequantizer (`awq.utils.packing_utils.dequantize_gemm`).
- GPTQ: the same words repacked into the GPTQ layout by AutoAWQ's converter
  (`unpack_reorder_pack`, zero points stored minus one), and read back by auto-round's torch
  GPTQ layer (its forward on the identity gives the weight); `gptq_v2` (zero points as they
  are) by auto-round's layer for that format; `gptq-act-order` with a g_idx that spreads
  each group over the inputs, as GPTQ's act-order writes it, read by the same layer.

Serving is checked against a float model holding the oracle's weights.
"""

import json

import jax
import numpy as np
import pytest
import torch
from auto_round_extension.torch.qlinear_torch import QuantLinear as GptqV2Layer
from auto_round_extension.torch.qlinear_torch_zp import QuantLinear as GptqLayer
from awq.utils.packing_utils import dequantize_gemm, unpack_reorder_pack
from safetensors.torch import load_file, save_file

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.weights import cache, load_model
from jaxserve.weights.params import WeightError
from scheduler import SamplingParams
from tests.jaxserve.parallel.test_tensor_parallel import mixed_step_logits
from tests.jaxserve.weights.test_compressed_tensors import (
    PROJECTIONS,
    PROMPT,
    dequantized,
    forward_logits,
    write_float_copy,
)
from tests.tiny_models import make_tiny_model

GROUP = 32
# hidden 96 against 4 heads of 16: K/V projections' outputs (32) and inputs (96) differ in
# size however tensor parallelism repeats the heads
SHAPE = dict(hidden_size=96, head_dim=16)
FORMATS = ("awq", "gptq", "gptq_v2", "gptq-act-order")


def awq_words(k: int, n: int, rng) -> dict[str, torch.Tensor]:
    """Random AWQ GEMM tensors for a [N, K] projection: every nibble value in the weights,
    zero points 1..15 (GPTQ's usual format stores zero - 1), scales of about 1 / (4 sqrt(K))."""
    groups = k // GROUP
    qweight = rng.integers(0, 2**32, (k, n // 8), dtype=np.uint32)
    zero_nibbles = rng.integers(1, 16, (groups, n), dtype=np.uint32)
    qzeros = (zero_nibbles.reshape(groups, n // 8, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    scales = (rng.uniform(0.5, 1.5, (groups, n)) / (4 * np.sqrt(k))).astype(np.float16)
    return {
        "qweight": torch.from_numpy(qweight.view(np.int32)),
        "qzeros": torch.from_numpy(qzeros.view(np.int32)),
        "scales": torch.from_numpy(scales),
    }


def gptq_oracle(tensors: dict[str, torch.Tensor], k: int, n: int, fmt: str) -> np.ndarray:
    """auto-round's torch GPTQ layer on the identity: the weight [K, N] it multiplies by.
    NOTE: with a g_idx that layer keeps only its first K output columns (it slices the
    columns of its scales by the input's width), so it runs on slices of at most K columns."""
    v2 = fmt == "gptq_v2"
    columns = []
    for start in range(0, n, k):
        width = min(k, n - start)
        layer = (GptqV2Layer if v2 else GptqLayer)(4, GROUP, k, width, bias=False, g_idx="g_idx" in tensors)
        layer.qweight = tensors["qweight"][:, start : start + width]
        layer.qzeros = tensors["qzeros"][:, start // 8 : (start + width) // 8]
        layer.scales = tensors["scales"][:, start : start + width].float()  # float32: exact products
        if "g_idx" in tensors:
            layer.g_idx = tensors["g_idx"]
        with torch.no_grad():
            columns.append(layer(torch.eye(k)).numpy())
    return np.concatenate(columns, axis=1)


def quantized_projection(awq: dict[str, torch.Tensor], k: int, n: int, fmt: str, rng):
    """(the checkpoint's tensors in `fmt`, the oracle's weight [K, N] as float32)."""
    if fmt == "awq":
        weight = dequantize_gemm(awq["qweight"], awq["qzeros"], awq["scales"].float(), 4, GROUP)
        return dict(awq), weight.numpy()
    qweight, qzeros = unpack_reorder_pack(awq["qweight"], awq["qzeros"], 4)
    if fmt == "gptq_v2":  # the zero points themselves: each stored nibble plus one (none was 15)
        qzeros = qzeros + torch.tensor(0x11111111, dtype=torch.int32)
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": awq["scales"]}
    if fmt == "gptq-act-order":  # input k was quantized in place inverse[k] of a random order
        inverse = np.argsort(rng.permutation(k))
        tensors["g_idx"] = torch.from_numpy((inverse // GROUP).astype(np.int32))
        return tensors, gptq_oracle(tensors, k, n, fmt)
    weight = gptq_oracle(tensors, k, n, fmt)  # its plain path; the file still has a g_idx
    tensors["g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
    return tensors, weight


def spec_of(fmt: str) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}
    act_order = fmt == "gptq-act-order"
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": False,
            "checkpoint_format": "gptq" if act_order else fmt}  # fmt: skip


def write_checkpoint(folder, fmt: str, seed: int = 0):
    """A tiny llama whose projections are random `fmt` tensors; returns every tensor as the
    float32 weight it stands for ([out, in], the oracle's)."""
    make_tiny_model("llama", folder, **SHAPE)
    tensors = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(seed)
    reference = {}
    for name in sorted(tensors):
        module = name.removesuffix(".weight")
        if not any(module.endswith(p) for p in PROJECTIONS):
            reference[name] = tensors[name].float().numpy()
            continue
        n, k = tensors.pop(name).shape
        pieces, weight = quantized_projection(awq_words(k, n, rng), k, n, fmt, rng)
        tensors.update({f"{module}.{piece}": t.contiguous() for piece, t in pieces.items()})
        reference[name] = weight.T
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = spec_of(fmt)
    (folder / "config.json").write_text(json.dumps(config))
    return reference


@pytest.fixture(scope="module", params=FORMATS)
def case(request, tmp_path_factory):
    """(format, loaded model, the oracle's float tensors, a float model holding them)."""
    root = tmp_path_factory.mktemp(request.param)
    reference = write_checkpoint(root / "quantized", request.param)
    loaded = load_model(str(root / "quantized"), use_cache=False, progress=False)
    twin = load_model(str(write_float_copy(root / "quantized", reference, root / "float")), use_cache=False)
    return request.param, loaded, reference, twin


def test_the_format_is_read_from_the_config(case):
    fmt, loaded, _, _ = case
    quant = loaded.quantization
    method = fmt.removesuffix("_v2").removesuffix("-act-order")
    assert (quant.method, quant.kind, quant.group_size) == (method, "int4", GROUP)
    assert quant.act_order == (fmt == "gptq-act-order")


def test_every_projection_is_the_oracles_weight_exactly(case):
    """scale * nibble + offset in float32 against the oracle's scale * (q - zero): both exact
    (a float16 scale times an integer of at most 5 bits), so equal to the last bit."""
    _, loaded, reference, _ = case
    for layer in range(loaded.config.num_layers):
        for projection in PROJECTIONS:
            block, proj = projection.split(".")
            linear = getattr(getattr(loaded.model.layers[layer], block), proj)
            ours = dequantized(linear)
            if linear.input_order is not None:  # row i is input order[i]
                ours = ours[np.argsort(np.asarray(linear.input_order[...]))]
            np.testing.assert_array_equal(ours, reference[f"model.layers.{layer}.{projection}.weight"].T)


def test_an_older_gptq_checkpoint_without_g_idx_loads_the_same(tmp_path):
    reference = write_checkpoint(tmp_path, "gptq")
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({name: t for name, t in tensors.items() if not name.endswith(".g_idx")}, tmp_path / "model.safetensors")
    loaded = load_model(str(tmp_path), use_cache=False, progress=False)
    ours = dequantized(loaded.model.layers[1].self_attn.k_proj)
    np.testing.assert_array_equal(ours, reference["model.layers.1.self_attn.k_proj.weight"].T)


def test_logits_are_the_float_models(case):
    _, loaded, _, twin = case
    ours, ref = forward_logits(loaded, PROMPT), forward_logits(twin, PROMPT)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_the_weights_cache_gives_the_same_model_back(case, tmp_path_factory):
    """Converted once, then restored from the cache: the same int4 parameters, and the
    entry is not derived from a float copy (its values come from the file)."""
    fmt, loaded, _, _ = case
    cache_dir = tmp_path_factory.mktemp(f"cache-{fmt}")
    source = loaded.source
    first = load_model(str(source), cache_dir=cache_dir, progress=False)
    again = load_model(str(source), cache_dir=cache_dir, progress=False)
    method = fmt.removesuffix("_v2").removesuffix("-act-order")
    assert [e.variant for e in cache.list_entries(cache_dir)] == [f"float32-{method}"]
    layer = again.model.layers[2].mlp.down_proj
    np.testing.assert_array_equal(dequantized(layer), dequantized(loaded.model.layers[2].mlp.down_proj))
    assert again.from_cache and not first.from_cache and again.quantization == loaded.quantization


def test_the_engine_serves_it(case):
    """Through the engine (on the CPU its int4 kernel): the first step's log-probabilities
    are the float model's to float32 noise, and its greedy token theirs."""
    _, loaded, _, twin = case
    config = EngineConfig(
        max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, kv_cache_memory=8 << 20, warm_up=False
    )
    engine = LLMEngine(loaded, config)
    engine.add_request("q", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5))
    (out,) = [o for o in engine.generate_all() if o.request_id == "q"]
    first = out.outputs[0].logprobs[0]
    ref = np.asarray(jax.nn.log_softmax(forward_logits(twin, PROMPT)[-1]))
    np.testing.assert_allclose([first[t] for t in first], ref[list(first)], rtol=0, atol=1e-4)
    assert out.outputs[0].token_ids[0] == int(ref.argmax()) and len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("case", ["gptq-act-order"], indirect=True)
def test_act_order_splits_over_devices(case):
    """Tensor parallelism over 4 CPU devices (2 KV heads, so each is repeated): the layers'
    input orders stay whole, the logits are one device's."""
    _, loaded, _, _ = case
    one, _ = mixed_step_logits(loaded, 1)
    four, hlo = mixed_step_logits(loaded, 4)
    np.testing.assert_allclose(four, one, atol=1e-4, rtol=0)
    assert "all-reduce" in hlo


# -- refusals -----------------------------------------------------------------------------


def refused(tmp_path, fmt: str, change_spec=None, change_tensors=None):
    """Load a checkpoint changed by the callbacks; return the error's message."""
    folder = tmp_path / fmt
    write_checkpoint(folder, fmt)
    if change_spec:
        config = json.loads((folder / "config.json").read_text())
        change_spec(config["quantization_config"])
        (folder / "config.json").write_text(json.dumps(config))
    if change_tensors:
        tensors = load_file(folder / "model.safetensors")
        change_tensors(tensors)
        save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightError) as error:
        load_model(str(folder), use_cache=False, progress=False)
    return str(error.value)


def test_a_g_idx_that_contradicts_the_config_is_refused(tmp_path):
    """A spread g_idx without desc_act, or one whose groups are not group_size inputs each."""

    def shuffle(tensors):
        g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
        tensors["model.layers.0.self_attn.q_proj.g_idx"] = g_idx[torch.randperm(len(g_idx))].contiguous()

    message = refused(tmp_path / "a", "gptq", change_tensors=shuffle)
    assert "q_proj.g_idx is not k // group_size" in message and "desc_act" in message

    def uneven(tensors):
        tensors["model.layers.1.mlp.up_proj.g_idx"][:3] = 1

    message = refused(tmp_path / "b", "gptq-act-order", change_tensors=uneven)
    assert "up_proj.g_idx does not give each group 32 inputs" in message

    def without(tensors):
        del tensors["model.layers.2.mlp.gate_proj.g_idx"]

    message = refused(tmp_path / "c", "gptq-act-order", change_tensors=without)
    assert "gate_proj has no g_idx, but quantization_config says desc_act" in message


@pytest.mark.parametrize(
    ("fmt", "change", "says"),
    [
        ("gptq", {"bits": 8}, "8-bit weights"),
        ("gptq", {"group_size": -1}, "per-channel scales"),
        ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ("gptq", {"lm_head": True}, "quantizes lm_head"),
        ("gptq", {"dynamic": {"-:.*down_proj": {}}}, "per-module overrides"),
        ("awq", {"version": "gemv"}, "version 'gemv'"),
    ],
)
def test_what_cannot_be_served_exactly_is_refused_by_name(tmp_path, fmt, change, says):
    assert says in refused(tmp_path, fmt, change_spec=lambda spec: spec.update(change))


def test_awqs_own_config_names_are_read(tmp_path):
    """AutoAWQ's quant_config spelling (w_bit, q_group_size) as some uploads carry it."""
    folder = tmp_path / "awq"
    write_checkpoint(folder, "awq")
    config = json.loads((folder / "config.json").read_text())
    spec = config["quantization_config"]
    spec["w_bit"], spec["q_group_size"] = spec.pop("bits"), spec.pop("group_size")
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model(str(folder), use_cache=False, progress=False).quantization.group_size == GROUP


def test_a_projection_left_in_float_is_refused(tmp_path):
    def unquantize(tensors):
        for piece in ("qweight", "qzeros", "scales"):
            del tensors[f"model.layers.1.mlp.down_proj.{piece}"]
        tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(96, 96)

    assert "down_proj is stored unquantized" in refused(tmp_path, "awq", change_tensors=unquantize)
