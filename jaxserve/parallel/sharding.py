"""Tensor parallelism: the one module that knows the device mesh.

An engine runs on a mesh of devices with axes ("data", "model"); `data` stays size 1
inside an engine (data-parallel replicas are separate processes, see api/replica_processes.py), and
`model` has the tensor-parallel size. jax's GSPMD partitions the step programs from the
shardings of their inputs (Megatron-style):

- Q/K/V, gate and up projections are column-parallel (output features split), O and down
  row-parallel (input features split): one all-reduce after each row-parallel matmul.
- The embedding and LM head are split on the vocabulary; the logits are gathered whole
  (`replicated`) before the sampler, so sampling, penalties and grammars stay unchanged.
- The KV cache is split on its KV-head axis, and attention runs per shard under
  `jax.shard_map` (`shard_attention`): each device attends with its own heads and pages.

When the model has fewer KV heads than devices, its K/V projections are repeated head by
head at load time (`replicate_kv_heads`), so each device still holds whole heads; the KV
cache then holds the repeated heads too. An axis that does not divide by the
tensor-parallel size (a tiny test vocabulary, some int4 scale groups) stays replicated:
GSPMD keeps the result exact, only that weight is not split.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.sizing import per_device_config

logger = logging.getLogger(__name__)

AXES = ("data", "model")
HEADS = P(None, "model", None)  # [T, heads, head_dim]: q and attention's output
PAGES = P(None, None, "model", None)  # folded pages [pages, page_size, KV, head_dim]
PAGE_SCALES = P(None, "model", None)  # folded 8-bit scales [pages, KV, page_size]

# (parameter path regex, the axis split across "model"): -1 the last axis, 0 the first.
# Paths are nnx's, e.g. "layers/3/self_attn/q_proj/kernel"; anything unmatched is replicated.
# A mixture of experts' stacked experts ([E, din, dout], quantized forms alike) come first:
# under plain tensor parallelism each expert is split like a dense MLP, on its F axis;
# with expert parallelism (_EXPERT_PARALLEL_RULES) whole experts are split on E.
_PARAM_RULES = (
    (r"experts/(gate|up)_proj/(kernel|packed|scales|offsets|weight)$", -1),  # [E, D, F]: F
    (r"experts/down_proj/(kernel|packed|scales|offsets|weight)$", 1),  # [E, F, D]: F (fp8 scales [E, D]: whole)
    # LoRA slot stacks (jaxserve.model.lora) split as their projections: B [n, r, d_out] of a
    # column-parallel one on d_out, A [n, d_in, r] of a row-parallel one on d_in; the rest whole.
    (r"lora/(q|k|v|gate|up)_proj_b$", -1),
    (r"lora/(o|down)_proj_a$", 1),
    (r"(q|k|v|gate|up)_proj/(kernel|packed|scales|offsets|weight|bias)$", -1),  # column-parallel
    (r"(o|down)_proj/(kernel|packed|scales|offsets|weight)$", 0),  # row-parallel (fp8 scales: 1-D, see below)
    (r"embed_tokens/embedding$", 0),  # [V, D]: vocabulary
    (r"lm_head/kernel$", -1),  # [D, V]: vocabulary
)
_EXPERT_PARALLEL_RULES = ((r"experts/\w+_proj/\w+$", 0),)  # every stacked expert parameter: E


def make_mesh(tensor_parallel_size: int = 1, device_ids: tuple[int, ...] | None = None) -> jax.sharding.Mesh:
    """A (1, tp) mesh over `device_ids` (indices into jax.devices(); default the first tp)."""
    devices = jax.devices()
    ids = tuple(device_ids) if device_ids is not None else tuple(range(tensor_parallel_size))
    if len(ids) != tensor_parallel_size:
        raise ValueError(f"tensor parallel size {tensor_parallel_size} needs as many devices, got device ids {ids}")
    if max(ids) >= len(devices) or min(ids) < 0:
        hint = (
            " (on the CPU, --tensor-parallel-size sets jax_num_cpu_devices before jax starts; in a library, "
            "call jax.config.update('jax_num_cpu_devices', N) first)"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(
            f"device ids {ids} need {max(ids) + 1} devices, and jax sees {len(devices)} "
            f"{devices[0].platform} device(s){hint}"
        )
    # NOTE: Auto axes (plain GSPMD). jax 0.12's make_mesh defaults to Explicit, which puts
    # shardings into array types and refuses the implicit reshards GSPMD does for us.
    return jax.make_mesh((1, len(ids)), AXES, axis_types=(AxisType.Auto,) * 2, devices=[devices[i] for i in ids])


def replica_device_ids(
    tensor_parallel_size: int, data_parallel_size: int, devices: Sequence[int] | None = None
) -> list[tuple[int, ...]]:
    """Each data-parallel replica's device ids: consecutive groups of tensor_parallel_size
    from `devices` (default 0, 1, 2, ...)."""
    need = tensor_parallel_size * data_parallel_size
    devices = list(range(need) if devices is None else devices)
    if len(devices) < need:
        raise ValueError(
            f"{data_parallel_size} replicas of {tensor_parallel_size} devices need {need} devices, got {devices}"
        )
    return [
        tuple(devices[i * tensor_parallel_size : (i + 1) * tensor_parallel_size]) for i in range(data_parallel_size)
    ]


def tensor_parallel_size(mesh: jax.sharding.Mesh) -> int:
    return mesh.shape["model"]


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError if the model's heads cannot be split over `tp` devices."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if cfg.num_heads % tp:
        divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
        raise ValueError(
            f"tensor parallel size {tp} does not divide the model's {cfg.num_heads} attention heads; "
            f"it can be one of {divisors}"
        )
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor parallel size {tp} and the model's {kv} KV heads: one must divide the other")


def kv_heads_for(cfg: ModelConfig, tp: int) -> int:
    """KV heads the engine keeps over all devices: the model's, or `tp` when it has fewer
    (each repeated, so that every device holds whole heads)."""
    return per_device_config(cfg, tp).num_kv_heads * tp


def replicate_kv_heads(state, cfg: ModelConfig, tp: int):
    """The parameters with each K/V projection head repeated tp // num_kv_heads times (a no-op
    when the model has as many KV heads as devices or more, or when they are repeated already).
    Query head h reads KV head h // (num_heads / kv); after repeating r times, the repeated
    head h // (num_heads / (kv * r)) is a copy of that same head, so attention is unchanged.
    Host (NumPy) arrays are repeated on the host: the loader repeats before placing."""
    want = kv_heads_for(cfg, tp)
    r = want // cfg.num_kv_heads
    if r == 1:
        return state
    logged = []

    def repeat(path, x):
        if not is_kv_projection(path) or x.ndim == 0:
            return x
        if x.shape[-1] == want * cfg.head_dim:  # repeated already (a model placed by the loader)
            return x
        if not logged:
            logger.info(
                "tensor parallel %d: repeating each of the model's %d KV heads %dx (one whole head per device)",
                tp,
                cfg.num_kv_heads,
                r,
            )
            logged.append(True)
        xp = np if isinstance(x, np.ndarray) else jnp
        heads = x.reshape(*x.shape[:-1], cfg.num_kv_heads, -1)  # every K/V parameter has its outputs last
        return xp.repeat(heads, r, axis=-2).reshape(*x.shape[:-1], -1)

    return jax.tree.map_with_path(repeat, state)


def is_kv_projection(path) -> bool:
    """Whether the parameter at tree `path` belongs to a K or V projection (its outputs are KV heads)."""
    # a LoRA B stack's too; not an act-order layer's input_order (its axis is the inputs)
    return re.search(r"(k|v)_proj/(?!input_order$)\w+$|lora/(k|v)_proj_b$", _path(path)) is not None


def param_shardings(state: nnx.State, mesh: jax.sharding.Mesh, expert_parallel: bool = False) -> nnx.State:
    """A NamedSharding for every parameter, from `_PARAM_RULES`; with `expert_parallel`, a
    mixture of experts' experts are split whole over the devices instead (see check_expert_parallel)."""
    tp = tensor_parallel_size(mesh)
    rules = _EXPERT_PARALLEL_RULES + _PARAM_RULES if expert_parallel else _PARAM_RULES
    kept_whole = []

    def spec(path, x):
        name = _path(path)
        for pattern, axis in rules:
            if re.search(pattern, name):
                if axis >= 0 and x.ndim == axis + 1:
                    break  # a row-parallel layer's per-output fp8 scales ([D], experts' [E, D]): kept whole
                if x.shape[axis] % tp:
                    kept_whole.append(name)
                    break
                parts = [None] * x.ndim
                parts[axis] = "model"
                return NamedSharding(mesh, P(*parts))
        return NamedSharding(mesh, P())

    shardings = jax.tree.map_with_path(spec, state)
    if kept_whole and tp > 1:
        logger.info(
            "tensor parallel %d: %d parameters do not divide evenly and stay whole on every device (e.g. %s)",
            tp,
            len(kept_whole),
            kept_whole[0],
        )
    return shardings


def kv_cache_sharding(mesh: jax.sharding.Mesh, quantized: bool):
    """The cache's shardings (a KVCache of NamedShardings): split on the KV-head axis."""
    pages = NamedSharding(mesh, P(None, None, None, "model", None))  # [L, blocks, block_size, KV, D]
    scales = NamedSharding(mesh, P(None, None, "model", None)) if quantized else None  # [L, blocks, KV, block_size]
    return KVCache(pages, pages, scales, scales)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place(tree, shardings):
    """jax.device_put(tree, shardings), also onto a mesh over several hosts
    (jaxserve.parallel.multihost), where device_put refuses an array held on one device: there each
    node cuts its own devices' shards from its host copy of the whole array. An array already
    placed so is kept as it is (no copy)."""

    def put(x, sharding):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x  # placed so by the loader (over several hosts it cannot be read back whole)
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        return place_from_host(np.asarray(x), sharding)

    return jax.tree.map(put, tree, shardings)


def place_from_host(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array placed with `sharding`: each device receives its own slice only, so no
    device ever holds more of it than its shard."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def resident_bytes(tree) -> dict[int, int]:
    """Bytes each device holds of the arrays in `tree`, by device id (this process's devices)."""
    held: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in getattr(x, "addressable_shards", ()):
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return dict(sorted(held.items()))


@functools.cache
def shard_attention(attention, mesh: jax.sharding.Mesh):
    """`attention` (the model's AttentionFn signature) run per device on its own heads; the
    same function object for the same arguments, so jitted layers are cached by it."""

    def sharded(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        query_start_loc,
        *,
        k_scales=None,
        v_scales=None,
        tree_mask=None,
        **static,
    ):
        arrays = {
            "k_scales": (k_scales, PAGE_SCALES),
            "v_scales": (v_scales, PAGE_SCALES),
            "tree_mask": (tree_mask, P()),
        }
        names = [name for name, (a, _) in arrays.items() if a is not None]

        def local(q, k_pages, v_pages, kv_lens, block_tables, query_start_loc, *extra):
            return attention(
                q, k_pages, v_pages, kv_lens, block_tables, query_start_loc, **dict(zip(names, extra)), **static
            )

        in_specs = (HEADS, PAGES, PAGES, P(), P(), P(), *(arrays[n][1] for n in names))
        # NOTE: check_vma=False: the reference's fori_loop carries start as unvarying zeros and
        # become device-varying in the loop, which the check rejects; every input is split or
        # replicated as the specs say, so the check adds nothing here.
        run = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=HEADS, check_vma=False)
        return run(q, k_pages, v_pages, kv_lens, block_tables, query_start_loc, *(arrays[n][0] for n in names))

    return sharded


def _path(path) -> str:
    """ "layers/3/self_attn/q_proj/kernel" for a parameter's tree path (a Variable's own
    `.value` attribute left out)."""
    return "/".join(str(k.key if hasattr(k, "key") else k.idx) for k in path if not hasattr(k, "name"))
