"""Adapter folders this engine cannot serve are refused with a message naming the field."""

import json

import pytest
import torch

from jaxserve.lora.peft_adapter import LoRAConfigError, load_peft_adapter, lora_scaling, write_peft_adapter
from jaxserve.weights import load_model
from tests.tiny_lora import make_peft_adapter
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    hf = make_tiny_model("llama", root / "base")
    small = make_tiny_model("llama", root / "small", hidden_size=32, intermediate_size=48)
    return root, hf, small, load_model(str(root / "base"), use_cache=False, progress=False).config


def edited(root, hf, name, **changes):
    folder = root / name
    make_peft_adapter(hf, folder, r=4, seed=0)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
        ({"target_modules": ["lm_head"]}, "target_modules"),
        ({"r": 32}, "max_lora_rank"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "peft_type"),
    ],
)
def test_unsupported_configs_name_the_field(base, changes, field):
    root, hf, _, config = base
    folder = edited(root, hf, f"bad-{field}-{len(json.dumps(changes))}", **changes)
    with pytest.raises(LoRAConfigError, match=field):
        load_peft_adapter(folder, config, max_lora_rank=16)


def test_adapter_of_another_base_size_is_refused(base):
    root, _, small, config = base
    make_peft_adapter(small, root / "other", r=4, seed=0)
    with pytest.raises(LoRAConfigError, match=r"shape .* base model needs"):
        load_peft_adapter(root / "other", config, max_lora_rank=16)


def test_not_an_adapter_folder(base, tmp_path):
    with pytest.raises(LoRAConfigError, match="adapter_config.json"):
        load_peft_adapter(tmp_path, base[3], max_lora_rank=16)


def test_scaling_is_peft_s(base):
    """The B read back is PEFT's lora_B times PEFT's own scaling (lora_alpha / r, or / sqrt(r) with rsLoRA)."""
    root, hf, _, config = base
    for rslora in (False, True):
        model = make_peft_adapter(hf, root / f"s{rslora}", r=4, seed=1, lora_alpha=12, use_rslora=rslora)
        layer = model.base_model.model.model.layers[1].self_attn.v_proj
        adapter = load_peft_adapter(root / f"s{rslora}", config, max_lora_rank=16)
        a, b = adapter.weights[1, "v_proj"]
        assert layer.scaling["default"] == lora_scaling(12, 4, rslora)
        want = layer.lora_B["default"].weight.detach().numpy().T * layer.scaling["default"]
        torch.testing.assert_close(torch.tensor(b), torch.tensor(want))
        torch.testing.assert_close(torch.tensor(a), layer.lora_A["default"].weight.detach().T)


def test_written_adapter_is_read_by_peft_as_written(base, tmp_path):
    """write_peft_adapter's folder, loaded by peft itself: each module's lora_A and lora_B are
    the arrays written (peft found every key), and load_peft_adapter reads the same ones."""
    import numpy as np
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from jaxserve.model.lora import projection_shapes

    root, _, _, config = base
    rng = np.random.default_rng(3)
    shapes = projection_shapes(config)
    weights = {
        (layer, module): (rng.standard_normal((4, shapes[module][0])), rng.standard_normal((shapes[module][1], 4)))
        for layer in range(config.num_layers)
        for module in ("q_proj", "v_proj", "down_proj")
    }
    folder = write_peft_adapter(tmp_path / "written", weights, lora_alpha=8)
    hf = AutoModelForCausalLM.from_pretrained(root / "base", torch_dtype=torch.float32).eval()
    layers = PeftModel.from_pretrained(hf, folder).base_model.model.model.layers
    adapter = load_peft_adapter(folder, config, max_lora_rank=16)
    assert adapter.rank == 4 and adapter.target_modules == ("down_proj", "q_proj", "v_proj")
    for (layer, module), (a, b) in weights.items():
        block = layers[layer].mlp if module == "down_proj" else layers[layer].self_attn
        lora = getattr(block, module)
        np.testing.assert_allclose(lora.lora_A["default"].weight.detach().numpy(), a, rtol=1e-6)
        np.testing.assert_allclose(lora.lora_B["default"].weight.detach().numpy(), b, rtol=1e-6)
        assert lora.scaling["default"] == 2.0  # lora_alpha / r
        ours_a, ours_b = adapter.weights[layer, module]
        np.testing.assert_allclose(ours_a, a.T, rtol=1e-6)
        np.testing.assert_allclose(ours_b, b.T * 2.0, rtol=1e-6)
