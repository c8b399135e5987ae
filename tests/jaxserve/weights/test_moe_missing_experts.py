"""A MoE checkpoint missing one expert's tensor is refused with that tensor's own name, in
the checkpoint's words (Mixtral's `block_sparse_moe.experts.3.w3`), float, quantized while
loading, and in a compressed-tensors checkpoint."""

import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.weights import load_model
from jaxserve.weights.params import WeightError
from tests.jaxserve.weights.test_compressed_tensors import SCHEMES
from tests.jaxserve.weights.test_moe_compressed_tensors import MODELS, write_moe_checkpoint
from tests.tiny_models import make_tiny_model

MISSING = {  # the tensor taken out of each model's checkpoint
    "mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",
    "qwen2-moe": "model.layers.0.mlp.experts.3.up_proj.weight",
    "qwen3-moe": "model.layers.0.mlp.experts.3.up_proj.weight",
}


@pytest.fixture(scope="module", params=list(MODELS))
def moe(request, tmp_path_factory):
    """(model name, float checkpoint folder)."""
    folder = tmp_path_factory.mktemp(request.param) / "float"
    make_tiny_model(request.param, folder, **MODELS[request.param][0])
    return request.param, folder


def drop_tensors(folder, prefix):
    """Take every tensor whose name starts with `prefix` out of the checkpoint."""
    tensors = load_file(folder / "model.safetensors")
    kept = {name: t for name, t in tensors.items() if not name.startswith(prefix)}
    assert len(kept) < len(tensors)
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("quantization", [None, "int4", "fp8"])
def test_a_missing_expert_is_named(moe, tmp_path, quantization):
    name, folder = moe
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "model.safetensors"):
        (broken / f).write_bytes((folder / f).read_bytes())
    drop_tensors(broken, MISSING[name])
    with pytest.raises(WeightError, match=rf"checkpoint is missing {MISSING[name].replace('.', '[.]')}$"):
        load_model(str(broken), use_cache=False, progress=False, quantization=quantization)


def test_a_missing_expert_of_a_compressed_tensors_checkpoint_is_named(moe, tmp_path):
    name, folder = moe
    broken = write_moe_checkpoint(tmp_path / "ct", folder, *SCHEMES["int4-g32-sym"], MODELS[name][1])
    drop_tensors(broken, MISSING[name].removesuffix("weight"))  # its weight_packed, weight_scale, weight_shape
    with pytest.raises(WeightError, match=rf"checkpoint is missing {MISSING[name].replace('.', '[.]')}$"):
        load_model(str(broken), use_cache=False, progress=False)
