"""The kernel backend switch: Pallas kernels on a GPU that has them, C++ on the CPU, pure JAX elsewhere.

`select_attention(None, ...)` picks the Mosaic GPU kernel on a Hopper GPU when the
model's shapes and dtype suit it (bf16 or f16, head_dim 64 or 128); on the CPU, the C++
kernel (`pallas_kernels.cpu_kernels`, float32 or bf16 K/V) when it builds
here; the pure-JAX reference everywhere else. A flag (`--attention-backend`) or the
environment variable JAXSERVE_ATTENTION_BACKEND forces one: "pallas" or "cpu" (an error
if it cannot run) or "reference". The choice and its reason are logged at start-up. Other
kernels (int4 and FP8 matmuls, tree attention) plug into the same switch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import (
    AttentionFn,
    FewRowKernels,
    RMSNorm,
    has_plain_attention,
    has_plain_projections,
    has_quantized_kernel_projections,
)
from jaxserve.model.mlp import KERNEL_DOT_GENERAL
from jaxserve.model.moe import (
    EXPERT_LOOP_MAX_TOKENS,
    ExpertLinear,
    SparseMoE,
    expert_layers,
    moe_layers,
    run_touched_experts,
    run_touched_experts_in_cpp,
)
from jaxserve.model.quantization import (
    KERNEL_KINDS,
    MIXABLE_KINDS,
    Int8Table,
    QuantizedLinear,
    quantized_layers,
    use_kernel_layout,
)
from jaxserve.model.sizing import per_device_config
from jaxserve.parallel.sharding import shard_attention, tensor_parallel_size
from jaxserve.weights.load import default_cache_dir
from pallas_kernels import cpu_kernels
from pallas_kernels.quantized_kv import is_quantized_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "pallas", "cpu", "reference")
ENV_VAR = "JAXSERVE_ATTENTION_BACKEND"
MATMUL_ENV_VAR = "JAXSERVE_MATMUL_BACKEND"
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_hopper(device: jax.Device) -> bool:
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def _batch_invariant_attention(
    name: str, cfg: ModelConfig, dtype, block_size: int, kv_dtype, mesh
) -> tuple[str, AttentionFn]:
    """An attention kernel in its fixed order, where a query row's sums do not depend on the
    other rows of the step: the Mosaic GPU kernel's fixed splits on a Hopper GPU, the CPU
    kernel's fixed_order on the CPU; else an error."""
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    wanted = "pallas" if is_hopper(device) else "cpu"
    reason = None if name in ("auto", wanted) else f"it runs on the {wanted} attention kernel here, not {name!r}"
    if reason is None and mesh is not None and tensor_parallel_size(mesh) > 1:
        reason = "it does not run under tensor parallelism"
    if wanted == "pallas":
        reason = reason or pallas_unsupported_reason(cfg, dtype, block_size, device, kv_dtype)
    reason = reason or (cpu_unsupported_reason(dtype, kv_dtype, device) if wanted == "cpu" else None)
    if reason is not None:
        raise ValueError(f"batch invariance cannot be kept: {reason}")
    if wanted == "pallas":
        from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention

        logger.info("attention backend: pallas on %s, fixed splits (batch invariant)", device.device_kind)
        return "pallas", functools.partial(ragged_paged_attention, batch_invariant=True)
    logger.info("attention backend: cpu on %s, fixed summation order (batch invariant)", device.device_kind)
    return "cpu", functools.partial(cpu_kernels.ragged_paged_attention, fixed_order=True)


def pallas_unsupported_reason(
    cfg: ModelConfig, dtype, block_size: int, device: jax.Device, kv_dtype=None
) -> str | None:
    """Why the Mosaic GPU attention kernel cannot serve this model (and this KV cache dtype,
    default the model's) here, or None."""
    if not is_hopper(device):
        return f"it needs a Hopper GPU (sm_90); this device is {device.device_kind}"
    from pallas_kernels.ragged_paged_attention_mgpu import unsupported_reason

    kv_dtype = jnp.dtype(kv_dtype or dtype)
    q = jax.ShapeDtypeStruct((8, cfg.num_heads, cfg.head_dim), jnp.dtype(dtype))
    pages = jax.ShapeDtypeStruct((2, block_size, cfg.num_kv_heads, cfg.head_dim), kv_dtype)
    scales = {}
    if is_quantized_kv(kv_dtype):
        s = jax.ShapeDtypeStruct((2, cfg.num_kv_heads, block_size), jnp.float32)
        scales = {"k_scales": s, "v_scales": s}
    return unsupported_reason(q, pages, pages, **scales)


def cpu_unsupported_reason(dtype, kv_dtype, device: jax.Device) -> str | None:
    """Why the C++ CPU attention kernel cannot serve here, or None (then it is built and registered)."""
    reason = cpu_kernels.unsupported_reason(dtype, kv_dtype or dtype, device)
    return reason or cpu_kernels.build(default_cache_dir())


def select_attention(
    name: str | None,
    cfg: ModelConfig,
    dtype,
    block_size: int,
    kv_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    batch_invariant: bool = False,
) -> tuple[str, AttentionFn]:
    """(backend name, attention function) for the flag value `name` (None: env var, else auto),
    for a KV cache of `kv_dtype` (None: the model's dtype), on `mesh`'s devices (None: the
    first device). Under tensor parallelism the function runs per device on its own heads.
    `batch_invariant`: a kernel in its fixed order (see _batch_invariant_attention), else an error."""
    name = name or os.environ.get(ENV_VAR) or "auto"
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    if batch_invariant:
        return _batch_invariant_attention(name, cfg, dtype, block_size, kv_dtype, mesh)
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    tp = 1 if mesh is None else tensor_parallel_size(mesh)
    shard_cfg = per_device_config(cfg, tp)  # the kernel sees one device's heads
    reasons = {}  # why a kernel that was considered cannot run
    if name in ("auto", "pallas"):
        reasons["pallas"] = pallas_unsupported_reason(shard_cfg, dtype, block_size, device, kv_dtype)
    if name == "cpu" or (name == "auto" and reasons["pallas"] is not None):
        reasons["cpu"] = cpu_unsupported_reason(dtype, kv_dtype, device)
    if name in ("pallas", "cpu") and reasons[name] is not None:
        kernel = "Pallas" if name == "pallas" else "CPU"
        raise ValueError(f"the {kernel} attention kernel cannot run: {reasons[name]}")
    if name == "auto":
        name = next((kernel for kernel, reason in reasons.items() if reason is None), "reference")
    if name == "pallas":
        from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention as fn
    elif name == "cpu":
        fn = cpu_kernels.ragged_paged_attention
    else:
        fn = ragged_paged_attention_reference
    why = "".join(
        f" ({kernel} kernel not used: {reason})" for kernel, reason in reasons.items() if kernel != name and reason
    )
    where = f", tensor parallel {tp} over devices {[d.id for d in mesh.devices.flat]}" if tp > 1 else ""
    logger.info("attention backend: %s on %s%s%s", name, device.device_kind, where, why)
    return name, (shard_attention(fn, mesh) if tp > 1 else fn)


def matmul_unsupported_reason(model, device: jax.Device) -> str | None:
    """Why the Mosaic GPU quantized matmuls cannot serve this model here, or None (its layers
    of a kind without a kernel, a GGUF's int8 ones beside int4, then run the reference)."""
    layers = [(path, layer) for path, layer in quantized_layers(model) if layer.kind in KERNEL_KINDS]
    if not layers:
        kinds = "/".join(sorted({layer.kind for _, layer in quantized_layers(model)}))
        return f"the model has no int4 or fp8 layers ({kinds or 'none quantized'})"
    if not is_hopper(device):
        return f"it needs a Hopper GPU (sm_90); this device is {device.device_kind}"
    dtype = jnp.dtype(model.dtype)
    if dtype not in KERNEL_DTYPES:
        return f"it needs a bf16 or f16 model, this one is {dtype.name}"
    for path, layer in layers:
        if (reason := layer.kernel_unsupported_reason(dtype)) is not None:
            return f"layer {path}: {reason}"
    return None


# Sorted-row counts an expert layer is checked at before its kernel is chosen: a decode
# step's few, a mixed step's, a long prefill chunk's (T tokens times k experts each).
EXPERT_CHECK_ROWS = (8, 256, 4096)


def lora_kernel_unsupported_reason(cfg, dtype, device: jax.Device, tp: int) -> str | None:
    """Why the Mosaic GPU SGMV kernel (pallas_kernels.sgmv_mgpu) cannot serve LoRA's products
    for this model, or None. Checked at the kernel's rank, one slot, the step sizes above."""
    from jaxserve.model.lora import projection_shapes
    from pallas_kernels import sgmv_mgpu

    if not is_hopper(device):
        return f"it needs a Hopper GPU (sm_90); this device is {device.device_kind}"
    if tp > 1:  # NOTE: a Pallas call is opaque to GSPMD, as for the other kernels
        return "the SGMV kernel does not run under tensor parallelism yet"
    dtype = jnp.dtype(dtype)
    if dtype not in KERNEL_DTYPES:
        return f"it needs a bf16 or f16 model, this one is {dtype.name}"
    rank, s = sgmv_mgpu.kernel_rank(1), jax.ShapeDtypeStruct
    for module, (d_in, d_out) in projection_shapes(cfg).items():
        for rows in EXPERT_CHECK_ROWS:
            x, a, b = s((rows, d_in), dtype), s((2, d_in, rank), dtype), s((2, rank, d_out), dtype)
            if (reason := sgmv_mgpu.unsupported_reason(x, a, b)) is not None:
                return f"{module} at {rows} rows: {reason}"
    return None


def expert_matmul_unsupported_reason(model, device: jax.Device, tp: int) -> str | None:
    """Why the Mosaic GPU grouped matmuls cannot serve this MoE model's experts, or None."""
    if not is_hopper(device):
        return f"it needs a Hopper GPU (sm_90); this device is {device.device_kind}"
    if tp > 1:  # NOTE: a Pallas call is opaque to GSPMD; the kernels would need their own shard_map
        return "the grouped matmul kernels do not run under tensor parallelism yet"
    dtype = jnp.dtype(model.dtype)
    if dtype not in KERNEL_DTYPES:
        return f"it needs a bf16 or f16 model, this one is {dtype.name}"
    for path, layer in expert_layers(model):
        for rows in EXPERT_CHECK_ROWS:
            if (reason := layer.kernel_unsupported_reason(rows, dtype)) is not None:
                return f"layer {path} at {rows} rows: {reason}"
    return None


def select_expert_matmul(name: str, model, device: jax.Device, tp: int) -> None:
    """For a mixture of experts: "auto" and "pallas" run its experts' grouped matmuls through
    the Mosaic GPU kernels where they can (pallas_kernels.grouped_matmul_mgpu), converting
    quantized experts once to their layout; otherwise the pure-JAX references
    (jax.lax.ragged_dot). On one CPU device ("auto", "cpu"), steps of up to
    EXPERT_LOOP_MAX_TOKENS tokens run only the experts they touch: XLA's CPU ragged_dot
    computes every expert on every row. They run in the C++ kernel (moe.run_touched_experts_in_cpp)
    where the CPU kernels serve the dense products too, else as a lax loop (moe.run_touched_experts)."""
    loop = name in ("auto", "cpu") and device.platform == "cpu" and tp == 1
    float_experts = any(isinstance(layer, ExpertLinear) for _, layer in expert_layers(model))
    cpp_reason = "the experts are quantized" if not float_experts else None
    cpp_reason = cpp_reason or (dense_matmul_unsupported_reason(model, device, tp) if loop else "not on one CPU device")
    for _, layer in moe_layers(model):
        layer.expert_loop_max_tokens = EXPERT_LOOP_MAX_TOKENS if loop else 0
        layer.few_tokens_runner = run_touched_experts if cpp_reason else run_touched_experts_in_cpp
    reason = "not asked for" if name in ("cpu", "reference") else expert_matmul_unsupported_reason(model, device, tp)
    if reason is None:
        layers = expert_layers(model)
        for _, layer in layers:
            layer.use_kernel_layout()
        logger.info("experts: Mosaic GPU grouped matmul on %s (%d projections)", device.device_kind, len(layers))
    else:
        few = ""
        if loop:
            how = "C++ kernel" if cpp_reason is None else f"lax loop; C++ kernel not used: {cpp_reason}"
            few = f"; the touched experts alone for steps of up to {EXPERT_LOOP_MAX_TOKENS} tokens ({how})"
        logger.info("experts: grouped matmul reference (ragged_dot) on %s%s (%s)", device.device_kind, few, reason)


def dense_matmul_unsupported_reason(model, device: jax.Device, tp: int) -> str | None:
    """Why the CPU kernels cannot serve this model's few-row products (its decoder layers,
    a tied LM head), or None (then they are built and registered)."""
    if device.platform != "cpu":
        return f"it runs on the CPU; this device is {device.platform}"
    if tp > 1:  # NOTE: a custom call is opaque to GSPMD, like a Pallas call
        return "it does not run under tensor parallelism"
    if jnp.dtype(model.dtype) not in cpu_kernels.KV_DTYPES:
        return f"it takes float32 or bfloat16 weights, not {jnp.dtype(model.dtype).name}"
    return cpu_kernels.build(default_cache_dir())


def select_dense_matmul(name: str, model, device: jax.Device, tp: int) -> str:
    """For a model without quantized layers: "cpu" marks it, in place, to run its few-row
    products (decode steps) through the CPU kernels: the decoder layers' (up to
    LAYER_MAX_ROWS rows) and a tied LM head's; else "reference"."""
    if name == "pallas":  # nothing to choose for (as with the variable set for every model)
        logger.info(
            "matmul backend: reference (the Pallas matmul kernels are for quantized models; this one is not quantized)"
        )
        name = "reference"
    reason = None if name == "reference" else dense_matmul_unsupported_reason(model, device, tp)
    if name == "cpu" and reason is not None:
        raise ValueError(f"the CPU matmul kernel cannot run: {reason}")
    use = name != "reference" and reason is None
    model.few_row_kernels = few_row_kernels(model) if use else FewRowKernels()
    dense = use and cpu_kernels.dense_vectorized()
    set_dense_dot_general(model, dense)
    if use:
        logger.info(
            "matmul backend: cpu on %s for the decoder layers' products of up to %d rows%s%s",
            device.device_kind,
            model.few_row_kernels.layer_rows,
            f", every float projection's of {cpu_kernels.DENSE_MIN_ROWS} to {cpu_kernels.DENSE_MAX_ROWS}"
            if dense
            else "",
            f" and the tied LM head's of up to {cpu_kernels.MAX_ROWS}" if model.cfg.tie_word_embeddings else "",
        )
    elif name == "auto":
        logger.info("matmul backend: reference on %s (CPU kernel not used: %s)", device.device_kind, reason)
    return "cpu" if use else "reference"


def select_quantized_cpu_matmul(name: str, model, device: jax.Device, tp: int) -> str:
    """For a quantized model on the CPU: "cpu" converts its int4 and int8 layers, in place,
    to the C++ kernels' tiled layout (their few-row products, decode steps of up to QUANTIZED_MAX_ROWS
    rows, then read the packed values) and marks a tied LM head for the CPU kernels: int8_matmul
    on the table's Q8_0 blocks where it is made of them (a GGUF's), else small_matmul; else
    "reference" (fp8 layers always run the reference)."""
    reason = dense_matmul_unsupported_reason(model, device, tp)
    if name == "cpu" and reason is not None:
        raise ValueError(f"the CPU matmul kernel cannot run: {reason}")
    if reason is not None:
        restore_canonical_layout(model)
        logger.info("matmul backend: reference on %s (CPU kernel not used: %s)", device.device_kind, reason)
        return "reference"
    packed = [layer for _, layer in quantized_layers(model) if layer.kind in MIXABLE_KINDS]
    if not packed and not model.cfg.tie_word_embeddings:
        logger.info(
            "matmul backend: reference on %s (the CPU kernels take int4, int8 or float weights)", device.device_kind
        )
        return "reference"
    for layer in packed:
        layer.use_cpu_layout()
    model.few_row_kernels = few_row_kernels(model)
    head = ""
    if model.cfg.tie_word_embeddings:
        if model.int8_head is None:
            model.int8_head = Int8Table.from_table(model.embed_tokens.embedding[...])
        head = " from its Q8_0 blocks" if model.int8_head is not None else ""
        head = f" and the tied LM head's{head} of up to {cpu_kernels.MAX_ROWS}"
    logger.info(
        "matmul backend: cpu on %s for %d %s layers' products of up to %d rows (tiled layout%s)%s",
        device.device_kind,
        len(packed),
        "/".join(sorted({layer.kind for layer in packed})) or "int4",
        cpu_kernels.QUANTIZED_MAX_ROWS,
        "; a decoder layer's halves one call each" if model.few_row_kernels.layer_rows else "",
        head,
    )
    return "cpu"


def restore_canonical_layout(model) -> None:
    """Int4 / int8 layers an earlier engine put in the CPU kernels' tiled layout back in the
    canonical one (exact), for an engine on the same model that shards them or runs the
    reference; the kernels that engine chose for its few-row products are dropped with it."""
    for _, layer in quantized_layers(model):
        if layer.layout == "cpu":
            layer.use_canonical_layout()
    model.int8_head = None
    model.few_row_kernels = FewRowKernels()
    set_dense_dot_general(model, False)


def set_dense_dot_general(model, on: bool) -> None:
    """Send every float projection's products of DENSE_MIN_ROWS to DENSE_MAX_ROWS rows
    (nnx.Linear's `dot_general`) to the CPU's dense kernel (`on`: cpu_kernels.dense_dot_general;
    XLA's dot, made for fewer or many more rows, loses to it there), or back to XLA's dot."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear) and module.dot_general in (
            jax.lax.dot_general,
            cpu_kernels.dense_dot_general,
        ):
            module.dot_general = cpu_kernels.dense_dot_general if on else jax.lax.dot_general


def _batch_invariant_matmul(name: str, model, device: jax.Device, tp: int) -> str:
    """Mark the model so that every product of its layers and its LM head runs in a fixed
    order: on a Hopper GPU through the Mosaic GPU kernels (use_invariant_mgpu_kernels), on the
    CPU through the C++ kernels (FewRowKernels.batch_invariant); the other models raise:
    XLA's dot blocks its sum over K by the number of rows, so nothing else keeps a row's bits."""
    if is_hopper(device):
        reason = None if name in ("auto", "pallas") else f"it runs on the Pallas matmul kernels here, not {name!r}"
        reason = reason or invariant_mgpu_unsupported_reason(model, tp)
        if reason is not None:
            raise ValueError(f"batch invariance cannot be kept: {reason}")
        use_invariant_mgpu_kernels(model)
        model.batch_invariant = True
        logger.info("matmul backend: pallas on %s, fixed-order kernels (batch invariant)", device.device_kind)
        return "pallas"
    reason = None if name in ("auto", "cpu") else f"it runs on the CPU matmul kernels, not {name!r}"
    quantized_experts = any(not isinstance(layer, ExpertLinear) for _, layer in expert_layers(model))
    if reason is None and (quantized_layers(model) or quantized_experts):
        reason = "the model is quantized (the CPU kernels take float weights)"
    layers = model.layers if isinstance(model.layers, nnx.List) else [model.layers]
    if reason is None and not all(_invariant_on_cpu(layer) for layer in layers):
        reason = "a layer has an o_proj bias beside a dense MLP, which the layer kernels do not compute"
    reason = reason or dense_matmul_unsupported_reason(model, device, tp)
    if reason is not None:
        raise ValueError(f"batch invariance cannot be kept: {reason}")
    model.few_row_kernels = dataclasses.replace(few_row_kernels(model), batch_invariant=True)
    set_dense_dot_general(model, False)  # every row goes through small_matmul's blocks instead
    model.batch_invariant = True
    logger.info("matmul backend: cpu on %s for every row (batch invariant)", device.device_kind)
    return "cpu"


def _invariant_on_cpu(layer) -> bool:
    """A layer the CPU kernels run in a fixed order: plain projections, or float attention
    beside a mixture of float experts (decoder._moe_layer_kernels)."""
    if isinstance(layer.mlp, SparseMoE):
        return has_plain_attention(layer)
    return has_plain_projections(layer)


def invariant_mgpu_unsupported_reason(model, tp: int) -> str | None:
    """Why the Mosaic GPU kernels cannot run every product of this model in their fixed-order
    configs (checked at a decode step's and a prefill's rows), or None."""
    from pallas_kernels import quantized_matmul_mgpu as mgpu

    if tp > 1:  # NOTE: a Pallas call is opaque to GSPMD, as for the other kernels
        return "it does not run under tensor parallelism"
    dtype = jnp.dtype(model.dtype)
    if dtype not in KERNEL_DTYPES:
        return f"on a GPU it needs a bf16 or f16 model, this one is {dtype.name}"
    if expert_layers(model):  # the grouped matmul's rows per expert change with the batch
        return "the model has a mixture of experts, whose grouped matmuls have no fixed-order mode yet"
    for path, module in nnx.iter_modules(model):
        if isinstance(module, QuantizedLinear):
            reason = module.kernel_unsupported_reason(dtype, batch_invariant=True)
        elif isinstance(module, nnx.Linear):
            kernel = jax.ShapeDtypeStruct(module.kernel.shape[-2:], dtype)  # stacked layers: one layer's
            reason = _dense_reason(mgpu, kernel, transposed=False)
        else:
            continue
        if reason is not None:
            return f"layer {'/'.join(map(str, path))}: {reason}"
    if model.cfg.tie_word_embeddings:
        table = jax.ShapeDtypeStruct(model.embed_tokens.embedding.shape, dtype)
        if (reason := _dense_reason(mgpu, table, transposed=True)) is not None:
            return f"the tied LM head: {reason}"
    return None


def _dense_reason(mgpu, w, transposed: bool) -> str | None:
    k = w.shape[1] if transposed else w.shape[0]
    for rows in (1, 512):
        x = jax.ShapeDtypeStruct((rows, k), w.dtype)
        if (reason := mgpu.dense_unsupported_reason(x, w, transposed, batch_invariant=True)) is not None:
            return reason
    return None


def use_invariant_mgpu_kernels(model, *, interpret: bool = False) -> None:
    """Mark `model`, in place, to run in a fixed order on the Mosaic GPU kernels: every float
    projection (and an untied LM head) through the dense kernel, quantized ones through theirs,
    a tied LM head through the dense kernel on the table as stored, and every RMSNorm's sum in
    fixed_order_sum's order. `interpret`: the kernels in the Mosaic GPU interpreter (tests)."""
    from pallas_kernels import quantized_matmul_mgpu as mgpu

    for _, module in nnx.iter_modules(model):
        if isinstance(module, RMSNorm):
            module.fixed_order = True
        elif isinstance(module, QuantizedLinear):
            module.use_kernel_layout(interpret=interpret, batch_invariant=True)
        elif isinstance(module, nnx.Linear):
            module.dot_general = KERNEL_DOT_GENERAL[interpret]
    if model.cfg.tie_word_embeddings:
        model.tied_head_matmul = functools.partial(
            mgpu.dense_matmul, transposed=True, batch_invariant=True, interpret=True if interpret else None
        )


def few_row_kernels(model) -> FewRowKernels:
    """The products the CPU kernels take: every layer's when all its layers have plain float
    projections (up to LAYER_MAX_ROWS rows) or all have int4 / int8 ones in the kernels'
    layout (up to QUANTIZED_MAX_ROWS: the weights converted in registers stay ahead of the
    reference's dequantized copy there), and a tied head's up to MAX_ROWS."""
    layers = model.layers if isinstance(model.layers, nnx.List) else [model.layers]  # unstacked, or stacked
    if all(has_plain_projections(layer) for layer in layers):
        layer_rows = cpu_kernels.LAYER_MAX_ROWS
    elif all(has_quantized_kernel_projections(layer) for layer in layers):
        layer_rows = cpu_kernels.QUANTIZED_MAX_ROWS
    else:
        layer_rows = 0
    return FewRowKernels(
        layer_rows=layer_rows, lm_head_rows=cpu_kernels.MAX_ROWS if model.cfg.tie_word_embeddings else 0
    )


def select_matmul(name: str | None, model, mesh: jax.sharding.Mesh | None = None, batch_invariant: bool = False) -> str:
    """Choose the matmul backend for `name` (None: env var, else auto) and apply it to
    `model` in place. For a quantized model, "pallas" converts its quantized layers to the
    Mosaic GPU kernels' layout; for a float model, "cpu" sends its few-row products (decode
    steps) to the CPU kernels (see select_dense_matmul). `batch_invariant`: every product
    of the layers and the LM head through the CPU kernels, else an error. Returns the backend used."""
    name = name or os.environ.get(MATMUL_ENV_VAR) or "auto"
    if name not in BACKENDS:
        raise ValueError(f"matmul backend {name!r} is not one of {', '.join(BACKENDS)}")
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    tp = 1 if mesh is None else tensor_parallel_size(mesh)
    if batch_invariant:  # before any layer changes its layout: a model it refuses is left as it was
        return _batch_invariant_matmul(name, model, device, tp)
    if expert_layers(model):
        select_expert_matmul(name, model, device, tp)
    if not quantized_layers(model):
        return select_dense_matmul(name, model, device, tp)
    if device.platform == "cpu" and name in ("auto", "cpu"):
        return select_quantized_cpu_matmul(name, model, device, tp)
    reason = None if name == "reference" else matmul_unsupported_reason(model, device)
    if reason is None and tp > 1:
        # NOTE: a Pallas call is opaque to GSPMD; the kernels would need their own shard_map.
        reason = "the quantized matmul kernels do not run under tensor parallelism yet"
    if name == "pallas" and reason is not None:
        raise ValueError(f"the Pallas quantized matmul kernels cannot run: {reason}")
    if name == "auto":
        name = "reference" if reason is not None else "pallas"
    restore_canonical_layout(model)
    converted = {layer.layout for _, layer in quantized_layers(model)} - {"canonical"}
    if name == "reference" and converted:
        # NOTE: the conversion is one-way (the canonical arrays are dropped to save memory).
        raise ValueError(
            f"this model's quantized layers are already in a kernel's layout ({', '.join(sorted(converted))}: an "
            "earlier select_matmul); load the model again to run the reference"
        )
    if name == "pallas":
        count = use_kernel_layout(model)
        rest = len(quantized_layers(model)) - count
        logger.info(
            "matmul backend: pallas on %s (%d quantized layers converted to the kernel layout%s)",
            device.device_kind,
            count,
            f"; {rest} without a kernel run the reference" if rest else "",
        )
    else:
        why = f" (Pallas kernels not used: {reason})" if reason else ""
        logger.info("matmul backend: reference on %s%s", device.device_kind, why)
    return name
