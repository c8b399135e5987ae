"""The kernel backend switch: Pallas kernels on a GPU that has them, pure JAX elsewhere.

`select_attention(None)` picks the Mosaic GPU kernel on a Hopper GPU and the pure-JAX
reference everywhere else. A flag (`--attention-backend`) or the environment variable
JAXSERVE_ATTENTION_BACKEND forces either: "pallas" or "reference". The choice is logged.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxserve.model import AttentionFn
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "pallas", "reference")
ENV_VAR = "JAXSERVE_ATTENTION_BACKEND"


def is_hopper(device: jax.Device | None = None) -> bool:
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return False
    capability = getattr(device, "compute_capability", "")
    return str(capability).startswith("9.")


def select_attention(name: str | None = None) -> tuple[str, AttentionFn]:
    """(backend name, attention function) for the flag value `name` (None: env var or auto)."""
    name = name or os.environ.get(ENV_VAR) or "auto"
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    device = jax.devices()[0]
    if name == "auto":
        name = "pallas" if is_hopper(device) else "reference"
    if name == "pallas":
        if not is_hopper(device):
            raise ValueError(f"the Pallas attention kernel needs a Hopper GPU (sm_90); this device is {device}")
        from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention

        fn = ragged_paged_attention
    else:
        fn = ragged_paged_attention_reference
    logger.info("attention backend: %s on %s", name, device.device_kind)
    return name, fn
