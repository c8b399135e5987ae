"""The dense SwiGLU MLP, and the linear layer every projection is made with (float or quantized)."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.quantization import QuantConfig, QuantizedLinear, project


def _kernel_dot_general(x, kernel, dimension_numbers, precision=None, *, interpret: bool, **_):
    """nnx.Linear's product x [..., K] @ kernel [K, N] through the Mosaic GPU dense kernel in its
    batch-invariant config (a row's sum over K in one order whatever the rows)."""
    from pallas_kernels import quantized_matmul_mgpu as mgpu

    del dimension_numbers, precision  # always x's last axis with kernel's first
    y = mgpu.dense_matmul(x.reshape(-1, x.shape[-1]), kernel, batch_invariant=True, interpret=interpret or None)
    return y.reshape(*x.shape[:-1], kernel.shape[-1])


# One object per mode, so every layer's graph (which holds it) stays equal and compiles once.
KERNEL_DOT_GENERAL = {mode: functools.partial(_kernel_dot_general, interpret=mode) for mode in (False, True)}


def linear(dtype, din: int, dout: int, bias: bool, rngs: nnx.Rngs, quant: QuantConfig | None = None, name: str = ""):
    """A float projection, or with `quant` a quantized one: the layout `quant` gives `name`."""
    if quant is not None:
        return QuantizedLinear(din, dout, use_bias=bias, quant=quant.at(name), dtype=dtype)
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class MLP(nnx.Module):
    """down(silu(gate(x)) * up(x)); `intermediate_size` defaults to the config's (a MoE
    model's shared expert has its own)."""

    def __init__(
        self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quant: QuantConfig | None = None, intermediate_size: int = 0
    ):
        d, f = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_proj = linear(dtype, d, f, False, rngs, quant, "gate_proj")
        self.up_proj = linear(dtype, d, f, False, rngs, quant, "up_proj")
        self.down_proj = linear(dtype, f, d, False, rngs, quant, "down_proj")

    def __call__(self, x):
        with jax.named_scope("mlp"):
            gate, up = project(x, self.gate_proj, self.up_proj)
            return self.down_proj(jax.nn.silu(gate) * up)
