"""Expert parallelism: a mixture of experts' experts split whole over the mesh's "model" axis.

With `--enable-expert-parallel` each of the tp devices holds E / tp whole experts (every
stacked expert parameter, quantized ones alike, split on its leading E axis: see
sharding.param_shardings); attention, the router and a shared expert stay tensor-parallel
as without it. Without the flag, tensor parallelism splits each expert on its F axis like
a dense MLP, and GSPMD partitions the grouped matmuls itself (one all-reduce per layer, no
gathering of expert weights: tests/jaxserve/parallel/test_expert_parallel.py reads the HLO).

Dispatch, per MoE layer, under `jax.shard_map`:

    x [T, D] (replicated: attention's all-reduce leaves every device the whole batch)
      every device: route all T tokens (the router is replicated, so all agree)
      device r:     keep the (token, expert) pairs whose expert is one of its own,
                    r * E/tp ... (r + 1) * E/tp - 1; the others sort last with weight 0
                    and get no group, so the grouped matmuls give them zeros
                    run_experts on its local experts -> partial y_r [T, D]
      psum over "model" -> y [T, D] on every device

NOTE: why not all_to_all. The alternative sends each token to its experts' devices and
back. With static shapes every device's receive buffer must hold the worst case (all
T * k pairs on its experts: an uneven load, which must work), so it saves no compute over
running the local rows of all T; and since the activations are already replicated after
attention, it adds two all_to_alls where this needs one psum of [T, D], the same
all-reduce a dense tensor-parallel MLP makes. all_to_all pays off when tokens are sharded
(data parallelism inside the engine), which jaxserve does not do (`data` is size 1).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
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


def use_expert_parallel(model: nnx.Module, mesh: jax.sharding.Mesh) -> int:
    """Make every MoE layer of `model` (in place) run its experts split over `mesh`'s "model"
    axis; returns how many layers. The parameters must be placed with
    `param_shardings(..., expert_parallel=True)`."""
    runner = expert_parallel_runner(mesh)
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, SparseMoE)]
    for layer in layers:
        layer.experts_runner = runner
    if layers:
        e, tp = layers[0].cfg.num_experts, mesh.shape["model"]
        logger.info(
            "expert parallel %d: each device holds %d of the %d experts of %d MoE layers", tp, e // tp, e, len(layers)
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
