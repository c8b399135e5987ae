"""How many devices jax offers (on the CPU, as many as asked for, if asked before jax starts), and
which cores its CPU threads run on."""

from __future__ import annotations

import logging
import os


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


# How many cores jax's threads were given by pin_cpu_compute (None: not pinned, every thread may use every
# core), and the cores the process had before.
_compute_count: int | None = None
_process_cores: tuple[int, ...] | None = None


def process_cores() -> tuple[int, ...]:
    """The cores this process may run on, as before pin_cpu_compute split them: a child process
    started from a pinned host thread would inherit only the host's (set this in the child)."""
    return _process_cores or tuple(sorted(os.sched_getaffinity(0)))


def pin_cpu_compute(count: int | None) -> None:
    """vLLM's split of a CPU machine between compute and host: jax's threads (the CPU client's
    pools, which run XLA's ops and the C++ kernels with their helpers) on the first `count`
    cores this process may use, and the calling thread, with every thread it starts later
    (the scheduler, tokenizers, the HTTP server), on the others. On a busy machine the
    compute threads then do not take turns with the host's. None: no split.

    It must run before jax starts its backends, because their threads take the cores of the
    thread that starts them; once pinned, asking again for the same count is a no-op. A
    ValueError says which counts this machine allows, a RuntimeError that jax started already."""
    global _compute_count, _process_cores
    if count is None:
        return
    if _compute_count is not None:
        if _compute_count == count:
            return
        raise RuntimeError(f"cpu_compute_cores={count}: jax's threads run on {_compute_count} core(s) already")
    allowed = sorted(os.sched_getaffinity(0))
    if not isinstance(count, int) or not 1 <= count < len(allowed):
        raise ValueError(
            f"cpu_compute_cores must be 1 to {len(allowed) - 1} (this process may run on {len(allowed)} "
            f"core(s), and the host needs one of them), got {count!r}"
        )
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "cpu_compute_cores must be set before jax starts its backends (their threads take the cores of "
            "the thread that starts them): pass it to LLM(...) or jaxserve.engine.builder.load, or as "
            "--cpu-compute-cores, before anything makes a jax array or asks for jax.devices()"
        )
    import jax

    compute = allowed[:count]
    os.sched_setaffinity(0, compute)  # this thread only: its children inherit the set
    try:
        jax.devices()  # starts the backends, whose threads now run on `compute`
    except BaseException:
        os.sched_setaffinity(0, allowed)  # no split after all: give the caller back every core
        raise
    os.sched_setaffinity(0, allowed[count:])
    _compute_count, _process_cores = count, tuple(allowed)
    logging.getLogger(__name__).info("jax's threads on core(s) %s, the host on %s", compute, allowed[count:])
