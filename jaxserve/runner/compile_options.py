"""The XLA options the engine compiles its programs with: per program, never process-wide.

On a CPU, XLA vectorizes a float reduction (every matmul row, every norm) only if it may
reassociate the sum; without that, decode ran about 25% slower where this was measured
(less where decode is bound by memory bandwidth). `CPU_REASSOCIATION` allows reassociation
and nothing else: NaN, Inf, division and library functions keep IEEE semantics (the
attention masks rely on -inf).

The options go to each program the engine jits (`jax.jit(..., compiler_options=...)`), so
other JAX code in the same process compiles exactly as it would without jaxserve, and
they apply whenever the engine starts, also after jax's CPU client exists. An option
that `XLA_FLAGS` sets is left out, so the user's value wins; `JAXSERVE_NO_XLA_FLAGS=1`
passes none. Other platforms get none (these are XLA's CPU options).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

CPU_REASSOCIATION = {
    "xla_cpu_enable_fast_math": True,
    "xla_cpu_fast_math_honor_infs": True,
    "xla_cpu_fast_math_honor_nans": True,
    "xla_cpu_fast_math_honor_division": True,
    "xla_cpu_fast_math_honor_functions": True,
}


def engine_compiler_options(platform: str, env: Mapping[str, str] = os.environ) -> dict[str, bool] | None:
    """The compiler options of the engine's programs on `platform` ("cpu", "gpu", ...); None: XLA's defaults."""
    if platform != "cpu" or env.get("JAXSERVE_NO_XLA_FLAGS") == "1":
        return None
    user_set = {flag.lstrip("-").split("=", 1)[0] for flag in env.get("XLA_FLAGS", "").split()}
    options = {name: value for name, value in CPU_REASSOCIATION.items() if name not in user_set}
    return options or None
