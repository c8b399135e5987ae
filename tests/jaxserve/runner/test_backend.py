"""The attention backend switch (on this CPU: the C++ kernel, else the reference)."""

import dataclasses
import logging

import jax.numpy as jnp
import pytest

from jaxserve.model.config import ModelConfig
from jaxserve.runner.kernels import select_attention
from pallas_kernels import cpu_kernels
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

CFG = ModelConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 64, 256)


def test_auto_on_cpu_is_the_cpu_kernel_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kernels"):
        name, fn = select_attention(None, CFG, jnp.bfloat16, 16)
    assert (name, fn) == ("cpu", cpu_kernels.ragged_paged_attention)
    assert "needs a Hopper GPU" in caplog.text


def test_an_8bit_cache_on_cpu_is_the_reference_and_forcing_the_cpu_kernel_is_an_error(caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.kernels"):
        name, fn = select_attention(None, CFG, jnp.float32, 16, kv_dtype=jnp.int8)
    assert (name, fn) == ("reference", ragged_paged_attention_reference)
    assert "cpu kernel not used: it takes float32 or bfloat16" in caplog.text
    with pytest.raises(ValueError, match="CPU attention kernel cannot run"):
        select_attention("cpu", CFG, jnp.float32, 16, kv_dtype=jnp.int8)


def test_without_a_compiler_the_cpu_kernel_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-c++")
    assert "no C++ compiler" in cpu_kernels._build(tmp_path)


def test_forcing_pallas_where_it_cannot_run_is_an_error():
    with pytest.raises(ValueError, match="Pallas attention kernel cannot run"):
        select_attention("pallas", CFG, jnp.bfloat16, 16)


def test_environment_variable_and_unknown_names(monkeypatch):
    monkeypatch.setenv("JAXSERVE_ATTENTION_BACKEND", "reference")
    assert select_attention(None, CFG, jnp.float32, 16)[0] == "reference"
    monkeypatch.setenv("JAXSERVE_ATTENTION_BACKEND", "pallas")
    with pytest.raises(ValueError):
        select_attention(None, CFG, jnp.float32, 16)
    with pytest.raises(ValueError, match="not one of"):
        select_attention("triton", CFG, jnp.float32, 16)


class FakeHopper:
    platform, compute_capability, device_kind = "gpu", "9.0", "NVIDIA H100 (pretend)"


@pytest.mark.parametrize("kv_dtype", [None, "uint8", "int8"])
def test_the_kernel_serves_bf16_models_and_8bit_caches_on_hopper(kv_dtype):
    from jaxserve.runner.kernels import pallas_unsupported_reason

    assert pallas_unsupported_reason(CFG, jnp.bfloat16, 16, FakeHopper(), kv_dtype) is None
    # A float32 model is refused, with or without an 8-bit cache.
    assert "bf16" in pallas_unsupported_reason(CFG, jnp.float32, 16, FakeHopper(), kv_dtype)


def test_lora_takes_the_sgmv_kernel_on_hopper_with_a_bf16_model_on_one_device():
    import jax

    from jaxserve.runner.kernels import lora_kernel_unsupported_reason

    assert lora_kernel_unsupported_reason(CFG, jnp.bfloat16, FakeHopper(), tp=1) is None
    assert "bf16" in lora_kernel_unsupported_reason(CFG, jnp.float32, FakeHopper(), tp=1)
    assert "tensor parallelism" in lora_kernel_unsupported_reason(CFG, jnp.bfloat16, FakeHopper(), tp=2)
    assert "Hopper" in lora_kernel_unsupported_reason(CFG, jnp.bfloat16, jax.devices()[0], tp=1)
    odd = dataclasses.replace(CFG, intermediate_size=96)  # gate/up outputs not a multiple of 64
    assert "gate_proj" in lora_kernel_unsupported_reason(odd, jnp.bfloat16, FakeHopper(), tp=1)
