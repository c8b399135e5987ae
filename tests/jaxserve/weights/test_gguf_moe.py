"""GGUF mixtures of experts (llama.cpp's stacked `blk.N.ffn_gate_exps` [E, F, D]; Mixtral
under the `llama` architecture with an expert count) are refused by name, before any weight
is read: the Hugging Face folder of the same model loads, quantized or not."""

import numpy as np
import pytest

from jaxserve.model.config import UnsupportedModelError
from jaxserve.weights import load_model

E, F, D = 4, 32, 64


def write_moe_gguf(path, arch: str, expert_count: bool = True) -> None:
    """A GGUF file with the metadata and stacked expert tensors llama.cpp writes for a MoE."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(D)
    writer.add_head_count(4)
    if expert_count:
        writer.add_expert_count(E)
        writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((97, D), np.float32))
    writer.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((E, D), np.float32))
    for name, shape in (("ffn_gate_exps", (E, F, D)), ("ffn_up_exps", (E, F, D)), ("ffn_down_exps", (E, D, F))):
        writer.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "arch, expert_count, named",
    [
        ("llama", True, r"architecture 'llama', 4 experts"),  # Mixtral, as llama.cpp converts it
        ("llama", False, r"architecture 'llama'\)"),  # stacked expert tensors alone
        ("qwen3moe", True, r"architecture 'qwen3moe', 4 experts"),
        ("qwen2moe", True, r"architecture 'qwen2moe', 4 experts"),
    ],
)
@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_moe_gguf_is_refused_by_name(tmp_path, arch, expert_count, named, quantization):
    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, arch, expert_count)
    with pytest.raises(
        UnsupportedModelError,
        match=rf"GGUF mixture-of-experts models are not supported \({named}.*"
        r"Hugging Face safetensors folder",
    ):
        load_model(str(path), use_cache=False, progress=False, quantization=quantization)
