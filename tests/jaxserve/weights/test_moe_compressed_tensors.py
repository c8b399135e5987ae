"""compressed-tensors checkpoints of mixtures of experts, written by the package itself.

transformers 5 holds the experts fused ([E, 2F, D] parameters, no Linear modules), but the
checkpoints llm-compressor wrote (and the safetensors a MoE checkpoint has) name each
expert's projections as a module of its own. So the checkpoint is quantized on a module tree
built from the float safetensors' names (one torch Linear per projection, per expert) with
compressed-tensors' own QuantizationConfig, qparams and ModelCompressor, the router (and
Qwen2-MoE's shared expert gate) in `ignore` as real MoE checkpoints have them. The oracle for
unpacking is the package's own `decompress`; for serving, transformers on those weights.
"""

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

from jaxserve.model.moe import QuantizedExpertLinear, SparseMoE
from jaxserve.weights import load_model
from jaxserve.weights.params import WeightError
from tests.jaxserve.model.test_moe_quantization import hf_logits, set_hf_weights_to_dequantized
from tests.jaxserve.weights.test_compressed_tensors import (
    SCHEMES,
    decompress,
    dequantized,
    forward_logits,
    weight_min_max,
)
from tests.tiny_models import make_tiny_model

MODELS = {  # name -> (config overrides for int4's group of 32, the float modules real checkpoints ignore)
    "mixtral": (dict(intermediate_size=64), ["lm_head", "re:.*block_sparse_moe.gate$"]),
    "qwen2-moe": (dict(shared_expert_intermediate_size=64), ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]),
    "qwen3-moe": ({}, ["lm_head", "re:.*mlp.gate$"]),
}
PROMPTS = [[5, 17, 42, 8, 63, 29, 71, 11, 36, 90, 4], [3], [60, 61, 9, 2, 44]]


def module_tree(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A torch module tree named as the checkpoint: a Linear for every 2-D weight but the
    embeddings (with its bias if it has one), plain parameters for the rest (state_dict()
    gives the checkpoint's names)."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        node = root
        for part in path[:-1]:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        bias = tensors.get(".".join(path + ["bias"]))
        if leaf == "weight" and tensor.ndim == 2 and path[-1] != "embed_tokens":
            linear = torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=bias is not None)
            linear.weight.data.copy_(tensor)
            if bias is not None:
                linear.bias.data.copy_(bias)
            node.add_module(path[-1], linear)
        elif leaf == "bias" and ".".join(path + ["weight"]) in tensors:
            continue  # its Linear's, added with the weight
        else:
            if not hasattr(node, path[-1]):
                node.add_module(path[-1], torch.nn.Module())
            getattr(node, path[-1]).register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def write_moe_checkpoint(folder, float_folder, weights, acts, ignore):
    """The float checkpoint in `float_folder` quantized by compressed-tensors into `folder`."""
    folder.mkdir()
    tree = module_tree(load_file(float_folder / "model.safetensors"))
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    apply_quantization_config(tree, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore))
    with torch.no_grad():
        for _, module in tree.named_modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            scale, zero_point = calculate_qparams(*weight_min_max(module.weight, args), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):
                module.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.compress_model(tree)
    save_file({k: v.contiguous() for k, v in tree.state_dict().items()}, folder / "model.safetensors")
    shutil.copy(float_folder / "config.json", folder / "config.json")
    compressor.update_config(folder)
    return folder


@pytest.fixture(scope="module", params=list(MODELS))
def float_moe(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "float"
    overrides, ignore = MODELS[request.param]
    return folder, make_tiny_model(request.param, folder, **overrides), ignore


@pytest.mark.parametrize("scheme", ["int4-g32-asym", "fp8-channel"])
def test_moe_checkpoint_loads_per_expert_and_equals_transformers(float_moe, scheme, tmp_path):
    float_folder, hf_model, ignore = float_moe
    folder = write_moe_checkpoint(tmp_path / "quantized", float_folder, *SCHEMES[scheme], ignore)
    stored = load_file(folder / "model.safetensors")
    assert any(".experts.3." in n and n.endswith((".weight_packed", ".weight")) for n in stored)
    assert not any(n.rsplit(".", 2)[-2] == "gate" and n.endswith("_scale") for n in stored), "router stays float"
    loaded = load_model(str(folder), use_cache=False, progress=False)
    assert loaded.quantization.method == "compressed-tensors" and loaded.quantization.kind == scheme.split("-")[0]

    # each expert's weights, unpacked by us, equal the package's own decompression
    reference = decompress(folder)
    mixtral = loaded.config.architecture == "MixtralForCausalLM"
    names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"} if mixtral else None
    for i, layer in enumerate(loaded.model.layers):
        if not isinstance(layer.mlp, SparseMoE):
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = getattr(layer.mlp.experts, proj)
            assert isinstance(stacked, QuantizedExpertLinear)
            for e in range(loaded.config.num_experts):
                ours = dequantized(_row(stacked, e))
                module = f"block_sparse_moe.experts.{e}.{names[proj]}" if mixtral else f"mlp.experts.{e}.{proj}"
                theirs = reference[f"model.layers.{i}.{module}.weight"].T
                np.testing.assert_allclose(
                    ours, theirs, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(theirs).max()
                )

    # and the model serves what transformers computes on them (fp8: with e4m3 activations)
    hf_model = copy.deepcopy(hf_model)
    set_hf_weights_to_dequantized(hf_model, loaded)
    want = hf_logits(hf_model, PROMPTS, scheme.split("-")[0])
    for prompt, w in zip(PROMPTS, want):
        got = np.asarray(forward_logits(loaded, prompt), np.float64)
        assert np.abs(got - w).max() <= 1e-4


def test_a_quantized_router_is_refused_by_name(float_moe, tmp_path):
    float_folder, _, _ = float_moe
    folder = write_moe_checkpoint(tmp_path / "quantized", float_folder, *SCHEMES["int4-g32-sym"], ["lm_head"])
    with pytest.raises(WeightError, match=r"(mlp|block_sparse_moe)\.gate is quantized in this checkpoint.*MoE router"):
        load_model(str(folder), use_cache=False, progress=False)


def test_targets_must_cover_the_experts(float_moe, tmp_path):
    float_folder, _, ignore = float_moe
    folder = write_moe_checkpoint(tmp_path / "quantized", float_folder, *SCHEMES["int4-g32-sym"], ignore)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = [
        "re:.*self_attn.*",
        "re:.*mlp\\.[a-z]+_proj$",
    ]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightError, match=r"leave .*experts\.0\.(gate_proj|w1) unquantized"):
        load_model(str(folder), use_cache=False, progress=False)


class _row:
    """Expert e of a stacked quantized projection, shaped as a QuantizedLinear for `dequantized`."""

    def __init__(self, stacked: QuantizedExpertLinear, e: int):
        self.kind = stacked.kind
        names = ("packed", "scales", "offsets") if stacked.kind == "int4" else ("weight", "scales")
        for name in names:
            setattr(self, name, np.asarray(getattr(stacked, name)[...])[e])
