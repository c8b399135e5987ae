"""Quantized weights: the quantizers and matmuls against independent numpy arithmetic, the
quantized models against transformers on the weights they stand for, GGUF's own blocks
against the float reading of the same file, and batching against running alone."""

import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.model.quantization import (
    QuantConfig,
    QuantizedLinear,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantized_layers,
)
from jaxserve.runner.kernels import select_matmul
from jaxserve.weights import cache, load_model
from pallas_kernels import cpu_kernels
from pallas_kernels.quantized_matmul import (
    dequantize_int4,
    fp8_matmul_reference,
    int4_matmul_reference,
    int8_matmul_reference,
)
from scheduler import SamplingParams
from tests.jaxserve.engine.test_engine import run_alone, run_batched, workload
from tests.jaxserve.model.test_model_vs_hf import jitted_step
from tests.paged import PagedSequences
from tests.tiny_models import make_tiny_model


def numpy_int4_weight(packed, scales, offsets):
    """The documented layout, read with plain bit operations (not our unpacking code)."""
    packed = np.asarray(packed)
    k2, n = packed.shape
    nibbles = np.empty((2 * k2, n), np.float64)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    group = 2 * k2 // np.asarray(scales).shape[0]
    rows = np.arange(2 * k2) // group
    return nibbles * np.asarray(scales, np.float64)[rows] + np.asarray(offsets, np.float64)[rows]


def numpy_int8_weight(weight, scales):
    """The documented int8 layout: each value times its group's scale, in float64."""
    weight, scales = np.asarray(weight, np.float64), np.asarray(scales, np.float64)
    return weight * np.repeat(scales, weight.shape[0] // scales.shape[0], axis=0)


def quantized_weight(layer: QuantizedLinear) -> np.ndarray:
    """The float weight [K, N] a quantized layer stands for."""
    if layer.kind == "int4":
        return numpy_int4_weight(layer.packed[...], layer.scales[...], layer.offsets[...])
    if layer.kind == "int8":
        return numpy_int8_weight(layer.weight[...], layer.scales[...])
    return np.asarray(layer.weight[...]).astype(np.float64) * np.asarray(layer.scales[...], np.float64)


# -- group sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("k, want", [(576, 64), (1536, 128), (4096, 128), (96, 32), (64, 64), (14336, 128)])
def test_int4_group_size_falls_back_to_a_divisor_of_k(k, want):
    assert QuantConfig.for_method("int4").group_size_for(k) == want


def test_int4_refuses_a_k_no_group_divides():
    with pytest.raises(ValueError, match=r"K=40 is not a multiple of any group size \(128, 64, 32\)"):
        QuantConfig.for_method("int4").group_size_for(40)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="'int3' is not one of int4, int8, fp8, gguf"):
        QuantConfig.for_method("int3")


def test_exceptions_give_a_projection_its_own_layout_and_the_model_separate_layers():
    """A GGUF's mixed block types: the projections named in `exceptions` take their own
    layout, the rest the config's; paths are scoped layer by layer, module by module."""
    from jaxserve.model.decoder import DecoderLM
    from tests.jaxserve.runner.test_backend_matmul import CFG

    quant = QuantConfig("gguf", "int4", 32, exceptions=(("layers.1.mlp.down_proj", "int8", 16),))
    assert quant.label == "gguf (int4, group 32; 1 projection int8, group 16)"
    down = quant.under("layers.1").under("mlp").at("down_proj")
    assert (down.kind, down.group_size, down.exceptions) == ("int8", 16, ())
    assert quant.under("layers.1").under("mlp").at("up_proj") == QuantConfig("gguf", "int4", 32)
    assert quant.under("layers.0") == quant.under("layers.1").under("self_attn") == QuantConfig("gguf", "int4", 32)
    assert quant.under("layers.10").exceptions == ()  # "layers.1" is not a prefix of "layers.10.…"
    model = DecoderLM(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0), quantization=quant)
    kinds = {path: (layer.kind, layer.din // layer.scales.shape[-2]) for path, layer in quantized_layers(model)}
    assert kinds.pop("layers/1/mlp/down_proj") == ("int8", 16)
    assert set(kinds.values()) == {("int4", 32)} and len(kinds) == 7 * CFG.num_layers - 1
    with pytest.raises(ValueError, match="only int4 and int8 layouts mix"):
        QuantConfig("fp8", "fp8", exceptions=(("layers.0.mlp.up_proj", "int8", 32),))
    with pytest.raises(ValueError, match="even group size"):
        QuantConfig("gguf", "int8", 32, exceptions=(("layers.0.mlp.up_proj", "int4", 15),))


# -- quantizers and matmuls -------------------------------------------------------------


def test_int4_round_to_nearest_is_within_half_a_step_and_keeps_group_extremes():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 24)).astype(np.float32)
    w[5, 3] = w[5, 4] = 7.0  # one group with an outlier, one flat column in another group
    w[64:128, 7] = -0.25
    q = quantize_int4(w, 32)
    got = numpy_int4_weight(q["packed"], q["scales"], q["offsets"])
    step = np.repeat(np.asarray(q["scales"], np.float64), 32, axis=0)
    assert np.all(np.abs(got - w) <= step / 2 + 1e-6)
    groups = w.reshape(4, 32, 24)
    np.testing.assert_allclose(got.reshape(4, 32, 24).min(1), groups.min(1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.reshape(4, 32, 24).max(1), groups.max(1), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[64:128, 7], -0.25)


@pytest.mark.parametrize("m", [1, 7, 33])
def test_int4_matmul_equals_the_numpy_product_with_the_dequantized_weight(m):
    rng = np.random.default_rng(m)
    q = quantize_int4(rng.standard_normal((192, 40)).astype(np.float32), 64)
    x = rng.standard_normal((m, 192)).astype(np.float32)
    want = x.astype(np.float64) @ numpy_int4_weight(q["packed"], q["scales"], q["offsets"])
    got = int4_matmul_reference(jnp.asarray(x), *(jnp.asarray(q[k]) for k in ("packed", "scales", "offsets")))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    # float32 `scale * q + offset` (XLA may fuse it into one FMA): equal up to one float32 rounding
    np.testing.assert_allclose(
        np.asarray(dequantize_int4(*(jnp.asarray(q[k]) for k in ("packed", "scales", "offsets")))),
        numpy_int4_weight(q["packed"], q["scales"], q["offsets"]),
        rtol=2**-23,
        atol=2**-22,
    )


def test_int8_round_to_nearest_is_within_half_a_step_and_keeps_each_groups_largest_value():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((96, 24)).astype(np.float32)
    w[5, 3] = -9.0  # a group with an outlier, a zero group
    w[32:64, 7] = 0.0
    q = quantize_int8(w, 32)
    assert q["weight"].dtype == np.int8 and q["scales"].shape == (3, 24)
    assert np.abs(q["weight"].astype(np.int32)).max() == 127
    got = numpy_int8_weight(q["weight"], q["scales"])
    step = np.repeat(np.asarray(q["scales"], np.float64), 32, axis=0)
    assert np.all(np.abs(got - w) <= step / 2 * (1 + 1e-6))
    np.testing.assert_allclose(np.abs(got).reshape(3, 32, 24).max(1), np.abs(w).reshape(3, 32, 24).max(1), rtol=1e-6)
    assert got[5, 3] == pytest.approx(-9.0, rel=1e-6) and not got[32:64, 7].any()


@pytest.mark.parametrize("m", [1, 7, 33])
def test_int8_matmul_equals_the_numpy_product_with_the_dequantized_weight(m):
    rng = np.random.default_rng(m)
    q = quantize_int8(rng.standard_normal((192, 40)).astype(np.float32), 32)
    x = rng.standard_normal((m, 192)).astype(np.float32)
    want = x.astype(np.float64) @ numpy_int8_weight(q["weight"], q["scales"])
    got = int8_matmul_reference(jnp.asarray(x), jnp.asarray(q["weight"]), jnp.asarray(q["scales"]))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 5])
def test_fp8_matmul_quantizes_each_token_then_scales_the_float32_product(m):
    rng = np.random.default_rng(m)
    w = rng.standard_normal((96, 48)).astype(np.float32)
    x = (rng.standard_normal((m, 96)) * np.array([[1.0], [100.0], [0.01], [3.0], [0.5]])[:m]).astype(np.float32)
    q = quantize_fp8(w)
    # An independent reading: ml_dtypes' e4m3 rounding, float64 products.
    x_scale = np.abs(x).max(1, keepdims=True) / 448.0
    xq = (x / x_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    want = (xq * x_scale) @ (np.asarray(q["weight"]).astype(np.float64) * np.asarray(q["scales"], np.float64))
    got = fp8_matmul_reference(jnp.asarray(x), jnp.asarray(q["weight"]), jnp.asarray(q["scales"]))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and e4m3 is close to the float product (3 mantissa bits on each side)
    assert np.abs(np.asarray(got) - x @ w).max() <= 0.1 * np.abs(x @ w).max()


# -- quantized models -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-quant")
    return folder, make_tiny_model("llama-bias-mha", folder)


PROMPT_LENS = [9, 1, 14]


def model_logits(model, prompts, pad_to=32):
    lens = [len(p) for p in prompts]
    step, state = jitted_step(model)
    seqs = PagedSequences(lens, 4, num_blocks=20)
    kv = allocate_kv_cache(model.cfg, 20, 4, jnp.float32)
    logits, _ = step(state, kv, seqs.step(prompts, [(0, n) for n in lens], pad_to=pad_to, all_logits=True))
    return np.split(np.asarray(logits, np.float64), np.cumsum(lens)[:-1])


def hf_logits_with_weights_of(hf_model, loaded, prompts):
    """transformers' logits with every projection set to the weight our quantized layer stands for."""
    with torch.no_grad():
        for i, layer in enumerate(loaded.model.layers):
            for block, names in (
                ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                ("mlp", ("gate_proj", "up_proj", "down_proj")),
            ):
                for name in names:
                    ours = getattr(getattr(layer, block), name)
                    hf = getattr(getattr(hf_model.model.layers[i], block), name)
                    hf.weight.copy_(torch.tensor(quantized_weight(ours).T, dtype=torch.float32))
        return [hf_model(torch.tensor([p])).logits[0].double().numpy() for p in prompts]


@pytest.mark.parametrize("method, groups", [("int4", (96 // 32, 1)), ("int8", (96 // 32, 64 // 32))])
def test_model_equals_transformers_on_the_dequantized_weights(tiny_folder, method, groups):
    folder, hf_model = tiny_folder
    loaded = load_model(str(folder), use_cache=False, progress=False, quantization=method)
    assert isinstance(loaded.model.layers[0].mlp.down_proj, QuantizedLinear)
    # int4: K=96 takes group 32, K=64 group 64; int8: group 32 everywhere
    assert loaded.model.layers[0].mlp.down_proj.scales.shape == (groups[0], 64)
    assert loaded.model.layers[0].self_attn.q_proj.scales.shape == (groups[1], 64)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 97, n)) for n in PROMPT_LENS]
    want = hf_logits_with_weights_of(hf_model, loaded, prompts)
    for got, w in zip(model_logits(loaded.model, prompts), want):
        assert np.abs(got - w).max() <= 1e-4
    float_logits = model_logits(load_model(str(folder), use_cache=False, progress=False).model, prompts)
    changed = max(np.abs(g - f).max() for g, f in zip(model_logits(loaded.model, prompts), float_logits))
    assert changed > (1e-3 if method == "int4" else 1e-5), (
        f"{method} should change the logits (else the comparison above checked the float model)"
    )


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("name", ["llama-bias-mha", "qwen2", "qwen3"])
def test_model_on_the_cpu_kernel_equals_transformers(tmp_path, name, method):
    """select_matmul on the CPU sends the int4 or int8 layers' products of up to QUANTIZED_MAX_ROWS
    rows to the C++ kernels: each half of a layer one call (quantized_norm_qkv,
    quantized_o_proj_mlp; q/k/v biases added after, q/k norms between), or, with an o_proj bias
    (llama-bias-mha), each projection its own. A step of 51 tokens (64 rows) runs there, with
    transformers' logits on the dequantized weights."""
    hf_model = make_tiny_model(name, tmp_path)
    loaded = load_model(str(tmp_path), use_cache=False, progress=False, quantization=method)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 97, n)) for n in (20, 1, 30)]
    want = hf_logits_with_weights_of(hf_model, loaded, prompts)
    assert select_matmul("auto", loaded.model) == "cpu"
    assert {layer.layout for _, layer in quantized_layers(loaded.model)} == {"cpu"}
    layer_kernels = name != "llama-bias-mha"
    assert loaded.model.few_row_kernels.layer_rows == (cpu_kernels.QUANTIZED_MAX_ROWS if layer_kernels else 0)
    inputs = PagedSequences([51], 4, num_blocks=20).step([list(range(51))], [(0, 51)], pad_to=64)
    kv = allocate_kv_cache(loaded.model.cfg, 20, 4, jnp.float32)
    lowered = jax.jit(lambda i, c: loaded.model(i, c)[0]).lower(inputs, kv).as_text()
    targets = (cpu_kernels.QUANTIZED_NORM_QKV_TARGET, cpu_kernels.QUANTIZED_O_PROJ_MLP_TARGET)
    assert [target in lowered for target in targets] == [layer_kernels] * 2
    assert (cpu_kernels.QUANTIZED_MATMUL_TARGET in lowered) != layer_kernels
    for got, w in zip(model_logits(loaded.model, prompts, pad_to=64), want):
        assert np.abs(got - w).max() <= 1e-4


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_layer_in_the_cpu_layout_takes_the_kernel_up_to_its_rows(kind):
    layer = QuantizedLinear(64, 48, use_bias=False, quant=QuantConfig(kind, kind, 32), dtype=jnp.float32)
    layer.use_cpu_layout()
    graphdef, state = nnx.split(layer)
    targets = {}
    for rows in (1, cpu_kernels.QUANTIZED_MAX_ROWS, cpu_kernels.QUANTIZED_MAX_ROWS + 1):
        hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, jnp.zeros((rows, 64))).as_text()
        targets[rows] = cpu_kernels.QUANTIZED_MATMUL_TARGET in hlo
    assert targets == {1: True, cpu_kernels.QUANTIZED_MAX_ROWS: True, cpu_kernels.QUANTIZED_MAX_ROWS + 1: False}


def fake_quantize_e4m3_per_token(module, args):
    """torch's own e4m3 rounding of each token's activations, scaled by amax / 448 (a forward pre-hook)."""
    (x,) = args
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0
    return ((x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale,)


def test_fp8_model_equals_transformers_with_e4m3_activations(tiny_folder):
    """W8A8: transformers on the dequantized weights, its projections' inputs rounded to e4m3
    per token by torch."""
    folder, hf_model = tiny_folder
    loaded = load_model(str(folder), use_cache=False, progress=False, quantization="fp8")
    assert loaded.model.layers[1].self_attn.k_proj.weight.dtype == jnp.float8_e4m3fn
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 97, n)) for n in PROMPT_LENS]
    hooks = [
        m.register_forward_pre_hook(fake_quantize_e4m3_per_token)
        for name, m in hf_model.named_modules()
        if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ]
    try:
        want = np.concatenate(hf_logits_with_weights_of(hf_model, loaded, prompts))
    finally:
        for h in hooks:
            h.remove()
    got = np.concatenate(model_logits(loaded.model, prompts))
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_quantized_engine_batched_equals_alone(tiny_llama_dir, method):
    loaded = load_model(str(tiny_llama_dir), use_cache=False, progress=False, quantization=method)
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=256, max_model_len=128)
    prompts, params = workload(count=12)
    want = run_alone(LLMEngine(loaded, EngineConfig(**cfg, enable_prefix_caching=False)), prompts, params)
    assert run_batched(LLMEngine(loaded, EngineConfig(**cfg)), prompts, params) == want


def test_quantized_weights_are_cached_per_scheme(tiny_llama_dir, tmp_path):
    first = load_model(str(tiny_llama_dir), cache_dir=tmp_path, progress=False, quantization="int4")
    again = load_model(str(tiny_llama_dir), cache_dir=tmp_path, progress=False, quantization="int4")
    other = load_model(str(tiny_llama_dir), cache_dir=tmp_path, progress=False, quantization="fp8")
    assert (first.from_cache, again.from_cache, other.from_cache) == (False, True, False)
    for a, b in zip(jax.tree.leaves(nnx.state(first.model)), jax.tree.leaves(nnx.state(again.model))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sorted(e.variant for e in cache.list_entries(tmp_path)) == ["float32-fp8", "float32-int4"]


def test_resident_bytes_shrink(tiny_llama):
    int4 = load_model(tiny_llama.source, use_cache=False, progress=False, quantization="int4")
    fp8 = load_model(tiny_llama.source, use_cache=False, progress=False, quantization="fp8")
    projections = sum(x.nbytes for layer in tiny_llama.model.layers for x in jax.tree.leaves(nnx.state(layer)))
    # the projections shrink to about 1/4 (fp8) and a bit more than 1/8 (int4, scales included)
    assert tiny_llama.weight_bytes - fp8.weight_bytes >= 0.7 * projections
    assert tiny_llama.weight_bytes - int4.weight_bytes >= 0.75 * projections


def test_loading_quantizes_tensor_by_tensor(tmp_path):
    """Host memory while loading stays near the quantized model plus one float tensor."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    float_bytes = 4 * 4 * (4 * 512 * 512 + 3 * 512 * 1536)  # the projections alone: 4 layers, float32
    tracemalloc.start()
    load_model(str(tmp_path), use_cache=False, progress=False, quantization="int4")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    largest = 4 * 512 * 1536
    assert peak < float_bytes / 8 + 4 * largest, (
        f"peak {peak / 2**20:.1f} MiB for {float_bytes / 2**20:.1f} MiB of floats"
    )


def test_gguf_method_needs_a_gguf_file(tiny_llama_dir):
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(str(tiny_llama_dir), use_cache=False, progress=False, quantization="gguf")


# -- the embedded Q4_1 file, served from its own blocks -----------------------------------


@pytest.fixture(scope="module")
def gguf_model(weights_cache):
    return load_model(None, cache_dir=weights_cache, progress=False, quantization="gguf")


@pytest.mark.slow
def test_gguf_blocks_are_exactly_the_files_values(default_model, gguf_model):
    for ours, floats in zip(gguf_model.model.layers, default_model.model.layers):
        for block, name in [
            ("self_attn", "q_proj"),
            ("self_attn", "k_proj"),
            ("self_attn", "v_proj"),
            ("self_attn", "o_proj"),
            ("mlp", "gate_proj"),
            ("mlp", "up_proj"),
            ("mlp", "down_proj"),
        ]:
            q = getattr(getattr(ours, block), name)
            assert q.scales.shape[0] == q.packed.shape[0] * 2 // 32  # the file's own group of 32
            want = np.asarray(getattr(getattr(floats, block), name).kernel[...])
            np.testing.assert_array_equal(quantized_weight(q).astype(np.float32), want)
    assert gguf_model.weight_bytes < 0.4 * default_model.weight_bytes


@pytest.mark.slow
def test_gguf_serving_gives_the_float_models_tokens(default_model, gguf_model):
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, kv_cache_memory=64 << 20)
    outs = []
    for loaded in (default_model, gguf_model):
        engine = LLMEngine(loaded, cfg)
        for i, p in enumerate(["The capital of France is", "def fibonacci(n):", "Once upon a time,"]):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=24))
        outs.append({o.request_id: o.outputs[0].token_ids for o in engine.generate_all()})
    assert outs[0] == outs[1]
