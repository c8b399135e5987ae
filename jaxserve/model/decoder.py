"""The decoder family: Llama, Mistral, Qwen2 and Qwen3 as one config-driven Flax NNX model.

Parameter names follow Hugging Face (`layers.self_attn.q_proj.kernel` is
`model.layers.{i}.self_attn.q_proj.weight`, transposed), so weight loading is a rename.
A new model stacks its layers on a leading axis and runs them with `lax.scan` (compile
time independent of depth); `unstack_layers`, the layout weight loading returns, makes
them separate and unrolled (faster steps, see there). Shapes: T tokens on the flat axis,
D hidden, H query heads, KV key/value heads, Dh head_dim, S sequences.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.fixed_order import fixed_order_sum, in_fixed_row_blocks
from jaxserve.model.inputs import ModelInputs
from jaxserve.model.kv_cache import KVCache, fold_layers, write_kv
from jaxserve.model.lora import lora_layer
from jaxserve.model.mlp import MLP, linear
from jaxserve.model.moe import SparseMoE
from jaxserve.model.quantization import Int8Table, QuantConfig, QuantizedLinear, project
from pallas_kernels import cpu_kernels
from pallas_kernels.quantized_kv import rescale_for
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

AttentionFn = Callable[..., jax.Array]  # the signature of ragged_paged_attention_reference


class RMSNorm(nnx.Module):
    # Batch invariance on a GPU (runner.kernels marks it): the sum of squares in an order set
    # by the row's length alone (fixed_order_sum), not by XLA's reduction for the array's shape.
    fixed_order = False

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        if self.fixed_order:
            # NOTE: the squares apart, as a precaution: fused into the adds, LLVM may contract a
            # square and an add into one FMA (rounded once) in one code path and not another.
            mean_square = (fixed_order_sum(jax.lax.optimization_barrier(h * h)) / h.shape[-1])[..., None]
        else:
            mean_square = jnp.mean(h * h, axis=-1, keepdims=True)
        h = h * jax.lax.rsqrt(mean_square + self.eps)
        return self.weight[...] * h.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class FewRowKernels:
    """Which few-row products (a decode step's) the CPU kernels serve, up to how many rows,
    as jaxserve.runner.kernels.select_matmul chose them; 0 rows: XLA serves them all. The
    model follows this choice and makes none of its own."""

    # A decoder layer's two halves (cpu_kernels.norm_qkv and o_proj_mlp, or their quantized_ forms).
    layer_rows: int = 0
    lm_head_rows: int = 0  # a tied LM head's product (cpu_kernels.small_matmul)
    # Batch invariance: every row of the layers and the LM head (tied or not) through the
    # kernels, in blocks (cpu_kernels.in_row_blocks): a row's result then depends on its
    # own values alone, not on how many rows the step has (XLA's dot blocks K by M).
    batch_invariant: bool = False


def _fits(x: jax.Array, w: jax.Array, max_rows: int) -> bool:
    """x [rows, K] goes to a kernel chosen for up to `max_rows` rows of w's dtype."""
    return x.ndim == 2 and x.shape[0] <= max_rows and x.dtype == w.dtype


def _fits_layer_kernels(x: jax.Array, layer: DecoderLayer, max_rows: int) -> bool:
    """x [rows, D] goes to the layer kernels chosen for up to `max_rows` rows: the float ones
    take the weights' dtype, the quantized ones float32 or bfloat16."""
    q_proj = layer.self_attn.q_proj
    if isinstance(q_proj, QuantizedLinear):
        return x.ndim == 2 and x.shape[0] <= max_rows and x.dtype in cpu_kernels.KV_DTYPES
    return _fits(x, q_proj.kernel, max_rows)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, Hugging Face's rotate-half convention. x: [T, heads, Dh]."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quant: QuantConfig | None = None):
        d, h, kv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = linear(dtype, d, h * dh, cfg.attention_bias, rngs, quant, "q_proj")
        self.k_proj = linear(dtype, d, kv * dh, cfg.attention_bias, rngs, quant, "k_proj")
        self.v_proj = linear(dtype, d, kv * dh, cfg.attention_bias, rngs, quant, "v_proj")
        self.o_proj = linear(dtype, h * dh, d, cfg.o_proj_bias, rngs, quant, "o_proj")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, dtype)
        if cfg.kv_scales is not None:  # the checkpoint's calibrated scales per KV head, for an 8-bit cache
            self.k_scale = nnx.Param(jnp.ones(kv, jnp.float32))
            self.v_scale = nnx.Param(jnp.ones(kv, jnp.float32))
        self.cfg = cfg

    def __call__(self, x, inputs: ModelInputs, kv: KVCache, layer_idx, inv_freq, attention: AttentionFn):
        with jax.named_scope("qkv_proj"):
            q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        out, kv = self.attend(q, k, v, inputs, kv, layer_idx, inv_freq, attention)
        with jax.named_scope("o_proj"):
            return self.o_proj(out), kv

    def attend(
        self,
        q,
        k,
        v,
        inputs: ModelInputs,
        kv: KVCache,
        layer_idx,
        inv_freq,
        attention: AttentionFn,
        fixed_rows: bool = False,
    ):
        """From the projected q [T, H * Dh], k and v [T, KV * Dh] to attention's output
        [T, H * Dh] (before o_proj), and the cache with this step's K/V. `fixed_rows`: the
        q/k norms and RoPE in fixed row blocks (batch invariance on the CPU: XLA computes a
        row's cos, sin and norms by the array's shape, so a token's K moved with the step)."""
        cfg = self.cfg
        t = q.shape[0]
        with jax.named_scope("qkv_proj"):
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            # KV heads from the weights' shape: under tensor parallelism they may be repeated
            # (jaxserve.parallel.sharding).
            k = k.reshape(t, -1, cfg.head_dim)
            v = v.reshape(t, -1, cfg.head_dim)

        def normed_and_rotated(q, k, positions):
            if cfg.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)

        with jax.named_scope("rope"):
            if fixed_rows:
                q, k = in_fixed_row_blocks(normed_and_rotated, q, k, inputs.positions, min_blocks=2)
            else:
                q, k = normed_and_rotated(q, k, inputs.positions)

        # Write this step's K/V first; attention then reads the whole context from the pages
        # of every layer folded into one pool (layer l's pages start at l * num_blocks).
        with jax.named_scope("kv_write"):
            kv = write_kv(kv, layer_idx, inputs.slot_mapping, k, v, self.calibrated_kv_scales(kv, k.shape[1]))
        pages, block_offset = fold_layers(kv), layer_idx * kv.num_blocks
        with jax.named_scope("attention"):
            out = attention(
                q,
                pages.k,
                pages.v,
                inputs.seq_lens,
                inputs.block_tables + block_offset,
                inputs.query_start_loc,
                sm_scale=cfg.head_dim**-0.5,
                sliding_window=cfg.sliding_window,
                **pages.scales(),
                **({} if inputs.tree_mask is None else {"tree_mask": inputs.tree_mask}),
            )
        return out.reshape(t, cfg.num_heads * cfg.head_dim), kv

    def calibrated_kv_scales(self, kv: KVCache, kv_heads: int) -> tuple[jax.Array, jax.Array] | None:
        """The checkpoint's K and V scales for an 8-bit cache [kv_heads], as scales of the
        cache's dtype (None: the cache keeps full precision, or scales each token itself).
        Under tensor parallelism the KV heads may be repeated (jaxserve.parallel.sharding)."""
        if self.cfg.kv_scales is None or kv.k_scale is None:
            return None
        repeat = kv_heads // self.cfg.num_kv_heads
        return tuple(
            jnp.repeat(rescale_for(s[...], self.cfg.kv_scales, kv.dtype), repeat) for s in (self.k_scale, self.v_scale)
        )


class DecoderLayer(nnx.Module):
    """Attention and an MLP, each after an RMSNorm and added to the residual. `moe`: the MLP
    is a mixture of experts (jaxserve.model.moe)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quant: QuantConfig | None = None, moe: bool = False):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, quant and quant.under("self_attn"))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        mlp_quant = quant and quant.under("mlp")
        self.mlp = SparseMoE(cfg, dtype, rngs, mlp_quant) if moe else MLP(cfg, dtype, rngs, mlp_quant)


def unstack_layers(model: DecoderLM) -> DecoderLM:
    """The same model with its stacked layers as separate modules (a new model object; the
    other parameters are shared). Its forward pass unrolls the layers instead of scanning.

    Serving wants this, and weight loading returns models in this form: a scan reads each
    layer's weights through a dynamic slice, which XLA on the CPU materializes as a copy
    every step, so a memory-bound decode step moved its weights three times (read, write
    the copy, read it). Separate arrays are read in place, once. The price is compile
    time that grows with depth.
    """
    if isinstance(model.layers, nnx.List):
        return model
    graphdef, state = nnx.split(model)
    unstacked = nnx.merge(graphdef, state)
    layer_def, stacked = nnx.split(unstacked.layers)
    unstacked.layers = nnx.List(
        [nnx.merge(layer_def, jax.tree.map(lambda a, i=i: a[i], stacked)) for i in range(model.cfg.num_layers)]
    )
    return unstacked


def has_plain_projections(layer: DecoderLayer) -> bool:
    """What the layer kernels compute: float (unquantized) projections, no o_proj bias, a dense MLP."""
    if not isinstance(layer.mlp, MLP) or not has_plain_attention(layer):
        return False
    mlp = (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
    return all(isinstance(p, nnx.Linear) for p in mlp) and layer.self_attn.o_proj.bias is None


def has_plain_attention(layer: DecoderLayer) -> bool:
    """Float (unquantized) q/k/v/o projections: what the CPU kernels' attention half computes."""
    attn = layer.self_attn
    return all(isinstance(p, nnx.Linear) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))


def has_quantized_kernel_projections(layer: DecoderLayer) -> bool:
    """What the quantized layer kernels compute: every projection int4 or int8 in the CPU
    kernels' layout (QuantizedLinear.use_cpu_layout), no o_proj bias, a dense MLP."""
    if not isinstance(layer.mlp, MLP):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return all(isinstance(p, QuantizedLinear) and p.on_cpu_kernels for p in projections) and attn.o_proj.bias is None


def _attention_in_kernels(x, kv, layer_idx, layer: DecoderLayer, inputs, inv_freq, attention, fixed_rows: bool):
    """The attention half of a layer on the CPU kernels: the norm and q/k/v in one call
    (cpu_kernels.norm_qkv, in row blocks, or quantized_norm_qkv on quantized weights), then
    attention. Returns its output before o_proj."""
    attn, norm = layer.self_attn, layer.input_layernorm
    with jax.named_scope("qkv_proj"):
        if isinstance(attn.q_proj, QuantizedLinear):
            weights = (attn.q_proj.cpu_weight(), attn.k_proj.cpu_weight(), attn.v_proj.cpu_weight())
            q, k, v = cpu_kernels.quantized_norm_qkv(x, norm.weight[...], *weights, eps=norm.eps)
        else:
            q, k, v = cpu_kernels.in_row_blocks(
                cpu_kernels.norm_qkv,
                (x,),
                norm.weight[...],
                attn.q_proj.kernel[...],
                attn.k_proj.kernel[...],
                attn.v_proj.kernel[...],
                eps=norm.eps,
            )
        if attn.q_proj.bias is not None:
            q, k, v = q + attn.q_proj.bias[...], k + attn.k_proj.bias[...], v + attn.v_proj.bias[...]
    return attn.attend(q, k, v, inputs, kv, layer_idx, inv_freq, attention, fixed_rows)


def _moe_layer_kernels(carry, layer: DecoderLayer, inputs: ModelInputs, inv_freq, attention: AttentionFn):
    """A mixture-of-experts layer with every row in a fixed order (batch invariance on the CPU):
    the attention half through the CPU kernels as `_layer_kernels`, the post-attention norm in
    fixed row blocks, the experts through SparseMoE.in_fixed_order."""
    x, kv, layer_idx = carry
    attn = layer.self_attn
    out, kv = _attention_in_kernels(x, kv, layer_idx, layer, inputs, inv_freq, attention, fixed_rows=True)
    out = cpu_kernels.in_row_blocks(cpu_kernels.small_matmul, (out,), attn.o_proj.kernel[...])
    x = x + (out if attn.o_proj.bias is None else out + attn.o_proj.bias[...])
    h = in_fixed_row_blocks(layer.post_attention_layernorm, x)
    return x + layer.mlp.in_fixed_order(h), kv, layer_idx + 1


def _layer_kernels(
    carry, layer: DecoderLayer, inputs: ModelInputs, inv_freq, attention: AttentionFn, fixed_rows: bool = False
):
    """`_layer` with each half of the layer as one CPU kernel call (cpu_kernels.norm_qkv and
    o_proj_mlp): XLA runs a few-row layer as a dozen small ops, each paying a dispatch and a
    wake-up of its thread pool. More rows than a call takes go in blocks; `fixed_rows`
    (batch invariance): the row-wise work between the kernels too (Attention.attend)."""
    x, kv, layer_idx = carry
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    out, kv = _attention_in_kernels(x, kv, layer_idx, layer, inputs, inv_freq, attention, fixed_rows)
    with jax.named_scope("mlp"):  # o_proj's time is charged here
        if isinstance(attn.o_proj, QuantizedLinear):
            projections = (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            wo, wg, wu, wd = (p.cpu_weight() for p in projections)
            x = cpu_kernels.quantized_o_proj_mlp(out, x, wo, norm.weight[...], wg, wu, wd, eps=norm.eps)
        else:
            x = cpu_kernels.in_row_blocks(
                cpu_kernels.o_proj_mlp,
                (out, x),
                attn.o_proj.kernel[...],
                norm.weight[...],
                mlp.gate_proj.kernel[...],
                mlp.up_proj.kernel[...],
                mlp.down_proj.kernel[...],
                eps=norm.eps,
            )
    return x, kv, layer_idx + 1


def _layer(
    carry,
    layer: DecoderLayer,
    inputs: ModelInputs,
    inv_freq,
    attention: AttentionFn,
    kernel_rows: int = 0,
    batch_invariant: bool = False,
):
    """One decoder layer; carry: (x, the cache, layer index). Up to `kernel_rows` rows run
    through the CPU layer kernels (FewRowKernels.layer_rows), any number with `batch_invariant`."""
    x, kv, layer_idx = carry
    if inputs.lora_slots is not None:  # adapters on (jaxserve.lora): each projection adds its delta
        return lora_layer(carry, layer, inputs, inv_freq, attention)
    if batch_invariant and isinstance(layer.mlp, SparseMoE):
        return _moe_layer_kernels(carry, layer, inputs, inv_freq, attention)
    if batch_invariant or (kernel_rows and _fits_layer_kernels(x, layer, kernel_rows)):
        return _layer_kernels(carry, layer, inputs, inv_freq, attention, fixed_rows=batch_invariant)
    with jax.named_scope("norm"):
        h = layer.input_layernorm(x)
    h, kv = layer.self_attn(h, inputs, kv, layer_idx, inv_freq, attention)
    x = x + h
    with jax.named_scope("norm"):
        h = layer.post_attention_layernorm(x)
    x = x + layer.mlp(h)
    return x, kv, layer_idx + 1


@functools.cache
def _jitted_layer(layer_def, attention: AttentionFn, kernel_rows: int, batch_invariant: bool):
    """`_layer` as one jitted function of the layer's weights. The unrolled forward pass calls
    it once per layer: jax then traces and lowers a single layer (unrolling 30 layers in
    Python made each program take seconds to trace, even on a compile-cache hit), and XLA
    inlines the calls into one program with each layer's weights read in place."""
    return jax.jit(
        lambda carry, state, inputs, inv_freq: _layer(
            carry, nnx.merge(layer_def, state), inputs, inv_freq, attention, kernel_rows, batch_invariant
        )
    )


class DecoderLM(nnx.Module):
    """Embeddings, a stack of decoder layers, the final norm and the LM head.

    The layers are stacked on a leading axis and scanned, or, after `unstack_layers`
    (what the serving engine does), separate modules run one after another; a mixture of
    experts with some dense-MLP layers starts separate, as does a model whose layers are
    quantized differently (`QuantConfig.exceptions`). With `quantization`, the attention
    and MLP projections (the experts' too) are quantized.
    `few_row_kernels`: the few-row products (a decode step's) that run through the CPU
    kernels (the layers' halves; a tied LM head's, where XLA's CPU dot with the
    [vocab, hidden] table is slow for a few rows). jaxserve.runner.kernels.select_matmul sets it.
    """

    few_row_kernels = FewRowKernels()
    batch_invariant = False  # marked to keep a row's bits whatever its batch (runner.kernels, either device)
    # Batch invariance on a GPU: a tied LM head's (x [S, D], table [V, D]) -> [S, V] product in a
    # fixed order (the Mosaic GPU dense kernel); None: XLA's. runner.kernels sets it.
    tied_head_matmul: Callable | None = None
    # A quantized model on the CPU: the tied table's Q8_0 blocks for a head of up to
    # lm_head_rows rows (cpu_kernels.int8_matmul). runner.kernels sets it.
    int8_head: Int8Table | None = None

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, quantization: QuantConfig | None = None):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.quantization = quantization
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)

        moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
        if len(set(moe)) > 1 or (quantization and quantization.exceptions):
            # dense and MoE layers, or layers quantized differently: they cannot be stacked, so start separate
            self.layers = nnx.List(
                [
                    DecoderLayer(cfg, dtype, rngs, quantization and quantization.under(f"layers.{i}"), moe=m)
                    for i, m in enumerate(moe)
                ]
            )
        else:

            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_layers(rngs):
                return DecoderLayer(cfg, dtype, rngs, quantization, moe=moe[0])

            self.layers = make_layers(rngs)  # every parameter has a leading [L] axis
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(dtype, cfg.hidden_size, cfg.vocab_size, False, rngs)

    def __call__(
        self, inputs: ModelInputs, kv: KVCache, attention: AttentionFn = ragged_paged_attention_reference
    ) -> tuple[jax.Array, KVCache]:
        """Logits [len(logits_indices), vocab] in float32, and the cache with this step's K/V."""
        x, kv = self.hidden_states(inputs, kv, attention)
        return self.logits(x[inputs.logits_indices]), kv

    def logits(self, x: jax.Array) -> jax.Array:
        """Float32 logits of final hidden states x [S, D] (the final norm, then the LM head)."""
        with jax.named_scope("lm_head"):
            if self.few_row_kernels.batch_invariant:  # the norm's sums too: see fixed_order
                return in_fixed_row_blocks(self._invariant_logits, x)
            return self._head(self.norm(x))

    def unnormed_logits(self, x: jax.Array) -> jax.Array:
        """Float32 logits of x [S, D] through the LM head alone, without the final norm (the
        features of published EAGLE heads are already normed)."""
        with jax.named_scope("lm_head"):
            return self._head(x)

    def _head(self, x: jax.Array) -> jax.Array:
        if not self.cfg.tie_word_embeddings:
            logits = self.lm_head(x)
        elif self.tied_head_matmul is not None:
            logits = self.tied_head_matmul(x, self.embed_tokens.embedding[...])
        elif self.int8_head is not None and x.shape[0] <= self.few_row_kernels.lm_head_rows:
            logits = self.int8_head(x)
        elif _fits(x, table := self.embed_tokens.embedding[...], self.few_row_kernels.lm_head_rows):
            logits = cpu_kernels.small_matmul(x, table, transposed=True)
        else:
            logits = self.embed_tokens.attend(x)
        return logits.astype(jnp.float32)

    def _invariant_logits(self, x: jax.Array) -> jax.Array:
        """`logits` of one block of INVARIANT_ROWS rows, the head through the CPU kernel."""
        tied = self.cfg.tie_word_embeddings
        table = self.embed_tokens.embedding[...] if tied else self.lm_head.kernel[...]
        return cpu_kernels.small_matmul(self.norm(x), table, transposed=tied).astype(jnp.float32)

    def hidden_states(
        self, inputs: ModelInputs, kv: KVCache, attention: AttentionFn = ragged_paged_attention_reference
    ) -> tuple[jax.Array, KVCache]:
        """The last layer's output [T, D] for every token, and the cache with this step's K/V."""
        x, kv, _ = self.hidden_states_and_layer_inputs(inputs, kv, (), attention)
        return x, kv

    def hidden_states_and_layer_inputs(
        self,
        inputs: ModelInputs,
        kv: KVCache,
        layers: tuple[int, ...],
        attention: AttentionFn = ragged_paged_attention_reference,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """`hidden_states`, and the inputs of `layers` (the residual stream entering each;
        layer 0's: the embeddings) side by side in layer order, [T, len(layers) * D], or None
        for no layers: the features an EAGLE-3 head reads."""
        with jax.named_scope("embed"):
            x = self.embed_tokens(inputs.input_ids)  # [T, D]
        inv_freq = jnp.asarray(self.cfg.rope_inv_freq())
        carry = (x, kv, jnp.int32(0))
        layers = tuple(sorted(set(layers)))
        rows, invariant = self.few_row_kernels.layer_rows, self.few_row_kernels.batch_invariant
        if isinstance(self.layers, nnx.List):  # separate layers (unstack_layers): unrolled
            captured = []
            # One jitted layer per kind (a MoE model may mix dense and MoE layers).
            for i, layer in enumerate(self.layers):
                if i in layers:
                    captured.append(carry[0])
                layer_fn = _jitted_layer(nnx.graphdef(layer), attention, rows, invariant)
                carry = layer_fn(carry, nnx.state(layer), inputs, inv_freq)
        else:  # stacked layers: one scanned body, whatever the depth
            layer_def, layer_state = nnx.split(self.layers)

            def step(c, state):
                (x, kv, i), captured = c
                captured = tuple(jnp.where(i == at, x, kept) for at, kept in zip(layers, captured))
                layer = nnx.merge(layer_def, state)
                return (_layer((x, kv, i), layer, inputs, inv_freq, attention, rows, invariant), captured), None

            (carry, captured), _ = jax.lax.scan(step, (carry, tuple(jnp.zeros_like(x) for _ in layers)), layer_state)
        x, kv, _ = carry
        return x, kv, jnp.concatenate(captured, axis=-1) if layers else None
