"""Expert parallelism: a mixture of experts' experts split whole over the mesh's "model" axis.

With `--enable-expert-parallel` each of the tp devices holds E / tp whole experts (every
stacked expert parameter, quantized ones alike, split on its leading E axis: see
sharding.param_shardings); attention, the router and a shared expert stay tensor-parallel
as without it. Without the flag, tensor parallelism splits each expert on its F axis like
a dense MLP, and GSPMD partitions the grouped matmuls itself (one all-reduce per layer, no
gathering of expert weights: tests/jaxserve/parallel/test_expert_parallel.py reads the HLO).

Dispatch, per MoE layer, under `jax.shard_map`: two ways (EngineConfig.expert_dispatch,
--expert-dispatch), the same results to float tolerance.

"all-reduce" (the default):

    x [T, D] (replicated: attention's all-reduce leaves every device the whole batch)
      every device: route all T tokens (the router is replicated, so all agree)
      device r:     keep the (token, expert) pairs whose expert is one of its own,
                    r * E/tp ... (r + 1) * E/tp - 1; the others sort last with weight 0
                    and get no group, so the grouped matmuls give them zeros
                    run_experts on its local experts -> partial y_r [T, D]
      psum over "model" -> y [T, D] on every device

"all-to-all":

    x [T, D] padded to T' = a multiple of tp; device r takes tokens r * T'/tp ... : x_r [T'/tp, D]
      device r:  its R = T'/tp * k (token, expert) pairs, each to the device owning the expert:
                 send [tp, R, D] (row d: the pairs for device d, packed first; the rest empty)
      all_to_all -> recv [tp, R, D] (row s: what device s sent here)
                 run_experts on its local experts over the tp * R = T' * k rows (empty rows
                 get no group, so zeros), unweighted
      all_to_all back -> each pair's expert output on the device that sent it
                 weighted and summed per token in float32 -> y_r [T'/tp, D]
      all_gather over "model" -> y [T', D] on every device, the padding cut off

NOTE: the capacity. Shapes must be static, so each (sender, receiver) slot holds R =
T'/tp * k rows: the worst case, every pair of a device's tokens on one device's experts.
Nothing is ever dropped (an uneven load works, as with the psum), but every device's
grouped matmuls run over T' * k rows, as many as the psum's, and the buffers are tp times
the rows really sent. With activations already replicated after attention it saves no
compute; it trades one psum of [T, D] for two all_to_alls of [tp, R, D] and an all_gather.
benchmarks/expert_dispatch.py measures the two (docs/benchmarks.md); all-to-all would pay
off with tokens sharded (data parallelism inside the engine) and a capacity below the
worst case, which jaxserve does not do (`data` is size 1, nothing is dropped).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.model.config import ModelConfig
from jaxserve.model.moe import SparseMoE, run_experts

logger = logging.getLogger(__name__)


def check_expert_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError if the model's experts cannot be split whole over `tp` devices."""
    if cfg.is_moe and cfg.num_experts % tp:
        divisors = [d for d in range(1, cfg.num_experts + 1) if cfg.num_experts % d == 0]
        raise ValueError(
            f"expert parallelism: tensor parallel size {tp} does not divide the model's {cfg.num_experts} "
            f"experts; it can be one of {divisors} (or leave out --enable-expert-parallel to split each expert)"
        )


EXPERT_DISPATCHES = ("all-reduce", "all-to-all")


def use_expert_parallel(model: nnx.Module, mesh: jax.sharding.Mesh, dispatch: str = "all-reduce") -> int:
    """Make every MoE layer of `model` (in place) run its experts split over `mesh`'s "model"
    axis, tokens reaching them by `dispatch` (one of EXPERT_DISPATCHES); returns how many
    layers. The parameters must be placed with `param_shardings(..., expert_parallel=True)`."""
    runners = {"all-reduce": expert_parallel_runner, "all-to-all": all_to_all_runner}
    if dispatch not in runners:
        raise ValueError(f"expert dispatch {dispatch!r}: one of {EXPERT_DISPATCHES}")
    runner = runners[dispatch](mesh)
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, SparseMoE)]
    for layer in layers:
        layer.experts_runner = runner
    if layers:
        e, tp = layers[0].cfg.num_experts, mesh.shape["model"]
        logger.info(
            "expert parallel %d: each device holds %d of the %d experts of %d MoE layers (%s dispatch)",
            *(tp, e // tp, e, len(layers), dispatch),
        )
    return len(layers)


@functools.cache
def expert_parallel_runner(mesh: jax.sharding.Mesh):
    """`run_experts` over `mesh` with each device running its own experts (see the module
    docstring); the same function object for the same mesh, so jitted layers are cached by it."""
    tp = mesh.shape["model"]

    def run(experts, x: jax.Array, weights: jax.Array, chosen: jax.Array, num_experts: int) -> jax.Array:
        graphdef, state = nnx.split(experts)
        local = num_experts // tp

        def per_device(state, x, weights, chosen):
            first = jax.lax.axis_index("model") * local
            mine = (chosen >= first) & (chosen < first + local)
            # NOTE: other devices' experts become expert `local`: sorted after the local ones
            # and past every group, so their rows come back zero (and their weights are 0).
            local_chosen = jnp.where(mine, chosen - first, local)
            y = run_experts(nnx.merge(graphdef, state), x, jnp.where(mine, weights, 0), local_chosen, local)
            return jax.lax.psum(y, "model")

        specs = jax.tree.map(lambda _: P("model"), state)  # every expert parameter: [E, ...] split on E
        return jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=P())(
            state, x, weights, chosen
        )

    return run


@functools.cache
def all_to_all_runner(mesh: jax.sharding.Mesh):
    """`run_experts` over `mesh` with each device's tokens sent to their experts' devices and
    back by all_to_all (see the module docstring); one function object per mesh, as above."""
    tp = mesh.shape["model"]

    def run(experts, x: jax.Array, weights: jax.Array, chosen: jax.Array, num_experts: int) -> jax.Array:
        graphdef, state = nnx.split(experts)
        local = num_experts // tp
        t = x.shape[0]
        pad = -t % tp
        # NOTE: padding tokens weigh 0 and take expert 0: sent and run like any, then dropped.
        x_pad, weights_pad, chosen_pad = (
            jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)) for a in (x, weights, chosen)
        )

        def per_device(state, x, weights, chosen):  # x [T'/tp, D], weights / chosen [T'/tp, k]
            tokens, k = chosen.shape
            rows = tokens * k  # R: the capacity of each (sender, receiver) slot, the worst case
            flat = chosen.reshape(-1)
            owner = flat // local  # [R]: the device holding each pair's expert
            slot = _position_among_equals(owner, tp)  # [R]: where in owner's row the pair goes
            send = jnp.zeros((tp, rows, x.shape[-1]), x.dtype).at[owner, slot].set(x[jnp.arange(rows) // k])
            # Empty slots carry expert `local`: past every group, so their rows come back zero.
            send_experts = jnp.full((tp, rows), local, jnp.int32).at[owner, slot].set(flat % local)
            recv = jax.lax.all_to_all(send, "model", 0, 0, tiled=True)  # [tp, R, D]: row s from device s
            recv_experts = jax.lax.all_to_all(send_experts, "model", 0, 0, tiled=True)
            one = jnp.ones((tp * rows, 1), weights.dtype)
            y = run_experts(
                nnx.merge(graphdef, state), recv.reshape(tp * rows, -1), one, recv_experts.reshape(-1, 1), local
            )  # unweighted: weight 1 in float32 is exact
            back = jax.lax.all_to_all(y.reshape(tp, rows, -1), "model", 0, 0, tiled=True)  # row d: from device d
            pairs = back[owner, slot].reshape(tokens, k, -1)
            # as run_experts: the k outputs weighted and summed in float32, one rounding to x's dtype
            y = jnp.sum(pairs.astype(jnp.float32) * weights[..., None].astype(jnp.float32), axis=1).astype(x.dtype)
            return y

        specs = jax.tree.map(lambda _: P("model"), state)
        y = jax.shard_map(
            per_device, mesh=mesh, in_specs=(specs, P("model"), P("model"), P("model")), out_specs=P("model")
        )(state, x_pad, weights_pad, chosen_pad)
        # The all_gather: every device gets all T' tokens back, replicated like x.
        y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P()))
        return y[:t]

    return run


def _position_among_equals(keys: jax.Array, num_keys: int) -> jax.Array:
    """For each of keys [R] (ints in [0, num_keys)), how many earlier entries have the same key."""
    order = jnp.argsort(keys, stable=True)
    counts = jnp.bincount(keys, length=num_keys)
    starts = jnp.cumsum(counts) - counts
    ranks = jnp.arange(keys.shape[0]) - starts[keys[order]]
    return jnp.zeros_like(keys).at[order].set(ranks)
