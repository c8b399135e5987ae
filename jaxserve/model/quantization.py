"""Quantized weights: the schemes, the host-side quantizers and the quantized linear layer.

The attention and MLP projections of a quantized model are `QuantizedLinear` layers; the
embeddings, norms and LM head stay in the model dtype. Methods (`--quantization`):

    int4   weight-only, round-to-nearest from a float checkpoint, asymmetric per group of
           `group_size` along K (128; a layer whose K it does not divide uses 64 or 32)
    int8   weight-only, round-to-nearest, symmetric per group of 32 along K (GGUF's Q8_0 rule)
    fp8    e4m3 weights with a scale per output channel; activations quantized per token
           on the fly (W8A8), float32 accumulation
    gguf   a GGUF file's own blocks instead of dequantized floats, projection by projection:
           Q4_0 / Q4_1 / Q4_K kept as int4 with group 32, Q8_0 and Q5_0 as int8 with group 32,
           Q5_1 and Q5_K as int8 with an offset per 32 (the layout "int8_asym"), Q6_K as int8
           with group 16 (the file's exact values); other block types are re-quantized, to
           int4 if they have 4 bits or fewer, else to int8. A file that mixes them (Q4_K_M:
           Q4_K with some Q6_K) has layers of each kind (`QuantConfig.exceptions`)

A checkpoint saved by llm-compressor (compressed-tensors), AutoGPTQ / GPTQModel (GPTQ)
or AutoAWQ (AWQ) brings its own int4 or fp8 weights and needs no flag; so does a block-wise
FP8 one (DeepSeek's and Qwen3's FP8 releases: e4m3 with a scale per 128x128 block, kind
"fp8_block", served W8A16 by the reference: no kernel reads its blocks yet). The layouts
the layers hold are described in `pallas_kernels.quantized_matmul`. On a Hopper GPU
`jaxserve.runner.kernels.select_matmul` converts the int4 and fp8 layers once to the Mosaic
GPU kernels' layout (`pallas_kernels.quantized_matmul_mgpu`) and they call those kernels
(int8 and fp8_block have none: a model with such layers runs the references there); on the
CPU it sends an int4 or int8 layer's few-row calls (decode steps) to C++ kernels that read
the packed values (`pallas_kernels.cpu_kernels.int4_matmul`, `int8_matmul`), and a tied LM
head whose table is a GGUF's Q8_0 blocks to one that reads those (`Int8Table`); elsewhere
they call the pure-JAX references.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import cpu_kernels
from pallas_kernels.quantized_matmul import (
    FP8_MAX,
    fp8_block_matmul_reference,
    fp8_matmul_reference,
    int4_matmul_reference,
    int8_matmul_reference,
)

METHODS = ("int4", "int8", "fp8", "gguf")
KINDS = ("int4", "int8", "int8_asym", "fp8", "fp8_block")
INT8_KINDS = ("int8", "int8_asym")  # int8 values; int8_asym adds an offset per group (GGUF's Q5_1, Q5_K)
MIXABLE_KINDS = ("int4", *INT8_KINDS)  # the layouts a GGUF's projections may mix in one model
KERNEL_KINDS = ("int4", "fp8")  # the layouts the Mosaic GPU kernels read
DEFAULT_GROUP_SIZE = 128
Q8_0_GROUP = cpu_kernels.Q8_0_BLOCK  # int8's group along K: GGUF's Q8_0 block (32)
_FALLBACK_GROUPS = (64, 32)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How a model's projections are stored. `method` says where the weights came from
    (one of METHODS, "compressed-tensors", "gptq" or "awq"); `kind` is the layout (one of KINDS)."""

    method: str
    kind: str
    group_size: int = DEFAULT_GROUP_SIZE  # int4 and int8: the preferred group along K
    # int4 from a GPTQ checkpoint quantized with act-order: each layer's K rows are stored in
    # group order and it gathers its inputs into that order first (QuantizedLinear.input_order)
    act_order: bool = False
    block: tuple[int, int] | None = None  # fp8_block: (outputs, inputs) a scale covers, as checkpoints give it
    # Projections stored another way than `kind`, as (module path, kind, group size): a GGUF
    # file's mixed block types (a Q4_K_M keeps some v and down projections in Q6_K). Paths are
    # relative to where the config applies: "layers.3.mlp.down_proj" for the model (see `under`).
    exceptions: tuple[tuple[str, str, int], ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"quantized layout {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "int4" and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"int4 needs an even group size, got {self.group_size=}")
        if self.act_order and self.kind != "int4":
            raise ValueError("act-order is an int4 layout")
        if (self.block is not None) != (self.kind == "fp8_block"):
            raise ValueError("a block size goes with the fp8_block layout, and only with it")
        for path, kind, group in self.exceptions:
            if kind not in MIXABLE_KINDS or self.kind not in MIXABLE_KINDS or self.act_order:
                raise ValueError(f"{path}: only int4 and int8 layouts mix in a model, not {kind} with {self.kind}")
            if kind == "int4" and (group < 2 or group % 2):
                raise ValueError(f"{path}: int4 needs an even group size, got {group}")

    def under(self, prefix: str) -> QuantConfig:
        """The config of the modules under `prefix` ("layers.3", then "mlp"): the exceptions
        there, their paths relative to it."""
        inner = tuple((p[len(prefix) + 1 :], k, g) for p, k, g in self.exceptions if p.startswith(prefix + "."))
        return self if inner == self.exceptions else dataclasses.replace(self, exceptions=inner)

    def at(self, path: str) -> QuantConfig:
        """The layout of the one projection at `path` (relative, as the exceptions' paths are)."""
        for p, kind, group in self.exceptions:
            if p == path:
                return dataclasses.replace(self, kind=kind, group_size=group, exceptions=())
        return dataclasses.replace(self, exceptions=()) if self.exceptions else self

    @classmethod
    def for_method(cls, method: str | None) -> QuantConfig | None:
        """The config for a `--quantization` value (None: unquantized)."""
        if method is None or method == "none":
            return None
        if method not in METHODS:
            raise ValueError(f"quantization {method!r} is not one of {', '.join(METHODS)}")
        if method == "gguf":  # a file without 4-bit projections keeps int8 (GGUFFile.quant_config)
            return cls("gguf", "int4", 32)
        return cls(method, method, Q8_0_GROUP if method == "int8" else DEFAULT_GROUP_SIZE)

    def group_size_for(self, k: int) -> int:
        """The int4 or int8 group size of a layer with K inputs: the preferred one if it
        divides K, else the largest smaller fallback (64, 32) that does."""
        for g in (self.group_size, *(g for g in _FALLBACK_GROUPS if g < self.group_size)):
            if k % g == 0:
                return g
        tried = ", ".join(str(g) for g in (self.group_size, *_FALLBACK_GROUPS) if g <= self.group_size)
        raise ValueError(f"{self.kind} quantization: K={k} is not a multiple of any group size ({tried})")

    def check_experts(self) -> None:
        """Raise if a mixture of experts' experts cannot be stored this way."""
        if self.kind in ("int8", "int8_asym", "fp8_block"):
            raise ValueError(
                f"{self.label}: {self.kind} is for dense projections; a mixture of experts takes int4 or fp8"
            )

    @property
    def label(self) -> str:
        if self.kind == "fp8":
            layout = "fp8 e4m3, per-channel scales"
        elif self.kind == "fp8_block":
            layout = f"fp8 e4m3, {self.block[0]}x{self.block[1]} block scales"
        else:
            layout = f"{self.kind}, group {self.group_size}"
        layout += ", act-order" if self.act_order else ""
        others = sorted({(k, g) for _, k, g in self.exceptions})
        for kind, group in others:
            count = sum((k, g) == (kind, group) for _, k, g in self.exceptions)
            layout += f"; {count} projection{'s' if count > 1 else ''} {kind}, group {group}"
        return f"{self.method} ({layout})" if self.method != self.kind else layout


class QuantizedLinear(nnx.Module):
    """y = x @ W (+ bias) with W stored quantized; the parameters are plain arrays.

    A layer starts in the canonical layout (`pallas_kernels.quantized_matmul`), the one
    loaders, caches and the pure-JAX references use. `use_kernel_layout` converts it once,
    after loading, into the layout of the Mosaic GPU kernels (`backend.select_matmul`
    does so when it picks them); the layer then calls the kernels.
    """

    def __init__(self, din: int, dout: int, *, use_bias: bool, quant: QuantConfig, dtype):
        self.kind = quant.kind
        self.din, self.dout = din, dout
        self.layout = "canonical"  # or "mgpu" (see use_kernel_layout), or "cpu" (use_cpu_layout)
        self.interpret = False  # mgpu layout only: run the kernels in the Mosaic GPU interpreter (tests)
        self.batch_invariant = False  # mgpu layout only: the kernels' fixed-order config (batch invariance)
        if quant.kind == "int4":
            if din % 2:
                raise ValueError(f"int4 packs two values per byte along K; K={din} is odd")
            group = quant.group_size_for(din)
            self.packed = nnx.Param(jnp.zeros((din // 2, dout), jnp.uint8))
            self.scales = nnx.Param(jnp.zeros((din // group, dout), jnp.float32))
            self.offsets = nnx.Param(jnp.zeros((din // group, dout), jnp.float32))
            # act-order: the packed rows are the inputs in this order (y = x[:, order] @ rows)
            self.input_order = nnx.Param(jnp.arange(din, dtype=jnp.int32)) if quant.act_order else None
        elif quant.kind in INT8_KINDS:
            self.input_order = None
            groups = din // quant.group_size_for(din)
            self.weight = nnx.Param(jnp.zeros((din, dout), jnp.int8))
            self.scales = nnx.Param(jnp.zeros((groups, dout), jnp.float32))
            self.offsets = nnx.Param(jnp.zeros((groups, dout), jnp.float32)) if quant.kind == "int8_asym" else None
        elif quant.kind == "fp8_block":
            self.input_order, self.block = None, quant.block
            bn, bk = quant.block
            self.weight = nnx.Param(jnp.zeros((din, dout), jnp.float8_e4m3fn))
            self.scales = nnx.Param(jnp.ones((-(-din // bk), -(-dout // bn)), jnp.float32))
        else:
            self.input_order = None
            self.weight = nnx.Param(jnp.zeros((din, dout), jnp.float8_e4m3fn))
            self.scales = nnx.Param(jnp.ones((dout,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # the kernels take [T, K]
        if self.input_order is not None:
            x2 = jnp.take(x2, self.input_order[...], axis=1)
        if self.layout == "mgpu":
            y = self._kernel_matmul(x2)
        elif self.layout == "cpu":
            y = self._cpu_matmul(x2)
        elif self.kind == "int4":
            y = int4_matmul_reference(x2, self.packed[...], self.scales[...], self.offsets[...])
        elif self.kind in INT8_KINDS:
            y = int8_matmul_reference(x2, self.weight[...], self.scales[...], self._int8_offsets())
        elif self.kind == "fp8_block":
            y = fp8_block_matmul_reference(x2, self.weight[...], self.scales[...], self.block)
        else:
            y = fp8_matmul_reference(x2, self.weight[...], self.scales[...])
        return self._output(y, lead)

    def _output(self, y: jax.Array, lead: tuple[int, ...]) -> jax.Array:
        # NOTE: y's own width, not self.dout: under tensor parallelism a K/V projection's
        # parameters may hold each KV head several times (sharding.replicate_kv_heads).
        y = y.reshape(*lead, y.shape[-1])
        return y if self.bias is None else y + self.bias[...]

    def _int8_offsets(self) -> jax.Array | None:
        return self.offsets[...] if self.kind == "int8_asym" else None

    def _kernel_matmul(self, x: jax.Array) -> jax.Array:
        # NOTE: the kernel module is imported where used (here and below), as backend.py does
        # for attention: Pallas' Mosaic GPU adds start-up time where no kernel runs.
        from pallas_kernels import quantized_matmul_mgpu as mgpu

        options = dict(interpret=True if self.interpret else None, batch_invariant=self.batch_invariant)
        if self.kind == "int4":
            weights = mgpu.Int4KernelWeights(self.q[...], self.scales[...], self.offsets[...], self.dout)
            return mgpu.int4_matmul(x, weights, **options)
        return mgpu.fp8_matmul(x, mgpu.Fp8KernelWeights(self.weight[...], self.scales[...], self.dout), **options)

    def _cpu_matmul(self, x: jax.Array) -> jax.Array:
        # A prefill chunk (more rows than the kernels take) runs the reference on the weight
        # untiled in the step (its dequantization to floats costs the same; the chunk's rows share it).
        if x.shape[0] <= cpu_kernels.QUANTIZED_MAX_ROWS:
            return cpu_kernels.quantized_matmuls(x, [self.cpu_weight()])[0]
        if self.kind in INT8_KINDS:
            offsets = self._int8_offsets()
            if offsets is not None:
                offsets = cpu_kernels.untile_scales(offsets, self.dout)
            return int8_matmul_reference(
                x, *cpu_kernels.untile_int8(self.weight[...], self.scales[...], self.dout), offsets
            )
        weight = (self.packed[...], self.scales[...], self.offsets[...])
        return int4_matmul_reference(x, *cpu_kernels.untile_int4(*weight, self.dout))

    def cpu_weight(self) -> cpu_kernels.QuantizedWeight:
        """The weight as the CPU kernels take it (after use_cpu_layout)."""
        if self.kind in INT8_KINDS:
            return cpu_kernels.QuantizedWeight(self.weight[...], self.scales[...], self._int8_offsets(), self.dout)
        return cpu_kernels.QuantizedWeight(self.packed[...], self.scales[...], self.offsets[...], self.dout)

    @property
    def on_cpu_kernels(self) -> bool:
        """Whether its few-row products run the CPU kernels as they are (the tiled layout, inputs in order)."""
        return self.layout == "cpu" and self.input_order is None

    def use_cpu_layout(self) -> None:
        """Convert an int4 or int8 layer, once, into the CPU kernels' tiled layout (in place;
        see `cpu_kernels.tile_int4` and `tile_int8`). Its calls of up to
        `cpu_kernels.QUANTIZED_MAX_ROWS` rows (decode steps) then run the C++ kernel, which reads the
        packed values; longer ones the reference. Scales float16 holds exactly (a GGUF's
        own) are kept in float16: fewer bytes, the same values."""
        if self.layout == "cpu":
            return
        if self.kind not in MIXABLE_KINDS or self.layout != "canonical":
            raise ValueError(f"the CPU layout is for canonical int4 and int8 layers, not {self.kind} in {self.layout}")
        if self.kind in INT8_KINDS:
            offsets = self._int8_offsets()
            half = cpu_kernels.half_scales_exact(self.scales[...], *([] if offsets is None else [offsets]))
            dtype = jnp.float16 if half else jnp.float32
            tile = jax.jit(cpu_kernels.tile_int8, static_argnames="scale_dtype")
            q, scales = tile(self.weight[...], self.scales[...], scale_dtype=dtype)
            self.weight, self.scales = nnx.Param(q), nnx.Param(scales)
            if offsets is not None:
                self.offsets = nnx.Param(
                    jax.jit(cpu_kernels.tile_scales, static_argnames="scale_dtype")(offsets, dtype)
                )
        else:
            weight = (self.packed[...], self.scales[...], self.offsets[...])
            half = cpu_kernels.half_scales_exact(*weight[1:])
            tile = jax.jit(cpu_kernels.tile_int4, static_argnames="scale_dtype")
            packed, scales, offsets = tile(*weight, scale_dtype=jnp.float16 if half else jnp.float32)
            self.packed, self.scales, self.offsets = nnx.Param(packed), nnx.Param(scales), nnx.Param(offsets)
        self.layout = "cpu"

    def use_canonical_layout(self) -> None:
        """Undo use_cpu_layout (exact: the tiles hold the canonical values), so that another
        engine on the same model can run the reference or shard the layer."""
        if self.layout == "mgpu":
            raise ValueError("the Mosaic GPU layout is one-way (its canonical arrays are gone)")
        if self.layout != "cpu":
            return
        if self.kind in INT8_KINDS:
            untile = jax.jit(cpu_kernels.untile_int8, static_argnums=2)
            q, scales = untile(self.weight[...], self.scales[...], self.dout)
            self.weight, self.scales = nnx.Param(q), nnx.Param(scales)
            if self.kind == "int8_asym":
                self.offsets = nnx.Param(
                    jax.jit(cpu_kernels.untile_scales, static_argnums=1)(self.offsets[...], self.dout)
                )
        else:
            weight = (self.packed[...], self.scales[...], self.offsets[...])
            untile = jax.jit(cpu_kernels.untile_int4, static_argnums=3)
            packed, scales, offsets = untile(*weight, self.dout)
            self.packed, self.scales, self.offsets = nnx.Param(packed), nnx.Param(scales), nnx.Param(offsets)
        self.layout = "canonical"

    def kernel_unsupported_reason(self, dtype, batch_invariant: bool = False) -> str | None:
        """Why the Mosaic GPU kernel cannot serve this layer for activations of `dtype` (in its
        fixed-order config with `batch_invariant`), or None."""
        from pallas_kernels import quantized_matmul_mgpu as mgpu

        if self.kind not in KERNEL_KINDS:
            return f"{self.kind} layers have no Mosaic GPU kernel (they run the reference)"
        x = jax.ShapeDtypeStruct((mgpu.MAX_TILE_T, self.din), jnp.dtype(dtype))  # the largest token tile
        if self.kind == "int4":
            groups = self.scales.shape[-2]  # [.., G, N] in both layouts
            n_pad = mgpu.padded_n(self.dout)
            weights = mgpu.Int4KernelWeights(
                jax.ShapeDtypeStruct((n_pad, self.din), jnp.int4),
                jax.ShapeDtypeStruct((groups, n_pad), jnp.float32),
                jax.ShapeDtypeStruct((groups, n_pad), jnp.float32),
                self.dout,
            )
            return mgpu.int4_unsupported_reason(x, weights, batch_invariant=batch_invariant)
        n_pad = mgpu.padded_n(self.dout)
        weights = mgpu.Fp8KernelWeights(
            jax.ShapeDtypeStruct((n_pad, self.din), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n_pad,), jnp.float32),
            self.dout,
        )
        return mgpu.fp8_unsupported_reason(x, weights, batch_invariant=batch_invariant)

    def use_kernel_layout(self, *, interpret: bool = False, batch_invariant: bool = False) -> None:
        """Convert the parameters, once, into the Mosaic GPU kernels' layout (in place; the
        canonical arrays are dropped). Works on stacked layers (leading axes) too.
        `interpret` runs the kernels in the Mosaic GPU interpreter (for tests on a CPU);
        `batch_invariant` in their fixed-order config."""
        from pallas_kernels import quantized_matmul_mgpu as mgpu

        if self.layout == "mgpu":
            return
        if self.kind not in KERNEL_KINDS:
            raise ValueError(self.kernel_unsupported_reason(jnp.bfloat16))
        self.batch_invariant = batch_invariant
        if self.kind == "int4":
            w = jax.jit(mgpu.prepare_int4)(self.packed[...], self.scales[...], self.offsets[...])
            del self.packed
            self.q = nnx.Param(w.q)
            self.scales, self.offsets = nnx.Param(w.scales), nnx.Param(w.offsets)
        else:
            w = jax.jit(mgpu.prepare_fp8)(self.weight[...], self.scales[...])
            self.weight, self.scales = nnx.Param(w.weight), nnx.Param(w.scales)
        self.layout, self.interpret = "mgpu", interpret


class Int8Table(nnx.Module):
    """A tied LM head's [vocab, hidden] table as int8 values with a float16 scale per 32 along
    hidden, in the CPU kernel's tiled layout (`cpu_kernels.tile_int8`): a GGUF's embedding
    table stored as Q8_0 blocks, found again exactly in the float table
    (`cpu_kernels.q8_0_blocks`). `x @ table.T` for a few rows then reads about 1.06 bytes
    a value instead of 4, with the same values as the float table's."""

    def __init__(self, q: jax.Array, scales: jax.Array, vocab: int):
        self.q, self.scales, self.vocab = nnx.Param(q), nnx.Param(scales), vocab

    @classmethod
    def from_table(cls, table) -> Int8Table | None:
        """The table's Q8_0 blocks, or None when it is not made of them (its first rows tell
        most tables apart at once: the whole check takes about 0.4 s for 28 M values)."""
        if cpu_kernels.q8_0_blocks(np.asarray(table[:256])) is None:
            return None
        blocks = cpu_kernels.q8_0_blocks(np.asarray(table))
        if blocks is None:
            return None
        q, scales = jax.jit(cpu_kernels.tile_int8)(*blocks)
        return cls(q, scales, table.shape[0])

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [M <= cpu_kernels.MAX_ROWS, hidden] @ table.T -> [M, vocab] in x's dtype."""
        return cpu_kernels.int8_matmul(x, self.q[...], self.scales[...], self.vocab)


def project(x: jax.Array, *layers) -> tuple[jax.Array, ...]:
    """Each layer's output for the same x (q, k and v; gate and up). Int4 and int8 layers in
    the CPU layout share one kernel call for a few rows (`cpu_kernels.quantized_matmuls`), as
    do float layers marked for the CPU's dense kernel (`cpu_kernels.dense_matmuls`): a decode
    step pays one dispatch for them instead of one each."""
    x2 = x.reshape(-1, x.shape[-1])
    fused = len(layers) > 1 and x2.shape[0] <= cpu_kernels.QUANTIZED_MAX_ROWS
    if fused and all(isinstance(q, QuantizedLinear) and q.on_cpu_kernels for q in layers):
        ys = cpu_kernels.quantized_matmuls(x2, [layer.cpu_weight() for layer in layers])
        return tuple(layer._output(y, x.shape[:-1]) for layer, y in zip(layers, ys))
    marked = len(layers) > 1 and all(getattr(p, "dot_general", None) is cpu_kernels.dense_dot_general for p in layers)
    kernels = [layer.kernel[...] for layer in layers] if marked else []
    if marked and all(cpu_kernels.dense_takes(x2.shape[0], x.dtype, kernel) for kernel in kernels):
        ys = cpu_kernels.dense_matmuls(x2, kernels)
        ys = [y if p.bias is None else y + p.bias[...] for p, y in zip(layers, ys)]
        return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)
    return tuple(layer(x) for layer in layers)


def quantized_layers(model: nnx.Module) -> list[tuple[str, QuantizedLinear]]:
    """(path, layer) of every QuantizedLinear in the model."""
    return [("/".join(map(str, path)), m) for path, m in nnx.iter_modules(model) if isinstance(m, QuantizedLinear)]


def use_kernel_layout(model: nnx.Module, *, interpret: bool = False, batch_invariant: bool = False) -> int:
    """Convert every QuantizedLinear of the model that has a Mosaic GPU kernel (int4, fp8) to
    the kernels' layout (see `QuantizedLinear.use_kernel_layout`); the others (a GGUF's int8
    layers beside its int4 ones) keep running the reference. Returns how many were converted."""
    layers = [layer for _, layer in quantized_layers(model) if layer.kind in KERNEL_KINDS]
    for layer in layers:
        layer.use_kernel_layout(interpret=interpret, batch_invariant=batch_invariant)
    return len(layers)


# -- host-side quantizers (numpy, one tensor at a time while loading) ---------------------


def pack_int4(nibbles: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 [K, N] -> uint8 [K // 2, N] (even k in the low nibble)."""
    nibbles = nibbles.astype(np.uint8)
    return nibbles[0::2] | (nibbles[1::2] << 4)


def quantize_int4(w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """Round-to-nearest asymmetric int4 of a float weight [K, N], per group of K rows:
    scale = (max - min) / 15 and offset = min, so each group's extremes are exact."""
    k, n = w.shape
    g = w.astype(np.float32).reshape(k // group, group, n)
    lo, hi = g.min(axis=1), g.max(axis=1)
    scales = (hi - lo) / np.float32(15)
    q = g - lo[:, None, :]  # NOTE: in place from here on: the loader's peak memory is a few tensors, not the model
    q /= np.where(scales > 0, scales, 1)[:, None, :]
    np.clip(np.rint(q, out=q), 0, 15, out=q)
    return {"packed": pack_int4(q.reshape(k, n)), "scales": scales, "offsets": lo}


def quantize_int8(w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """Round-to-nearest symmetric int8 of a float weight [K, N], per group of K rows, as
    GGUF's Q8_0 rounds: scale = max|w| / 127 (kept in float32), values in [-127, 127]."""
    k, n = w.shape
    g = w.astype(np.float32).reshape(k // group, group, n)
    scales = np.abs(g).max(axis=1) / np.float32(127)
    q = g / np.where(scales > 0, scales, 1)[:, None, :]
    np.clip(np.rint(q, out=q), -127, 127, out=q)
    return {"weight": q.reshape(k, n).astype(np.int8), "scales": scales}


def quantize_fp8(w: np.ndarray) -> dict[str, np.ndarray]:
    """e4m3 of a float weight [K, N] with one scale per output channel (amax / 448)."""
    amax = np.abs(w).max(axis=0).astype(np.float32)
    scales = np.where(amax > 0, amax / np.float32(FP8_MAX), 1).astype(np.float32)
    q = w / scales  # a float32 copy (w is float32)
    np.clip(q, -FP8_MAX, FP8_MAX, out=q)
    return {"weight": q.astype(jnp.float8_e4m3fn), "scales": scales}


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """e4m3 of a float weight [K, N] with one scale per block of bk inputs by bn outputs
    (amax / 448; block = (bn, bk), as checkpoints give it), partial blocks at the ends."""
    bn, bk = block
    k, n = w.shape
    padded = np.zeros((-(-k // bk) * bk, -(-n // bn) * bn), np.float32)
    padded[:k, :n] = w
    blocks = padded.reshape(padded.shape[0] // bk, bk, padded.shape[1] // bn, bn)
    amax = np.abs(blocks).max(axis=(1, 3))
    scales = np.where(amax > 0, amax / np.float32(FP8_MAX), 1).astype(np.float32)
    q = np.clip(blocks / scales[:, None, :, None], -FP8_MAX, FP8_MAX).reshape(padded.shape)[:k, :n]
    return {"weight": q.astype(jnp.float8_e4m3fn), "scales": scales}


def quantize(w: np.ndarray, quant: QuantConfig) -> dict[str, np.ndarray]:
    """A float weight [K, N] as the parameters of a QuantizedLinear."""
    if quant.kind == "int4":
        return quantize_int4(w, quant.group_size_for(w.shape[0]))
    if quant.kind == "int8":
        return quantize_int8(w, quant.group_size_for(w.shape[0]))
    if quant.kind == "int8_asym":  # nothing rounds to it: it holds a GGUF's Q5_1 and Q5_K blocks as stored
        raise ValueError("int8_asym holds a GGUF's Q5_1 / Q5_K blocks as they are; a float weight is not rounded to it")
    if quant.kind == "fp8_block":
        return quantize_fp8_block(w, quant.block)
    return quantize_fp8(w)


@dataclasses.dataclass
class QuantizedWeight:
    """A projection that arrives already quantized (GGUF blocks, compressed-tensors, GPTQ, AWQ):
    the QuantizedLinear parameters in our layout, and the float shape it stands for in
    Hugging Face's [out, in] orientation."""

    kind: str
    params: dict[str, np.ndarray]
    shape: tuple[int, int]

    def permute_outputs(self, order: np.ndarray) -> QuantizedWeight:
        """The same weight with its output channels (the N axis) reordered."""
        return QuantizedWeight(self.kind, {k: v[..., order] for k, v in self.params.items()}, self.shape)


def weight_bytes(model: nnx.Module) -> int:
    """Bytes the model's parameters occupy."""
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
