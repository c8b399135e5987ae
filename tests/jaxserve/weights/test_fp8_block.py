"""Block-wise FP8 checkpoints (`quant_method: "fp8"` with `weight_block_size`, as DeepSeek-V3
and Qwen3's FP8 releases ship) against transformers reading the same files: its
FineGrainedFP8 integration with `dequantize=True` (its own dequantizer, which runs on the
CPU) gives the float model our layers must stand for. The checkpoints are written here with
torch's own e4m3 rounding, a scale per block.

Where a block size does not divide a weight, the last block is partial and keeps its own
scale (DeepSeek's and vLLM's reading: scale [i // bn, j // bk] over a ceil-sized grid).
transformers' load-time dequantizer derives the block from the grid instead (rows // grid
rows: a 96-row weight in blocks of 64 is read as two blocks of 48), so those cases are
checked against its `_dequantize_fp8_weight`, which takes the block size as given (the one
its FP8 layers' backward pass uses), and a float model holding those weights."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxserve.model.quantization import quantized_layers
from jaxserve.weights import load_model
from jaxserve.weights.params import WeightError
from pallas_kernels.quantized_matmul import dequantize_fp8_block
from tests.jaxserve.weights.test_compressed_tensors import PROMPT, forward_logits
from tests.tiny_models import make_tiny_model


def write_block_fp8(folder, block: tuple[int, int], **spec_changes) -> None:
    """The tiny llama (K and N of 64 and 96) with every projection in e4m3 and a float32
    scale (amax / 448) per block of block[0] outputs by block[1] inputs."""
    make_tiny_model("llama", folder)
    tensors = load_file(folder / "model.safetensors")
    bn, bk = block
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]
        n, k = w.shape
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        padded[:n, :k] = w
        blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:n, :k]
        tensors[name] = q.to(torch.float8_e4m3fn).contiguous()
        tensors[name.replace(".weight", ".weight_scale_inv")] = scale.float().contiguous()
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    spec = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    config["quantization_config"] = {**spec, **spec_changes}
    (folder / "config.json").write_text(json.dumps(config))


def transformers_dequantized(folder, block):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    config = FineGrainedFP8Config(dequantize=True, weight_block_size=block)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.float32).eval()


@pytest.mark.parametrize("block", [(32, 32), (16, 32), (64, 64), (64, 32)])
def test_weights_and_logits_equal_transformers_dequantizing_the_checkpoint(tmp_path, block):
    """Every projection equals transformers' dequantized weight to the last bit, and the
    logits its forward pass's. Blocks of 64 leave partial blocks on K and N of 96."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    write_block_fp8(tmp_path, block)
    loaded = load_model(str(tmp_path), use_cache=False, progress=False)
    assert loaded.quantization.label == f"fp8 (fp8 e4m3, {block[0]}x{block[1]} block scales)"
    theirs = transformers_dequantized(tmp_path, block)
    partial = 64 in block
    stored = load_file(tmp_path / "model.safetensors")
    layers = dict(quantized_layers(loaded.model))
    assert len(layers) == 7 * loaded.config.num_layers
    for path, layer in layers.items():
        i, block_name, proj = path.split("/")[1:4]
        linear = getattr(getattr(theirs.model.layers[int(i)], block_name), proj)
        if partial:  # transformers' block-size-aware dequantizer, into its float model
            name = f"model.layers.{i}.{block_name}.{proj}"
            weight = _dequantize_fp8_weight(
                stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"], block, torch.float32
            )
            linear.weight.data.copy_(weight)
        want = linear.weight.detach().numpy().T
        got = np.asarray(dequantize_fp8_block(layer.weight[...], layer.scales[...], layer.block))
        np.testing.assert_array_equal(got, want, err_msg=path)
    with torch.no_grad():
        want = theirs(torch.tensor([PROMPT])).logits[0].double().numpy()
    got = forward_logits(loaded, PROMPT)
    assert np.abs(want).max() > 0.1 and np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_what_cannot_be_served_as_stored_is_refused_by_name(tmp_path):
    write_block_fp8(tmp_path / "static", (32, 32), activation_scheme="static")
    with pytest.raises(WeightError, match="'static' activation scales is not supported"):
        load_model(str(tmp_path / "static"), use_cache=False, progress=False)
    write_block_fp8(tmp_path / "per-tensor", (32, 32), weight_block_size=None)
    with pytest.raises(WeightError, match="weight_block_size None is not supported"):
        load_model(str(tmp_path / "per-tensor"), use_cache=False, progress=False)
    write_block_fp8(tmp_path / "partly", (32, 32), modules_to_not_convert=["lm_head", "model.layers.0.mlp.down_proj"])
    with pytest.raises(WeightError, match="leaves model.layers.0.mlp.down_proj unquantized"):
        load_model(str(tmp_path / "partly"), use_cache=False, progress=False)
    write_block_fp8(tmp_path / "good", (32, 32))
    with pytest.raises(ValueError, match="already quantized.*cannot be loaded as 'int4'"):
        load_model(str(tmp_path / "good"), use_cache=False, quantization="int4")


def test_the_engine_serves_it_batched_as_alone_and_from_the_weight_cache(tmp_path):
    from jaxserve.engine import EngineConfig, LLMEngine
    from jaxserve.model.sizing import Setup
    from jaxserve.weights import cache
    from tests.jaxserve.engine.test_engine import run_alone, run_batched, workload

    write_block_fp8(tmp_path / "ckpt", (32, 32))
    first = load_model(str(tmp_path / "ckpt"), cache_dir=tmp_path / "cache", progress=False)
    again = load_model(str(tmp_path / "ckpt"), cache_dir=tmp_path / "cache", progress=False)
    assert (first.from_cache, again.from_cache) == (False, True)
    assert [e.variant for e in cache.list_entries(tmp_path / "cache")] == ["float32-fp8-fp8_block"]
    assert Setup(first.config, "float32", first.quantization, "float32", 1, False).weight_bytes == first.weight_bytes
    np.testing.assert_array_equal(forward_logits(again, PROMPT), forward_logits(first, PROMPT))
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=256, max_model_len=128)
    prompts, params = workload(count=8)
    want = run_alone(LLMEngine(again, EngineConfig(**cfg, enable_prefix_caching=False)), prompts, params)
    assert run_batched(LLMEngine(again, EngineConfig(**cfg)), prompts, params) == want
