"""How many devices jax offers: on the CPU, as many as asked for, if asked before jax starts."""

from __future__ import annotations

import logging


def ensure_host_devices(count: int) -> None:
    """Make jax's CPU backend offer at least `count` devices (a no-op for one, or when the
    environment or an earlier call asks for as many already). Call it before anything
    starts jax's backends: the CPU client's device count is fixed once it exists. GPUs are
    whatever the machine has."""
    if count <= 1:
        return
    import jax

    if jax.distributed.is_initialized():  # jaxserve.parallel.multihost.start gave this node its share already
        return
    # The config holds $JAX_NUM_CPU_DEVICES or an earlier call's count: never ask for fewer.
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as e:  # the backend started already: make_mesh will say if too few devices exist
        logging.getLogger(__name__).debug("jax_num_cpu_devices not set: %s", e)
