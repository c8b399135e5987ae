"""The kernel backend switch: Pallas kernels on a GPU that has them, pure JAX elsewhere.

`select_attention(None, ...)` picks the Mosaic GPU kernel on a Hopper GPU when the
model's shapes and dtype suit it (bf16 or f16, head_dim 64 or 128), and the pure-JAX
reference everywhere else. A flag (`--attention-backend`) or the environment variable
JAXSERVE_ATTENTION_BACKEND forces either: "pallas" (an error if it cannot run) or
"reference". The choice and its reason are logged at start-up. Other kernels (int4 and
FP8 matmuls, tree attention) plug into the same switch.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model import AttentionFn
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "pallas", "reference")
ENV_VAR = "JAXSERVE_ATTENTION_BACKEND"


def is_hopper(device: jax.Device) -> bool:
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def pallas_unsupported_reason(cfg: ModelConfig, dtype, block_size: int, device: jax.Device) -> str | None:
    """Why the Mosaic GPU attention kernel cannot serve this model here, or None."""
    if not is_hopper(device):
        return f"it needs a Hopper GPU (sm_90); this device is {device.device_kind}"
    from pallas_kernels.ragged_paged_attention_mgpu import unsupported_reason

    q = jax.ShapeDtypeStruct((8, cfg.num_heads, cfg.head_dim), jnp.dtype(dtype))
    pages = jax.ShapeDtypeStruct((2, block_size, cfg.num_kv_heads, cfg.head_dim), jnp.dtype(dtype))
    return unsupported_reason(q, pages, pages)


def select_attention(name: str | None, cfg: ModelConfig, dtype, block_size: int) -> tuple[str, AttentionFn]:
    """(backend name, attention function) for the flag value `name` (None: env var, else auto)."""
    name = name or os.environ.get(ENV_VAR) or "auto"
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    device = jax.devices()[0]
    reason = None if name == "reference" else pallas_unsupported_reason(cfg, dtype, block_size, device)
    if name == "pallas" and reason is not None:
        raise ValueError(f"the Pallas attention kernel cannot run: {reason}")
    if name == "auto":
        name = "reference" if reason is not None else "pallas"
    if name == "pallas":
        from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention as fn
    else:
        fn = ragged_paged_attention_reference
    why = f" (Pallas kernel not used: {reason})" if name == "reference" and reason else ""
    logger.info("attention backend: %s on %s%s", name, device.device_kind, why)
    return name, fn
