"""compressed-tensors checkpoints (llm-compressor's format), written by the package itself.

Each checkpoint is a tiny random model quantized with compressed-tensors' own machinery:
its QuantizationConfig applied to the torch model, scales and zero points from its
`calculate_qparams` on each weight's min/max, compressed by its ModelCompressor, the
config.json written by `update_config`. The oracle for our unpacking is the package's own
per-module `decompress`; the oracle for serving is a float model holding those
decompressed weights.
"""

import copy
import json
import shutil

import jax
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.weights import load_model
from jaxserve.weights.compressed_tensors import checkpoint_quant_config
from jaxserve.weights.params import WeightError
from pallas_kernels.quantized_matmul import dequantize_int4
from scheduler import SamplingParams
from tests.paged import PagedSequences
from tests.tiny_models import make_tiny_model

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
PROMPT = [5, 17, 42, 8, 63, 29, 71, 11, 36, 90, 4]


def int4(symmetric):
    return QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=32), None


def fp8(strategy, dynamic_activations):
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy)
    acts = QuantizationArgs(
        num_bits=8, type="float", strategy="token" if dynamic_activations else "tensor", dynamic=dynamic_activations
    )
    return weights, acts


SCHEMES = {
    "int4-g32-sym": int4(symmetric=True),
    "int4-g32-asym": int4(symmetric=False),
    "fp8-channel": fp8("channel", dynamic_activations=True),  # llm-compressor's FP8_DYNAMIC
    "fp8-tensor": fp8("tensor", dynamic_activations=False),  # its FP8 (static input_scale)
}


def weight_min_max(weight, args):
    """The per-group / per-channel / per-tensor extremes compressed-tensors' observers would see."""
    if args.strategy == "group":
        grouped = weight.unflatten(-1, (-1, args.group_size))
        return grouped.amin(-1), grouped.amax(-1)
    if args.strategy == "channel":
        return weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    return weight.amin(), weight.amax()


def write_checkpoint(folder, weights, acts=None, ignore=("lm_head",)):
    """A tiny llama quantized and saved by compressed-tensors (config.json included)."""
    model = make_tiny_model("llama", folder)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for _, module in model.named_modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            scale, zero_point = calculate_qparams(*weight_min_max(module.weight, args), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):  # a static activation scale (we ignore it)
                module.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return folder


def decompress(folder):
    """Every tensor of the checkpoint as float32, the quantized ones through the package's
    own per-module decompress (its compressor for the scheme's format)."""
    tensors = load_file(folder / "model.safetensors")
    spec = json.loads((folder / "config.json").read_text())["quantization_config"]
    (scheme,) = QuantizationConfig.model_validate(spec).config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    names = compressor.compression_param_names(scheme)
    modules = {n.rpartition(".")[0] for n in tensors if n.endswith(".weight_scale")}
    out = {}
    for module in modules:
        pieces = {name: tensors.pop(f"{module}.{name}") for name in names}
        tensors.pop(f"{module}.input_scale", None)
        out[f"{module}.weight"] = compressor.decompress(pieces, scheme)["weight"]
    out.update(tensors)
    return {name: t.float().numpy() for name, t in out.items()}


def write_float_copy(folder, tensors, dest):
    """A plain float checkpoint holding `tensors`, with the same config minus quantization."""
    dest.mkdir()
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (dest / "config.json").write_text(json.dumps(config))
    save_file(
        {name: torch.from_numpy(np.ascontiguousarray(t)) for name, t in tensors.items()}, dest / "model.safetensors"
    )
    return dest


@pytest.fixture(scope="module", params=list(SCHEMES))
def case(request, tmp_path_factory):
    """(scheme name, checkpoint folder, loaded model, decompressed tensors, float twin)."""
    root = tmp_path_factory.mktemp(request.param)
    folder = write_checkpoint(root / "quantized", *SCHEMES[request.param])
    reference = decompress(folder)
    loaded = load_model(str(folder), use_cache=False, progress=False)
    twin = load_model(str(write_float_copy(folder, reference, root / "float")), use_cache=False, progress=False)
    return request.param, folder, loaded, reference, twin


def dequantized(linear):
    """A QuantizedLinear's weight as float32 [K, N]."""
    if linear.kind == "int4":
        return np.asarray(dequantize_int4(linear.packed[...], linear.scales[...], linear.offsets[...]))
    return np.asarray(linear.weight[...]).astype(np.float32) * np.asarray(linear.scales[...])


def test_scheme_is_read_from_the_config(case):
    name, _, loaded, _, _ = case
    assert loaded.quantization.method == "compressed-tensors"
    assert loaded.quantization.kind == name.split("-")[0]
    if name.startswith("int4"):
        assert loaded.quantization.group_size == 32


def test_unpacked_weights_equal_the_packages_decompression(case):
    name, _, loaded, reference, _ = case
    for layer in range(loaded.config.num_layers):
        for projection in PROJECTIONS:
            block, proj = projection.split(".")
            ours = dequantized(getattr(getattr(loaded.model.layers[layer], block), proj))
            theirs = reference[f"model.layers.{layer}.{projection}.weight"].T
            if name.startswith("fp8"):  # e4m3 -> f32 is exact, then one f32 product in both
                np.testing.assert_array_equal(ours, theirs)
            else:  # scale * nibble + offset against scale * (q - zp): float32 rounding only
                np.testing.assert_allclose(
                    ours, theirs, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(theirs).max()
                )


def forward_logits(loaded, tokens):
    """Logits at every position of one prompt (a straight prefill, no engine)."""
    seqs = PagedSequences([len(tokens)], 4, 8)
    kv = allocate_kv_cache(loaded.config, 8, 4, loaded.model.dtype)
    logits, _ = loaded.model(seqs.step([tokens], [(0, len(tokens))], all_logits=True), kv)
    return np.asarray(logits)


def test_logits_match_the_decompressed_float_model(case):
    """int4 is weight-only and its weights equal the float twin's to float32 rounding, so
    the logits agree to float32 noise. fp8 also quantizes each token's activations to e4m3
    (3 mantissa bits: up to 2**-4 relative per element) before every projection; over three
    layers that moves these logits by about 7% of their range (measured: 0.25 of 3.5), so
    the bound is 15%. A wrong layout, scale or zero point moves them by order one."""
    name, _, loaded, _, twin = case
    ours, ref = forward_logits(loaded, PROMPT), forward_logits(twin, PROMPT)
    scale = np.abs(ref).max()
    if name.startswith("int4"):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * scale)
    else:
        assert np.abs(ours - ref).max() <= 0.15 * scale
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


def test_engine_serves_the_quantized_checkpoint(case):
    """Greedy generation through the engine; its first step's log-probabilities are the
    float twin's (int4: float32 noise; fp8: measured up to 0.24 over all positions, bound 0.4)."""
    name, _, loaded, _, twin = case
    engine = LLMEngine(
        loaded,
        EngineConfig(
            max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, kv_cache_memory=8 << 20, warm_up=False
        ),
    )
    engine.add_request("q", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5))
    (out,) = [o for o in engine.generate_all() if o.request_id == "q"]
    completion = out.outputs[0]
    assert len(completion.token_ids) == 6 and out.finished
    ref = np.asarray(jax.nn.log_softmax(forward_logits(twin, PROMPT)[-1]))
    first = completion.logprobs[0]
    assert completion.token_ids[0] in first
    got = np.array([first[t] for t in first])
    want = ref[list(first)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 if name.startswith("int4") else 0.4)
    if name.startswith("int4"):
        assert completion.token_ids[0] == int(ref.argmax())


# -- refusals -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def int4_folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("int4") / "ckpt", *SCHEMES["int4-g32-asym"])


def with_config(src, dest, change):
    """A copy of checkpoint `src` whose quantization_config is changed by `change(spec)`."""
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    change(config["quantization_config"])
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_another_quant_method_is_refused_by_name(tmp_path, int4_folder):
    def bitsandbytes(spec):
        spec.clear()
        spec.update(quant_method="bitsandbytes", load_in_4bit=True)

    folder = with_config(int4_folder, tmp_path / "bnb", bitsandbytes)
    refused = r"quant_method 'bitsandbytes' is not supported.*--quantization int4\|int8\|fp8"
    with pytest.raises(WeightError, match=refused):
        load_model(str(folder), use_cache=False, progress=False)


def test_unsupported_format_is_refused_by_name(tmp_path, int4_folder):
    def naive(spec):
        spec["format"] = spec["config_groups"]["group_0"]["format"] = "naive-quantized"

    folder = with_config(int4_folder, tmp_path / "naive", naive)
    with pytest.raises(WeightError, match="'naive-quantized' with int4 weights"):
        load_model(str(folder), use_cache=False, progress=False)


def test_asking_for_another_scheme_is_a_value_error(int4_folder):
    with pytest.raises(ValueError, match="already quantized.*cannot be loaded as 'fp8'"):
        load_model(str(int4_folder), quantization="fp8", use_cache=False, progress=False)


def test_group_size_that_does_not_divide_k_is_named(tmp_path, int4_folder):
    """compressed-tensors itself cannot group K=96 (down_proj) by 64, so such a config can
    only be a damaged or hand-edited one; the error names the layer, K and the group."""

    def group64(spec):
        spec["config_groups"]["group_0"]["weights"]["group_size"] = 64

    folder = with_config(int4_folder, tmp_path / "g64", group64)
    with pytest.raises(WeightError, match=r"down_proj: K=96 is not a multiple of the int4 group size 64"):
        load_model(str(folder), use_cache=False, progress=False)


def test_a_projection_left_in_float_is_refused(tmp_path):
    """One layer's down_proj left in float: the package writes its exact name into the
    ignore list, which the config check refuses; written as a regex that layer 0's names
    cannot judge, reading the tensors finds it unquantized."""
    folder = write_checkpoint(
        tmp_path / "mixed", *SCHEMES["int4-g32-sym"], ignore=("lm_head", r"re:model\.layers\.2\.mlp\.down_proj$")
    )
    with pytest.raises(WeightError, match=r"ignore entry 'model\.layers\.2\.mlp\.down_proj' leaves mlp\.down_proj"):
        load_model(str(folder), use_cache=False, progress=False)

    def regex(spec):
        spec["ignore"] = ["lm_head", r"re:.*layers\.2\.mlp\.down_proj$"]

    folder = with_config(folder, tmp_path / "regex", regex)
    with pytest.raises(WeightError, match=r"model\.layers\.2\.mlp\.down_proj is stored unquantized"):
        load_model(str(folder), use_cache=False, progress=False)


def spec_of(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def changed(spec, path, value):
    spec = copy.deepcopy(spec)
    *parents, leaf = path
    node = spec
    for key in parents:
        node = node[key]
    node[leaf] = value
    return spec


W = ("config_groups", "group_0", "weights")


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("quant_method",), "awq", "quant_method 'awq' is not supported"),
        (("quant_method",), "fp8", "quant_method 'fp8' is not supported"),
        (("config_groups", "group_0", "format"), "nvfp4-pack-quantized", "'nvfp4-pack-quantized'"),
        (W + ("strategy",), "channel", "int4 weights \\(strategy 'channel'\\)"),
        (W + ("num_bits",), 8, "int8 weights"),
        (W + ("actorder",), "group", "actorder 'group'"),
        (
            ("config_groups", "group_0", "input_activations"),
            {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
            "int8 activations",
        ),
        (("ignore",), ["lm_head", "model.layers.1.self_attn.k_proj"], "leaves self_attn.k_proj unquantized"),
        (("ignore",), [], "quantizes lm_head"),
        (("config_groups", "group_0", "targets"), ["re:.*self_attn.*"], "leave mlp.gate_proj unquantized"),
        (("sparsity_config",), {"format": "sparse-24-bitmask"}, "sparsity"),
    ],
)
def test_unsupported_configs_are_named(int4_folder, path, value, message):
    with pytest.raises(WeightError, match=message):
        checkpoint_quant_config(changed(spec_of(int4_folder), path, value))


def test_mixed_schemes_are_refused(int4_folder):
    spec = spec_of(int4_folder)
    attention = copy.deepcopy(spec["config_groups"]["group_0"])
    attention.update(
        targets=["re:.*self_attn.*"],
        format="float-quantized",
        weights={"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
    )
    spec["config_groups"] = {
        "attention": attention,
        "mlp": {**spec["config_groups"]["group_0"], "targets": ["re:.*mlp.*"]},
    }
    with pytest.raises(WeightError, match="different schemes"):
        checkpoint_quant_config(spec)
