"""A compressed-tensors checkpoint's calibrated KV-cache scales (`kv_cache_scheme`, static
k_scale / v_scale per layer or per layer and KV head), stored with an 8-bit cache.

Oracles: compressed-tensors' own fake_quantize (the rule the scales were calibrated for)
on the codes, and transformers' forward pass with that fake quantization applied to every
layer's K (after RoPE) and V as its cache receives them, where llm-compressor applies it,
against jaxserve's prefill and its engine's decode steps."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from safetensors.torch import load_file, save_file

from benchmarks import calibrate_kv_scales
from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.model.config import ModelConfig, UnsupportedModelError
from jaxserve.model.kv_cache import allocate_kv_cache, resolve_kv_cache_dtype
from jaxserve.weights import load_model
from jaxserve.weights.params import WeightError
from pallas_kernels.quantized_kv import codes_to_float, quantize_kv_calibrated
from scheduler import SamplingParams
from tests.paged import PagedSequences
from tests.tiny_models import make_tiny_model

TYPES = {"fp8": "float", "int8": "int"}
PROMPT = [5, 17, 42, 8, 63, 29, 71, 11, 36, 90, 4, 57, 23, 88]
CALIBRATION = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 83, 27, 95, 2, 88, 41, 96]]
# Calibrated scales are this fraction of the calibration text's range, so that some of the
# prompt's K and V saturate: the rule for values past the range is checked too.
SHRINK = 0.6
# jaxserve's K and V differ from transformers' by float32 noise, which now and then puts a value
# on the other side of a rounding boundary: one code one step off, which moved these logits by
# 5.5e-4 of their range (measured; otherwise 5e-7). Ignoring the scales moves them by 0.21-0.24.
TOLERANCE = 5e-3


def scheme(kind: str, strategy: str) -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type=TYPES[kind], strategy=strategy, dynamic=False, symmetric=True)


class FakeQuantizedCache(transformers.DynamicCache):
    """transformers' cache, with each layer's K and V fake-quantized by compressed-tensors
    as they arrive."""

    def __init__(self, config, args: QuantizationArgs, scales):
        super().__init__(config=config)
        self.args, self.scales = args, scales

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_scale, v_scale = self.scales[layer_idx]
        key_states = fake_quantize(key_states, k_scale, None, self.args)
        value_states = fake_quantize(value_states, v_scale, None, self.args)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def calibrate(model, args: QuantizationArgs):
    """llm-compressor's static min-max calibration (benchmarks/calibrate_kv_scales.py), shrunk."""
    scales = calibrate_kv_scales.calibrate(model, CALIBRATION, args.strategy, args.type)
    return {layer: tuple(s * SHRINK for s in kv) for layer, kv in scales.items()}


def write_checkpoint(folder, kind: str, strategy: str):
    """A tiny llama whose quantization_config quantizes only the KV cache (as llm-compressor
    writes it), with its calibrated scales; and the torch model, scales and scheme."""
    model = make_tiny_model("llama", folder.with_name(folder.name + "-float"))
    args = scheme(kind, strategy)
    scales = calibrate(model, args)
    calibrate_kv_scales.write_folder(model, None, scales, folder, strategy, TYPES[kind])
    return model, scales, args


CASES = [("fp8", "tensor"), ("fp8", "attn_head"), ("int8", "tensor")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def case(request, tmp_path_factory):
    kind, strategy = request.param
    folder = tmp_path_factory.mktemp(f"{kind}-{strategy}")
    model, scales, args = write_checkpoint(folder, kind, strategy)
    return kind, folder, model, scales, args, load_model(str(folder), use_cache=False, progress=False)


def oracle_logits(model, scales, args, tokens) -> np.ndarray:
    """transformers' logits [T, V] with the checkpoint's K/V fake quantization (None: without)."""
    cache = FakeQuantizedCache(model.config, args, scales) if scales is not None else None
    with torch.no_grad():
        return model(torch.tensor([tokens]), cache=cache).logits[0].numpy()


def forward_logits(loaded, tokens, kv_dtype) -> np.ndarray:
    """jaxserve's logits at every position of one prompt (one prefill, no engine)."""
    seqs = PagedSequences([len(tokens)], 4, 8)
    kv = allocate_kv_cache(loaded.config, 8, 4, resolve_kv_cache_dtype(kv_dtype, loaded.model.dtype))
    logits, _ = loaded.model(seqs.step([tokens], [(0, len(tokens))], all_logits=True), kv)
    return np.asarray(logits)


def test_the_codes_are_compressed_tensors_fake_quantization():
    """K [tokens, KV, head_dim] through quantize_kv_calibrated and back equals
    compressed-tensors' fake_quantize of the same K, laid out [1, KV, tokens, head_dim],
    exactly, for every type and strategy, with values well past the calibrated range."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((9, 2, 16)) * 3).astype(np.float32)
    for kind in TYPES:
        dtype = resolve_kv_cache_dtype(kind, np.float32)
        for strategy, scale in (("tensor", [0.004]), ("attn_head", [0.004, 0.02])):
            per_head = np.broadcast_to(np.asarray(scale, np.float32), (2,))
            codes, scales = quantize_kv_calibrated(jax.numpy.asarray(x), jax.numpy.asarray(per_head), dtype)
            ours = np.asarray(codes_to_float(codes)) * np.asarray(scales)[..., None]
            theirs_scale = torch.tensor(scale).reshape((1,) if strategy == "tensor" else (-1, 1, 1))
            heads_first = torch.from_numpy(x).permute(1, 0, 2)[None]  # [1, KV, tokens, head_dim]
            theirs = fake_quantize(heads_first, theirs_scale, None, scheme(kind, strategy))
            np.testing.assert_array_equal(ours, theirs[0].permute(1, 0, 2).numpy())
            assert np.abs(ours).max() == pytest.approx((448 if kind == "fp8" else 128) * max(scale))  # saturated


def test_config_names_the_scales_type(case):
    kind, _, _, _, _, loaded = case
    assert loaded.config.kv_scales == kind
    assert loaded.quantization is None  # only the cache is quantized: the weights load as they are


def test_loaded_scales_are_the_checkpoints(case):
    _, _, _, scales, _, loaded = case
    for layer, (k_scale, v_scale) in scales.items():
        attn = loaded.model.layers[layer].self_attn
        for ours, theirs in ((attn.k_scale, k_scale), (attn.v_scale, v_scale)):
            np.testing.assert_array_equal(np.asarray(ours[...]), np.broadcast_to(theirs.reshape(-1).numpy(), (2,)))


def without_scales(folder, dest):
    """The same weights as a plain checkpoint: no kv_cache_scheme, no scales."""
    dest.mkdir()
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (dest / "config.json").write_text(json.dumps(config))
    tensors = {n: t for n, t in load_file(folder / "model.safetensors").items() if not n.endswith("_scale")}
    save_file(tensors, dest / "model.safetensors")
    return load_model(str(dest), use_cache=False, progress=False)


def test_prefill_logits_match_transformers_with_the_packages_fake_quantization(case, tmp_path):
    """The 8-bit cache of the scheme's type with the calibrated scales gives transformers'
    logits under compressed-tensors' fake quantization (to TOLERANCE). Negative controls:
    the cache in float32, and the same weights without the scheme in an 8-bit cache (each
    token's own scales), are both far from them."""
    kind, folder, model, scales, args, loaded = case
    want = oracle_logits(model, scales, args, PROMPT)
    span = np.abs(want).max()
    np.testing.assert_allclose(forward_logits(loaded, PROMPT, kind), want, rtol=0, atol=TOLERANCE * span)
    plain = without_scales(folder, tmp_path / "plain")
    full = forward_logits(loaded, PROMPT, "auto")
    np.testing.assert_allclose(full, oracle_logits(model, None, args, PROMPT), rtol=0, atol=1e-5 * span)
    np.testing.assert_array_equal(forward_logits(plain, PROMPT, "auto"), full)
    assert np.abs(full - want).max() > 10 * TOLERANCE * span
    assert np.abs(forward_logits(plain, PROMPT, kind) - want).max() > 10 * TOLERANCE * span


@pytest.mark.parametrize("tp", [1, 4])
def test_engine_decode_steps_match_transformers(case, tp):
    """Greedy decoding through the engine (its decode steps read the 8-bit pages and their
    scales): the log-probabilities it reports at each step are transformers' at the same
    positions of prompt + output, under the same fake quantization. A static scale makes
    each token's codes independent of the step it was written in, so one forward pass over
    the whole sequence is the oracle for every step. tp 4 splits the model's 2 KV heads
    over 4 devices, each repeated with its scales (jaxserve.parallel.sharding)."""
    kind, _, model, scales, args, loaded = case
    engine = LLMEngine(
        loaded,
        EngineConfig(
            max_num_seqs=2,
            max_num_batched_tokens=32,
            max_model_len=64,
            kv_cache_memory=8 << 20,
            kv_cache_dtype=kind,
            tensor_parallel_size=tp,
            warm_up=False,
        ),
    )
    assert engine.cache_config_info()["kv_cache_dtype"].endswith(f"scales (calibrated for {kind})")
    engine.add_request("q", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))
    (out,) = [o for o in engine.generate_all() if o.request_id == "q"]
    completion = out.outputs[0]
    logits = oracle_logits(model, scales, args, PROMPT + list(completion.token_ids))
    want = torch.log_softmax(torch.from_numpy(logits), -1).numpy()
    for step, top in enumerate(completion.logprobs):
        row = want[len(PROMPT) - 1 + step]
        got = np.array(list(top.values()))
        np.testing.assert_allclose(got, row[list(top)], rtol=0, atol=TOLERANCE * np.abs(logits).max())


FP8_CASES = [c for c in CASES if c[0] == "fp8"]


@pytest.mark.parametrize("case", FP8_CASES, ids=["-".join(c) for c in FP8_CASES], indirect=True)
def test_fp8_scales_serve_an_int8_cache_with_the_same_range(case):
    """Scales calibrated for fp8 (absolute maximum / 448) in an int8 cache become absolute
    maximum / 127: compressed-tensors' int8 fake quantization at those scales is the oracle."""
    _, _, model, scales, _, loaded = case
    rescaled = {layer: tuple(s * (448 / 127) for s in kv) for layer, kv in scales.items()}
    strategy = "attn_head" if scales[0][0].numel() > 1 else "tensor"
    want = oracle_logits(model, rescaled, scheme("int8", strategy), PROMPT)
    span = np.abs(want).max()
    np.testing.assert_allclose(forward_logits(loaded, PROMPT, "int8"), want, rtol=0, atol=TOLERANCE * span)
    assert np.abs(forward_logits(loaded, PROMPT, "auto") - want).max() > 10 * TOLERANCE * span


def test_unsupported_schemes_are_named():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8}
    base |= {"num_hidden_layers": 1, "num_attention_heads": 2}

    def config(**kv_scheme):
        args = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
        quant = {"quant_method": "compressed-tensors", "kv_cache_scheme": args | kv_scheme}
        return {**base, "quantization_config": quant}

    assert ModelConfig.from_hf_dict(config()).kv_scales == "fp8"
    assert ModelConfig.from_hf_dict(config(type="int")).kv_scales == "int8"
    assert ModelConfig.from_hf_dict(config(dynamic=True)).kv_scales is None  # no scales shipped
    for change, message in (
        ({"num_bits": 4}, "num_bits=4"),
        ({"symmetric": False}, "symmetric=false"),
        ({"strategy": "channel"}, "strategy 'channel'"),
    ):
        with pytest.raises(UnsupportedModelError, match=message):
            ModelConfig.from_hf_dict(config(**change))


def test_a_missing_scale_is_named(tmp_path):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "fp8", "tensor")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightError, match=r"missing model\.layers\.1\.self_attn\.v_scale"):
        load_model(str(folder), use_cache=False, progress=False)


def test_the_weight_cache_keeps_the_scales(case, tmp_path):
    """The converted model saved in the weight cache, and restored from it; bf16 too (derived
    from the float32 entry): the scales stay float32, as the checkpoint's are."""
    _, folder, _, scales, _, _ = case
    assert not load_model(str(folder), cache_dir=tmp_path, progress=False).from_cache
    for dtype in ("float32", "bfloat16"):
        again = load_model(str(folder), dtype=dtype, cache_dir=tmp_path, progress=False)
        assert again.from_cache
        for layer, (k_scale, _) in scales.items():
            got = np.asarray(again.model.layers[layer].self_attn.k_scale[...])
            np.testing.assert_array_equal(got, np.broadcast_to(k_scale.reshape(-1).numpy(), (2,)))


def test_scales_beside_quantized_weights(tmp_path):
    """An int4 compressed-tensors checkpoint that also calibrated its KV cache: the weights
    load as int4 through the package's format and the scales beside them."""
    from tests.jaxserve.weights.test_compressed_tensors import SCHEMES
    from tests.jaxserve.weights.test_compressed_tensors import write_checkpoint as write_quantized

    folder = write_quantized(tmp_path / "int4", *SCHEMES["int4-g32-sym"])
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = scheme("fp8", "tensor").model_dump(mode="json")
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    for layer in range(3):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([0.01 * (layer + 1)])
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.002])
    save_file(tensors, folder / "model.safetensors")
    loaded = load_model(str(folder), use_cache=False, progress=False)
    assert loaded.quantization.kind == "int4" and loaded.config.kv_scales == "fp8"
    for layer in range(3):
        attn = loaded.model.layers[layer].self_attn
        np.testing.assert_array_equal(np.asarray(attn.k_scale[...]), np.float32([0.01 * (layer + 1)] * 2))
        np.testing.assert_array_equal(np.asarray(attn.v_scale[...]), np.float32([0.002] * 2))


def test_an_eagle_head_of_such_a_target_keeps_no_scales(case):
    """A draft head built from the target's config: its one layer has no calibrated scales
    to load (its own KV cache keeps full precision)."""
    from flax import nnx

    from jaxserve.spec_decode.heads import Eagle3Head, EagleHead

    _, _, _, _, _, loaded = case
    for head in (
        EagleHead(loaded.config, rngs=nnx.Rngs(0)),
        Eagle3Head(loaded.config, (0, 1, 2), 32, rngs=nnx.Rngs(0)),
    ):
        assert head.cfg.kv_scales is None and not hasattr(head.layer.self_attn, "k_scale")
    assert hasattr(loaded.model.layers[0].self_attn, "k_scale")
