"""Serving arithmetic: what the weights and the KV cache occupy, how many sequences fit,
and the roofline bound on a step's time (`python -m jaxserve.plan` prints it).

Everything here is counted from the model config and the engine's own layout rules
(`jaxserve.model.kv_cache`: the bytes a token occupies, the null block, whole blocks per
sequence), so the plan is what the engine allocates, not an approximation of it.

The roofline: a step can go no faster than its bytes over the memory bandwidth, nor than
its FLOPs over the peak compute rate; its time bound is the larger of the two. A decode
step reads every weight once whatever the batch (plus each sequence's KV), and does
about 2 FLOPs per weight per token, so small batches are bound by memory and large ones
by compute. A mixture of experts reads only the experts its tokens were routed to
(E * (1 - (1 - k/E) ** B) per layer for B tokens under uniform routing) and computes
with its active parameters only (jaxserve.model.weight_sizes counts both). Not modelled:
tensor-parallel communication (and expert parallelism's all-to-all), kernel efficiency,
the host's time between steps, activations' memory traffic, routing imbalance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax.numpy as jnp

from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import kv_bytes_per_token, num_blocks_for_memory
from jaxserve.model.quantization import QuantConfig
from jaxserve.model.weight_sizes import (  # noqa: F401  (re-exported: the plan's and tests' names)
    ParamCounts,
    device_weight_bytes,
    embedding_bytes,
    expected_distinct_experts,
    expert_bytes,
    matmul_params,
    parameter_counts,
    projection_bytes,
    streamed_weight_bytes,
    weight_bytes,
)

GB, GiB = 10**9, 2**30


def both_units(num_bytes: float) -> str:
    """'85.9 GB (80.0 GiB)': decimal and binary, so neither is mistaken for the other."""
    if num_bytes < 10**6:
        return f"{num_bytes / 10**3:,.1f} kB ({num_bytes / 2**10:,.1f} KiB)"
    if num_bytes < 10**9:
        return f"{num_bytes / 10**6:,.1f} MB ({num_bytes / 2**20:,.1f} MiB)"
    return f"{num_bytes / GB:,.2f} GB ({num_bytes / GiB:,.2f} GiB)"


# -- the device ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Device:
    """What bounds a step: memory size, memory bandwidth and peak dense FLOP/s by dtype."""

    name: str
    memory_bytes: int
    bandwidth: float  # bytes per second
    peak_flops: dict[str, float]  # by compute dtype: float32, bfloat16, float16, fp8
    source: str = "table"  # "table", "measured" or "flags"

    def peak_for(self, compute_dtype: str) -> float:
        if compute_dtype in self.peak_flops:
            return self.peak_flops[compute_dtype]
        if compute_dtype == "fp8":  # no fp8 units (A100, CPUs): the matmul runs in 16 bits
            return self.peak_for("bfloat16")
        return self.peak_flops["float32"]


def _gpu(name, memory_gb, tb_s, f32, bf16, fp8=None) -> Device:
    peaks = {"float32": f32 * 1e12, "bfloat16": bf16 * 1e12, "float16": bf16 * 1e12}
    if fp8:
        peaks["fp8"] = fp8 * 1e12
    return Device(name, int(memory_gb * GB), tb_s * 1e12, peaks)


# Vendors' data-sheet figures: dense (no sparsity) tensor-core peaks, float32 as TF32
# (what XLA's default matmul precision uses on these GPUs).
DEVICES = {
    "h100": _gpu("NVIDIA H100 SXM 80GB", 80, 3.35, 494.7, 989.4, 1978.9),
    "h200": _gpu("NVIDIA H200 SXM 141GB", 141, 4.8, 494.7, 989.4, 1978.9),
    "a100": _gpu("NVIDIA A100 SXM 80GB", 80, 2.039, 156, 312),
    "a100-40gb": _gpu("NVIDIA A100 SXM 40GB", 40, 1.555, 156, 312),
    "l40s": _gpu("NVIDIA L40S 48GB", 48, 0.864, 183, 362, 733),
    "tpu-v5e": _gpu("Google TPU v5e", 16, 0.819, 197, 197),
    "tpu-v6e": _gpu("Google TPU v6e", 32, 1.64, 918, 918),
}


# -- the model's bytes and FLOPs -------------------------------------------------------


def compute_dtype(dtype, quant: QuantConfig | None) -> str:
    """The dtype the projections' matmuls run in: fp8 for W8A8, else the activations'."""
    return "fp8" if quant is not None and quant.kind == "fp8" else jnp.dtype(dtype).name


def attention_flops(cfg: ModelConfig, query_tokens: int, keys: float) -> float:
    """QK^T and PV: 4 * head_dim FLOPs per (query head, visible key), every layer."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * query_tokens * keys


# -- the KV cache ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """The cache the engine allocates for a memory budget, and what fits in it."""

    bytes_per_token: int
    block_size: int
    num_blocks: int  # per layer, the null block included
    context: int

    @property
    def nbytes(self) -> int:
        """What the allocated K, V (and scale) arrays hold: every block, the null one too."""
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def usable_tokens(self) -> int:
        return max(0, self.num_blocks - 1) * self.block_size

    @property
    def blocks_per_sequence(self) -> int:
        return math.ceil(self.context / self.block_size)

    @property
    def bytes_per_sequence(self) -> int:
        """A `context`-token sequence's cache, in whole blocks."""
        return self.blocks_per_sequence * self.block_size * self.bytes_per_token

    @property
    def max_sequences(self) -> int:
        """Whole `context`-token sequences that fit at once (0: not even one)."""
        return max(0, self.num_blocks - 1) // self.blocks_per_sequence


def plan_kv(
    cfg: ModelConfig,
    kv_dtype,
    *,
    context: int,
    block_size: int = 16,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
    tp: int = 1,
) -> KVPlan:
    """The engine's cache for `memory_bytes` of K and V (or `num_blocks` blocks), per
    device under tensor parallelism `tp` (KV heads split, replicated when fewer than tp)."""
    cfg_per_device = per_device_config(cfg, tp)
    if num_blocks is None:
        if memory_bytes is None:
            raise ValueError("give the cache's memory or its number of blocks")
        num_blocks = num_blocks_for_memory(cfg_per_device, memory_bytes, block_size, kv_dtype)
    return KVPlan(kv_bytes_per_token(cfg_per_device, kv_dtype), block_size, num_blocks, context)


def kv_budget_for_utilization(utilization: float, *, total_bytes: int, peak_bytes: int) -> int:
    """KV-cache bytes under vLLM's --gpu-memory-utilization: the engine may use
    `utilization` of the device's `total_bytes`; what the weights and the largest step's
    activations took at their peak (`peak_bytes`, measured after warm-up) is not the
    cache's. Raises ValueError when nothing is left, saying what utilization would do."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    allowed = int(utilization * total_bytes)
    budget = allowed - peak_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} allows {both_units(allowed)} of {both_units(total_bytes)}, but "
            f"the weights and the largest step's activations already take {both_units(peak_bytes)}: nothing is "
            f"left for the KV cache; give more than {peak_bytes / total_bytes:.3f} (or lower max_num_batched_tokens "
            f"/ max_num_seqs)"
        )
    return budget


class KVBudget(NamedTuple):
    """The KV cache's bytes per device under --gpu-memory-utilization, each device's figure
    and the device that bounds it (with tensor parallelism every device holds the same
    cache shape, so the smallest budget is the one that fits all)."""

    per_device: dict[str, int]  # device name -> its own budget

    @property
    def bytes(self) -> int:
        return min(self.per_device.values())

    @property
    def limiting_device(self) -> str:
        return min(self.per_device, key=self.per_device.__getitem__)


def kv_budget_per_device(
    utilization: float, stats: Mapping[str, Mapping[str, int]], probe_kv_bytes: Mapping[str, int]
) -> KVBudget:
    """Each device's KV bytes from its allocator figures (`stats[device]`: `bytes_limit` and
    `peak_bytes_in_use`, read after the probe's warm-up) less what the probe's own small
    cache held there (`probe_kv_bytes[device]`): see kv_budget_for_utilization. Raises
    ValueError naming the device where nothing is left."""
    if not stats:
        raise ValueError("no device memory figures to size the KV cache from")
    per_device = {}
    for device, s in stats.items():
        try:
            per_device[device] = kv_budget_for_utilization(
                utilization,
                total_bytes=s["bytes_limit"],
                peak_bytes=s["peak_bytes_in_use"] - probe_kv_bytes.get(device, 0),
            )
        except ValueError as e:
            raise ValueError(f"{device}: {e}" if len(stats) > 1 else str(e)) from None
    return KVBudget(per_device)


def per_device_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config of one device's shard: KV heads divided by tp (at least one each)."""
    if tp == 1:
        return cfg
    kv = max(1, cfg.num_kv_heads // tp)
    return dataclasses.replace(cfg, num_kv_heads=kv, num_heads=max(kv, cfg.num_heads // tp))


def activation_workspace(cfg: ModelConfig, *, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """An estimate of the largest step's live activations: float32 per token (the hidden
    state, q/k/v, the MLP's two intermediate rows: in a MoE layer k experts' and the
    shared expert's, and the router's logits) and float32 logits per sequence, with the
    sampler's copies of them."""
    mlp = [2 * cfg.intermediate_size] if not cfg.is_moe or cfg.dense_mlp_layers else []
    if cfg.is_moe:
        experts = cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
        mlp.append(2 * experts + cfg.num_experts)
    per_token = 4 * (3 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + max(mlp))
    return max_num_batched_tokens * per_token + 3 * max_num_seqs * cfg.vocab_size * 4


# -- the roofline ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepBound:
    tokens: int  # tokens the step produces (decode: the batch)
    bytes: float
    flops: float
    memory_s: float  # bytes over bandwidth
    compute_s: float  # FLOPs over peak

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound_by(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclasses.dataclass(frozen=True)
class Setup:
    """A model as served: its config, dtypes, quantization, tensor-parallel degree and
    whether its experts are split whole over the devices (expert parallelism)."""

    cfg: ModelConfig
    dtype: str = "float32"
    quant: QuantConfig | None = None
    kv_dtype: str = "float32"  # the cache's storage dtype (jnp name)
    tp: int = 1
    expert_parallel: bool = False

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.cfg, self.dtype, self.quant)

    @property
    def device_weight_bytes(self) -> int:
        """One device's weights (each device the same, up to a remainder of experts)."""
        return device_weight_bytes(self.cfg, self.dtype, self.quant, tp=self.tp, expert_parallel=self.expert_parallel)

    def device_streamed_bytes(self, tokens: float) -> float:
        """Weight bytes one device reads in a step of `tokens` tokens (MoE: the experts touched)."""
        return streamed_weight_bytes(
            self.cfg, self.dtype, self.quant, tokens=tokens, tp=self.tp, expert_parallel=self.expert_parallel
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.cfg, self.kv_dtype)

    @property
    def device_kv_bytes_per_token(self) -> int:
        """One device's share under tensor parallelism (KV heads replicated when fewer than tp)."""
        return kv_bytes_per_token(per_device_config(self.cfg, self.tp), self.kv_dtype)

    def decode_bound(self, device: Device, batch: int, context: int, tokens_per_seq: int = 1) -> StepBound:
        """One decode step of `batch` sequences at `context` tokens each, computing
        `tokens_per_seq` tokens per sequence (1; k+1 when verifying k drafts)."""
        cfg = self.cfg
        tokens = batch * tokens_per_seq
        kv = batch * (context + tokens_per_seq) * self.device_kv_bytes_per_token  # read the context, write the new
        flops = 2.0 * tokens * (matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size)  # active parameters
        flops += attention_flops(cfg, tokens, context)
        return self._bound(device, batch, self.device_streamed_bytes(tokens) + kv, flops / self.tp)

    def prefill_bound(self, device: Device, prompt_len: int) -> StepBound:
        """One prompt of `prompt_len` tokens, in one step (causal: half the keys on average)."""
        cfg = self.cfg
        kv = prompt_len * self.device_kv_bytes_per_token
        flops = 2.0 * (prompt_len * matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size)
        flops += attention_flops(cfg, prompt_len, (prompt_len + 1) / 2)
        return self._bound(device, prompt_len, self.device_streamed_bytes(prompt_len) + kv, flops / self.tp)

    def _bound(self, device: Device, tokens: int, num_bytes: float, flops: float) -> StepBound:
        peak = device.peak_for(compute_dtype(self.dtype, self.quant))
        return StepBound(tokens, num_bytes, flops, num_bytes / device.bandwidth, flops / peak)

    def compute_bound_batch(self, device: Device, context: int, limit: int = 1 << 16) -> int | None:
        """The smallest batch whose decode step is bound by compute (None: none up to `limit`)."""
        lo, hi = 1, limit
        if self.decode_bound(device, hi, context).bound_by == "memory":
            return None
        while lo < hi:  # the compute share grows with the batch: bisect
            mid = (lo + hi) // 2
            if self.decode_bound(device, mid, context).bound_by == "compute":
                hi = mid
            else:
                lo = mid + 1
        return lo

    def speculative_speedup(
        self,
        device: Device,
        *,
        batch: int,
        context: int,
        acceptance_length: float,
        num_speculative_tokens: int,
        draft_cost: float,
    ) -> float:
        """The bound on speculative decoding's speed-up: `acceptance_length` tokens (accepted
        drafts + 1) per verify step of k+1 tokens per sequence, plus k draft steps each
        costing `draft_cost` times a plain decode step."""
        k = num_speculative_tokens
        plain = self.decode_bound(device, batch, context).seconds
        verify = self.decode_bound(device, batch, context, tokens_per_seq=k + 1).seconds
        return acceptance_length * plain / (verify + k * draft_cost * plain)
