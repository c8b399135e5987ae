"""The matmul backend switch, and quantized layers in the kernel layout.

On this CPU `select_matmul` picks the reference for quantized models unless forced, and the
C++ kernels for a float model's few-row products; the layout conversion and the layers' kernel
path are checked with the kernels run in the Mosaic GPU interpreter.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import DecoderLM, FewRowKernels
from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.model.quantization import QuantConfig, QuantizedLinear, quantize, quantized_layers, use_kernel_layout
from jaxserve.runner.kernels import select_matmul
from pallas_kernels import cpu_kernels
from tests.paged import PagedSequences
from tests.tiny_models import q8_0_table

CFG = ModelConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 64, 256)


def quantized_model(method="int4", dtype=jnp.bfloat16, cfg=CFG):
    return DecoderLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), quantization=QuantConfig.for_method(method))


def test_auto_on_cpu_takes_the_cpu_int4_kernel_and_says_so(caplog):
    model = quantized_model()
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kernels"):
        assert select_matmul(None, model) == "cpu"
    assert "cpu on" in caplog.text and "7 int4 layers" in caplog.text
    assert all(layer.layout == "cpu" for _, layer in quantized_layers(model))
    assert select_matmul("cpu", model) == "cpu"  # converting again changes nothing


def test_another_engine_on_the_model_gets_the_canonical_layout_back():
    """The CPU kernel's tiled layout is undone, exactly, for an engine that runs the reference
    (or shards the layers: tensor parallelism takes the reference too)."""
    model = randomly_quantized_model("int4", jnp.float32)
    canonical = {
        path: [np.asarray(layer.packed[...]), np.asarray(layer.scales[...])] for path, layer in quantized_layers(model)
    }
    assert select_matmul("auto", model) == "cpu"
    assert select_matmul("reference", model) == "reference"
    for path, layer in quantized_layers(model):
        assert layer.layout == "canonical"
        np.testing.assert_array_equal(np.asarray(layer.packed[...]), canonical[path][0])
        np.testing.assert_array_equal(np.asarray(layer.scales[...]), canonical[path][1])


def test_reference_on_cpu_keeps_the_canonical_layout():
    model = quantized_model()
    assert select_matmul("reference", model) == "reference"
    assert all(layer.layout == "canonical" for _, layer in quantized_layers(model))


def test_forcing_pallas_where_it_cannot_run_is_an_error():
    with pytest.raises(ValueError, match="Pallas quantized matmul kernels cannot run: it needs a Hopper"):
        select_matmul("pallas", quantized_model("fp8"))


def test_environment_variable_unknown_names_and_unquantized_models(monkeypatch, caplog):
    monkeypatch.setenv("JAXSERVE_MATMUL_BACKEND", "reference")
    assert select_matmul(None, quantized_model()) == "reference"
    monkeypatch.setenv("JAXSERVE_MATMUL_BACKEND", "pallas")
    with pytest.raises(ValueError, match="cannot run"):
        select_matmul(None, quantized_model())
    with pytest.raises(ValueError, match="not one of"):
        select_matmul("triton", quantized_model())
    plain = DecoderLM(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kernels"):
        assert select_matmul("pallas", plain) == "reference"  # nothing to choose for
    assert "not quantized" in caplog.text
    assert select_matmul("cpu", quantized_model()) == "cpu"  # the int4 kernel


@pytest.mark.parametrize("tied", [True, False])
def test_a_float_model_on_cpu_sends_its_few_row_products_to_the_cpu_kernels(tied, caplog):
    """Auto marks a float model (the layers, tests/jaxserve/model/test_model_vs_hf.py; a tied LM
    head here): the logits equal XLA's, with few rows and with more rows than the kernel
    takes (those stay on XLA). An untied head stays on XLA."""
    import dataclasses

    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    model = DecoderLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (20, cfg.hidden_size))
    want = [model.logits(x[:3]), model.logits(x)]
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kernels"):
        assert select_matmul(None, model) == "cpu"
    assert model.few_row_kernels.layer_rows == cpu_kernels.LAYER_MAX_ROWS
    assert model.few_row_kernels.lm_head_rows == (cpu_kernels.MAX_ROWS if tied else 0)
    assert f"decoder layers' products of up to {cpu_kernels.LAYER_MAX_ROWS} rows" in caplog.text
    assert ("the tied LM head's of up to 16" in caplog.text) == tied
    got = [jax.jit(model.logits)(x[:3]), jax.jit(model.logits)(x)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
    assert ("custom_call" in jax.jit(model.logits).lower(x[:3]).as_text()) == tied
    assert select_matmul("reference", model) == "reference" and model.few_row_kernels == FewRowKernels()


def test_layers_the_layer_kernels_do_not_compute_stay_on_xla():
    """The layer kernels have no o_proj bias: the selection leaves such a model's layers to
    XLA (their output unchanged) and still gives its tied head to the kernel; the same model
    without the bias gets the layer kernels."""

    def lowered_step(model):
        inputs = PagedSequences([3], 4, num_blocks=4).step([[1, 2, 3]], [(0, 3)], pad_to=4)
        kv = allocate_kv_cache(model.cfg, 4, 4, jnp.float32)
        return inputs, kv, jax.jit(lambda i, c: model(i, c)[0]).lower(inputs, kv).as_text()

    plain = DecoderLM(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    select_matmul("cpu", plain)
    assert cpu_kernels.NORM_QKV_TARGET in lowered_step(plain)[2]

    import dataclasses

    cfg = dataclasses.replace(CFG, o_proj_bias=True, tie_word_embeddings=True)
    model = DecoderLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    o_proj = model.layers.self_attn.o_proj  # stacked: a leading [L] axis; a bias that is not zero
    o_proj.bias[...] = jax.random.normal(jax.random.key(2), o_proj.bias.shape)
    inputs, kv, _ = lowered_step(model)
    want, _ = model(inputs, kv)
    assert select_matmul("cpu", model) == "cpu"
    assert model.few_row_kernels == FewRowKernels(layer_rows=0, lm_head_rows=cpu_kernels.MAX_ROWS)
    lowered = lowered_step(model)[2]
    assert cpu_kernels.NORM_QKV_TARGET not in lowered and cpu_kernels.O_PROJ_MLP_TARGET not in lowered
    got, _ = jax.jit(lambda i, c: model(i, c))(inputs, kv)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_layers_say_which_shapes_the_kernels_refuse():
    model = quantized_model()
    layers = dict(quantized_layers(model))
    assert len(layers) == 7 * 1  # stacked layers: one module per projection, leading [L] axis
    assert all(layer.kernel_unsupported_reason(jnp.bfloat16) is None for layer in layers.values())
    assert "bf16 or f16" in next(iter(layers.values())).kernel_unsupported_reason(jnp.float32)
    odd = QuantizedLinear(80, 64, use_bias=False, quant=QuantConfig("int4", "int4", 16), dtype=jnp.bfloat16)
    assert "group size 16" in odd.kernel_unsupported_reason(jnp.bfloat16)


@pytest.mark.interpret
@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_kernel_layout_layer_equals_the_reference_layer(method):
    """A layer converted to the kernel layout (stacked, as the scanned model holds it)
    gives the reference layer's output, with the kernels run in the interpreter."""
    rng = np.random.default_rng(0)
    quant = QuantConfig.for_method(method)
    layer = QuantizedLinear(128, 80, use_bias=True, quant=quant, dtype=jnp.bfloat16)
    params = quantize(rng.standard_normal((128, 80)).astype(np.float32), quant)
    for name, value in params.items():
        getattr(layer, name)[...] = jnp.asarray(value)
    layer.bias[...] = jnp.asarray(rng.standard_normal(80), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.bfloat16)  # leading axes are flattened
    want = np.asarray(layer(x), np.float32)
    layer.use_kernel_layout(interpret=True)
    assert layer.layout == "mgpu" and not hasattr(layer, "packed")
    got = np.asarray(layer(x), np.float32)
    assert got.shape == (2, 3, 80)
    np.testing.assert_allclose(got, want, rtol=2 * 2**-7, atol=2 * 2**-7 * 1e-2 * np.abs(want).max())


@pytest.mark.interpret
def test_use_kernel_layout_converts_every_projection_once():
    model = quantized_model("fp8")
    assert use_kernel_layout(model, interpret=True) == 7
    weights = [layer.weight[...] for _, layer in quantized_layers(model)]
    assert all(w.shape[-2] % 64 == 0 for w in weights)  # [L, N_pad, K]
    assert use_kernel_layout(model, interpret=True) == 7  # converting again changes nothing
    assert all(a is layer.weight[...] for a, (_, layer) in zip(weights, quantized_layers(model)))
    _, state = nnx.split(model)
    assert jax.tree.leaves(state)  # still plain arrays for nnx.split / jit
    with pytest.raises(ValueError, match=r"already in a kernel's layout \(mgpu"):
        select_matmul("reference", model)  # one-way: the canonical arrays are gone


@pytest.mark.interpret
def test_use_kernel_layout_leaves_int8_layers_beside_int4_ones_on_the_reference():
    """A GGUF mixing int4 and int8 layers: the int4 ones take the Mosaic GPU kernels' layout,
    the int8 ones (no kernel) stay canonical and run the reference."""
    quant = QuantConfig("gguf", "int4", 32, exceptions=(("layers.0.self_attn.v_proj", "int8", 16),))
    model = DecoderLM(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), quantization=quant)
    assert use_kernel_layout(model, interpret=True) == 7 * CFG.num_layers - 1
    layouts = {path: layer.layout for path, layer in quantized_layers(model)}
    assert layouts.pop("layers/0/self_attn/v_proj") == "canonical"
    assert set(layouts.values()) == {"mgpu"}


def randomly_quantized_model(method, dtype, seed=0, cfg=CFG):
    """A tiny model whose quantized projections hold random weights (per stacked layer)."""
    rng = np.random.default_rng(seed)
    model = quantized_model(method, dtype, cfg)
    quant = model.quantization
    for _, layer in quantized_layers(model):
        per_layer = [
            quantize(0.2 * rng.standard_normal((layer.din, layer.dout)).astype(np.float32), quant)
            for _ in range(CFG.num_layers)
        ]
        for name in per_layer[0]:
            getattr(layer, name)[...] = jnp.stack([jnp.asarray(p[name]) for p in per_layer])
    return model


@pytest.mark.interpret
@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_model_logits_with_the_kernels_equal_the_reference(method):
    """The whole (scanned) model in f16 with its projections in the kernel layout, kernels
    interpreted, against the same model on the references. The kernels round each
    projection's output once like the reference, but may sum in another order: a few f16
    ulps per projection, through two layers and the LM head."""
    from jaxserve.model.kv_cache import allocate_kv_cache
    from tests.paged import PagedSequences

    model = randomly_quantized_model(method, jnp.float16)
    seqs = PagedSequences([5, 3], 4, num_blocks=8)
    inputs = seqs.step([[1, 2, 3, 4, 5], [6, 7, 8]], [(0, 5), (0, 3)], pad_to=8, all_logits=True)

    def logits(m):
        graphdef, state = nnx.split(m)
        kv = allocate_kv_cache(CFG, 8, 4, jnp.float16)
        return np.asarray(jax.jit(lambda s, kv: nnx.merge(graphdef, s)(inputs, kv)[0])(state, kv), np.float64)

    want = logits(model)
    use_kernel_layout(model, interpret=True)
    got = logits(model)
    assert np.abs(want).max() > 0.1, "logits too flat for the comparison to mean anything"
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-q8_0"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_model_logits_in_the_cpu_layout_equal_the_reference(method, dtype, tied):
    """The whole (scanned) model with its int4 or int8 projections in the CPU kernels' tiled
    layout: a step of 8 rows through the C++ kernel and one of 24 through the reference on the
    weight untiled, against the canonical model on the reference. The kernel sums in another
    order (each group's values first, scaled once) and keeps the float32 dequantized weight the
    reference rounds to x's dtype: float32 agrees to a few ulps, bfloat16 to its rounding.
    Tied to a table of Q8_0 blocks, the 8-row step's head reads them (int8_matmul) in float32;
    bfloat16 does not hold the blocks' values, so its head stays on the float table."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True) if tied else CFG
    model = randomly_quantized_model(method, dtype, cfg=cfg)
    if tied:
        table = q8_0_table(np.random.default_rng(1), CFG.vocab_size, CFG.hidden_size) / 4
        model.embed_tokens.embedding[...] = jnp.asarray(table, dtype)
    seqs = PagedSequences([5, 3, 16], 4, num_blocks=16)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], list(range(10, 26))]
    steps = {
        8: seqs.step(prompts[:2], [(0, 5), (0, 3)], pad_to=8, all_logits=True),
        24: seqs.step(prompts, [(0, 5), (0, 3), (0, 16)], pad_to=24, all_logits=True),
    }

    def logits(m, inputs):
        graphdef, state = nnx.split(m)
        kv = allocate_kv_cache(cfg, 16, 4, dtype)
        return np.asarray(jax.jit(lambda s, kv: nnx.merge(graphdef, s)(inputs, kv)[0])(state, kv), np.float64)

    want = {rows: logits(model, inputs) for rows, inputs in steps.items()}
    assert select_matmul("cpu", model) == "cpu"
    down = model.layers.mlp.down_proj  # [L, tiles, K // 2 (int4: packed nibbles) or K (int8), 32]; K = 128
    tiled = (down.packed, 64) if method == "int4" else (down.weight, 128)
    assert tiled[0].shape == (2, 2, tiled[1], cpu_kernels.INT4_TILE)
    assert (model.int8_head is not None) == (tied and dtype == jnp.float32)
    assert np.abs(want[8]).max() > 0.1, "logits too flat for the comparison to mean anything"
    tolerance = 1e-5 if dtype == jnp.float32 else 3e-2
    for rows, inputs in steps.items():
        got = logits(model, inputs)
        np.testing.assert_allclose(got, want[rows], rtol=tolerance, atol=tolerance * np.abs(want[rows]).max())
    assert select_matmul("reference", model) == "reference" and model.int8_head is None
