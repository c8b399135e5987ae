"""LoRA on the device: slot stacks per projection and the batched gather-matmul (BGMV).

Each decoder layer gets a `LayerLoRA` holding, for every target module,

    A  [max_loras + 1, d_in, max_rank]    B  [max_loras + 1, max_rank, d_out]

Slot 0 is "no adapter" and stays zeros; an adapter of a smaller rank is zero padded; PEFT's
scaling is folded into B (jaxserve.lora.peft_adapter). Every token carries its slot
(`ModelInputs.lora_slots`), and each targeted projection adds

    delta[t] = (x[t] @ A[slot[t]]) @ B[slot[t]]

computed as two dense matmuls over all slots at once, the shrink masked to each token's
own slot: [T, d_in] @ [d_in, n * r] -> keep slot[t]'s r columns -> @ [n * r, d_out]. With n
slots of rank r that is n * r extra columns, no [T, d_in, r] gather; it runs on any backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.inputs import ModelInputs

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = TARGET_MODULES[:4]


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each projection an adapter may target."""
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }


class LayerLoRA(nnx.Module):
    """One layer's A and B slot stacks, one pair per target module.

    `kernel`: the products run on the Mosaic GPU SGMV kernel (pallas_kernels.sgmv_mgpu) for
    every step shape it takes, the reference for the others; the stacks' rank is then
    rounded up to the kernel's tile (sgmv_mgpu.kernel_rank), the extra columns zeros.
    `interpret`: the kernel in the Mosaic GPU interpreter (tests)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype, *, kernel=False, interpret=False):
        if kernel:
            from pallas_kernels import sgmv_mgpu  # NOTE: imported where used, as the other kernels

            max_rank = sgmv_mgpu.kernel_rank(max_rank)
        self.layout, self.interpret = ("mgpu" if kernel else "canonical"), interpret
        shapes = projection_shapes(cfg)
        for module in TARGET_MODULES:
            d_in, d_out = shapes[module]
            setattr(self, f"{module}_a", nnx.Param(jnp.zeros((max_loras + 1, d_in, max_rank), dtype)))
            setattr(self, f"{module}_b", nnx.Param(jnp.zeros((max_loras + 1, max_rank, d_out), dtype)))

    def delta(self, module: str, x: jax.Array, slots: jax.Array) -> jax.Array:
        """What the adapters add to `module`'s output for x [T, d_in], slots int32 [T]."""
        a, b = getattr(self, f"{module}_a")[...], getattr(self, f"{module}_b")[...]
        if self.layout == "mgpu":
            from pallas_kernels import sgmv_mgpu

            if sgmv_mgpu.unsupported_reason(x, a, b) is None:  # decided per step shape, at trace time
                return sgmv_mgpu.sgmv(x, a, b, slots, interpret=True if self.interpret else None)
        return bgmv_reference(x, a, b, slots)


def bgmv_reference(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """(x[t] @ a[slots[t]]) @ b[slots[t]] for every t, in plain jnp.

    x [T, d_in]; a [n, d_in, r]; b [n, r, d_out]; slots int32 [T] -> [T, d_out] in x's dtype."""
    n, _, r = a.shape
    shrunk = jnp.einsum("td,ndr->tnr", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    own = slots[:, None] == jnp.arange(n, dtype=slots.dtype)[None, :]  # [T, n]
    shrunk = jnp.where(own[:, :, None], shrunk, 0.0).astype(x.dtype)
    out = jnp.einsum("tnr,nro->to", shrunk, b.astype(x.dtype), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def attach_lora(model, max_loras: int, max_rank: int, *, kernel: bool = False, interpret: bool = False) -> None:
    """Give every layer of `model` (a DecoderLM with separate layers, see unstack_layers) empty
    slot stacks; its forward pass then takes `ModelInputs.lora_slots`. `kernel`, `interpret`:
    LayerLoRA's (jaxserve.runner.kernels.lora_kernel_unsupported_reason decides)."""
    if not isinstance(model.layers, nnx.List):
        raise ValueError("LoRA needs a model with separate layers (jaxserve.model.decoder.unstack_layers)")
    if model.cfg.is_moe:
        raise ValueError("LoRA adapters on a mixture-of-experts model are not supported yet")
    if model.quantization is not None:
        raise ValueError("LoRA adapters on a quantized base model are not supported yet")
    for layer in model.layers:
        layer.lora = LayerLoRA(model.cfg, max_loras, max_rank, model.dtype, kernel=kernel, interpret=interpret)


def write_slot(stacks, slot, values):
    """The stacks (a pytree of [n, ...] arrays) with `slot` replaced by `values` (the same tree
    of [...] arrays, zero padded up to the stacks' rank where the kernel rounded it up).
    Jitted with the stacks donated: an in-place update, one program for every slot."""

    def write(stack, v):
        v = jnp.pad(v.astype(stack.dtype), [(0, s - n) for s, n in zip(stack.shape[1:], v.shape)])
        return jax.lax.dynamic_update_index_in_dim(stack, v, slot, 0)

    return jax.tree.map(write, stacks, values)


def lora_layer(carry, layer, inputs: ModelInputs, inv_freq, attention):
    """A dense decoder layer whose projections each add their adapters' delta (BGMV); carry as
    jaxserve.model.decoder._layer's: (x, the cache, layer index)."""
    x, kv, layer_idx = carry
    slots, lora, attn, mlp = inputs.lora_slots, layer.lora, layer.self_attn, layer.mlp
    with jax.named_scope("norm"):
        h = layer.input_layernorm(x)
    with jax.named_scope("qkv_proj"):
        q, k, v = (getattr(attn, m)(h) + lora.delta(m, h, slots) for m in _ATTENTION[:3])
    out, kv = attn.attend(q, k, v, inputs, kv, layer_idx, inv_freq, attention)
    with jax.named_scope("o_proj"):
        x = x + attn.o_proj(out) + lora.delta("o_proj", out, slots)
    with jax.named_scope("norm"):
        h = layer.post_attention_layernorm(x)
    with jax.named_scope("mlp"):
        gate = mlp.gate_proj(h) + lora.delta("gate_proj", h, slots)
        up = mlp.up_proj(h) + lora.delta("up_proj", h, slots)
        hidden = jax.nn.silu(gate) * up
        x = x + mlp.down_proj(hidden) + lora.delta("down_proj", hidden, slots)
    return x, kv, layer_idx + 1
