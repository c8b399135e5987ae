"""The mixture-of-experts MLP: Mixtral's, Qwen2-MoE's and Qwen3-MoE's, as Hugging Face computes it.

A router (`gate`, [D, E]) scores every token against E experts; each token goes to its
top k, and the layer's output is the experts' outputs weighted by their routing weights
(`route`). Qwen2-MoE adds a shared expert every token takes, scaled by a sigmoid gate.

The experts are one module per projection with the weights of all E stacked on a leading
axis (`ExpertLinear` [E, D, F]; `QuantizedExpertLinear` per expert in the int4 / fp8
layouts of jaxserve.model.quantization). The T * k (token, expert) pairs are sorted by
expert, so each expert's rows are contiguous, and run as grouped matmuls
(pallas_kernels.grouped_matmul); the results are put back in token order and summed.
A step of few tokens (a decode step, up to EXPERT_LOOP_MAX_TOKENS) runs the experts its tokens
touched one after another instead (`run_touched_experts`, or the same in one C++ call on the
CPU). Parameter names follow Hugging Face's per-expert tensors
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` is row e of `experts.gate_proj.kernel`,
transposed; Mixtral's `block_sparse_moe.experts.{e}.w1` is the same, see weights.params).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.fixed_order import in_fixed_row_blocks
from jaxserve.model.mlp import MLP
from jaxserve.model.quantization import QuantConfig
from pallas_kernels import cpu_kernels
from pallas_kernels.grouped_matmul import (
    fp8_grouped_matmul_reference,
    grouped_matmul_reference,
    int4_grouped_matmul_reference,
)


def route(logits: jax.Array, k: int, *, norm_topk_prob: bool, weights_in_float32: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k], experts int32 [T, k]) from the router's logits [T, E].

    As Hugging Face: softmax in float32, the top k (ties to the lower expert index), renormed
    to sum to one if asked; Qwen then casts the weights to the logits' dtype, Mixtral keeps float32.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return (weights if weights_in_float32 else weights.astype(logits.dtype)), experts.astype(jnp.int32)


class ExpertLinear(nnx.Module):
    """E float projections stacked: kernel [E, din, dout]; called on rows sorted by expert.

    `use_kernel_layout` (jaxserve.runner.kernels.select_matmul, on a Hopper GPU) makes it call
    the Mosaic GPU grouped matmul (pallas_kernels.grouped_matmul_mgpu) for every step shape
    the kernel takes, and the reference for the others."""

    def __init__(self, num_experts: int, din: int, dout: int, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=0)
        self.kernel = nnx.Param(init(rngs.params(), (num_experts, din, dout), dtype))
        self.layout = "canonical"  # or "mgpu"
        self.interpret = False  # mgpu: run the kernel in the Mosaic GPU interpreter (tests)

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        w = self.kernel[...]
        if self.layout == "mgpu":
            from pallas_kernels import grouped_matmul_mgpu as gmm  # NOTE: imported where used, see QuantizedLinear

            if gmm.unsupported_reason(x, w, group_sizes) is None:  # decided per step shape, at trace time
                return gmm.grouped_matmul(x, w, group_sizes, interpret=True if self.interpret else None)
        return grouped_matmul_reference(x, w, group_sizes)

    def kernel_unsupported_reason(self, rows: int, dtype) -> str | None:
        """Why the Mosaic GPU kernel cannot take `rows` sorted rows of `dtype`, or None."""
        from pallas_kernels import grouped_matmul_mgpu as gmm

        e, din, _ = self.kernel.shape
        x, groups = jax.ShapeDtypeStruct((rows, din), dtype), jax.ShapeDtypeStruct((e,), jnp.int32)
        return gmm.unsupported_reason(x, jax.ShapeDtypeStruct(self.kernel.shape, dtype), groups)

    def use_kernel_layout(self, *, interpret: bool = False) -> None:
        """Call the Mosaic GPU kernel from now on (float weights need no conversion)."""
        self.layout, self.interpret = "mgpu", interpret


class QuantizedExpertLinear(nnx.Module):
    """E quantized projections stacked: QuantizedLinear's parameters with a leading [E] axis,
    converted by `use_kernel_layout` to the Mosaic GPU kernels' layout as QuantizedLinear is."""

    def __init__(self, num_experts: int, din: int, dout: int, quant: QuantConfig):
        self.kind = quant.kind
        self.dout = dout
        self.layout = "canonical"  # or "mgpu"
        self.interpret = False
        e = num_experts
        quant.check_experts()
        if quant.kind == "int4":
            if din % 2:
                raise ValueError(f"int4 packs two values per byte along K; K={din} is odd")
            group = quant.group_size_for(din)
            self.packed = nnx.Param(jnp.zeros((e, din // 2, dout), jnp.uint8))
            self.scales = nnx.Param(jnp.zeros((e, din // group, dout), jnp.float32))
            self.offsets = nnx.Param(jnp.zeros((e, din // group, dout), jnp.float32))
        else:
            self.weight = nnx.Param(jnp.zeros((e, din, dout), jnp.float8_e4m3fn))
            self.scales = nnx.Param(jnp.ones((e, dout), jnp.float32))

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        if self.layout == "mgpu":
            from pallas_kernels import grouped_matmul_mgpu as gmm

            interpret = True if self.interpret else None
            if self.kind == "int4":
                weights = gmm.Int4KernelWeights(self.q[...], self.scales[...], self.offsets[...], self.dout)
                return gmm.int4_grouped_matmul(x, weights, group_sizes, interpret=interpret)
            weights = gmm.Fp8KernelWeights(self.weight[...], self.scales[...], self.dout)
            return gmm.fp8_grouped_matmul(x, weights, group_sizes, interpret=interpret)
        if self.kind == "int4":
            return int4_grouped_matmul_reference(x, self.packed[...], self.scales[...], self.offsets[...], group_sizes)
        return fp8_grouped_matmul_reference(x, self.weight[...], self.scales[...], group_sizes)

    def kernel_unsupported_reason(self, rows: int, dtype) -> str | None:
        """Why the Mosaic GPU kernel cannot take `rows` sorted rows of `dtype`, or None."""
        from pallas_kernels import grouped_matmul_mgpu as gmm

        if self.kind == "int4":
            w = jax.eval_shape(gmm.prepare_int4, self.packed[...], self.scales[...], self.offsets[...])
            check, weights = gmm.int4_unsupported_reason, gmm.Int4KernelWeights(w.q, w.scales, w.offsets, self.dout)
        else:
            w = jax.eval_shape(gmm.prepare_fp8, self.weight[...], self.scales[...])
            check, weights = gmm.fp8_unsupported_reason, gmm.Fp8KernelWeights(w.weight, w.scales, self.dout)
        e, din = self.scales.shape[0], self.weight.shape[1] if self.kind == "fp8" else 2 * self.packed.shape[1]
        return check(jax.ShapeDtypeStruct((rows, din), dtype), weights, jax.ShapeDtypeStruct((e,), jnp.int32))

    def use_kernel_layout(self, *, interpret: bool = False) -> None:
        """Convert the stacked parameters, once, to the kernels' layout (the canonical arrays are dropped)."""
        from pallas_kernels import grouped_matmul_mgpu as gmm

        if self.layout == "mgpu":
            return
        if self.kind == "int4":
            w = jax.jit(gmm.prepare_int4)(self.packed[...], self.scales[...], self.offsets[...])
            del self.packed
            self.q = nnx.Param(w.q)
            self.scales, self.offsets = nnx.Param(w.scales), nnx.Param(w.offsets)
        else:
            w = jax.jit(gmm.prepare_fp8)(self.weight[...], self.scales[...])
            self.weight, self.scales = nnx.Param(w.weight), nnx.Param(w.scales)
        self.layout, self.interpret = "mgpu", interpret


class Experts(nnx.Module):
    """E SwiGLU MLPs (down(silu(gate(x)) * up(x))) over rows sorted by expert."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quant: QuantConfig | None = None):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

        def linear(din, dout):
            if quant is not None:
                return QuantizedExpertLinear(e, din, dout, quant)
            return ExpertLinear(e, din, dout, dtype, rngs)

        self.gate_proj, self.up_proj, self.down_proj = linear(d, f), linear(d, f), linear(f, d)

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.gate_proj(x, group_sizes)) * self.up_proj(x, group_sizes)
        return self.down_proj(h, group_sizes)


def run_experts(experts: Experts, x: jax.Array, weights: jax.Array, chosen: jax.Array, num_experts: int) -> jax.Array:
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]) for every token t: x [T, D] -> [T, D].

    The T * k (token, expert) pairs are sorted by expert (stably: tokens stay in order within
    an expert), gathered, run as grouped matmuls and scattered back by the inverse order."""
    t, k = chosen.shape
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    y = experts(x[order // k], group_sizes)  # [T * k, D], sorted by expert
    y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1)  # back to (token, choice) order
    return jnp.sum(y.astype(jnp.float32) * weights[..., None].astype(jnp.float32), axis=1).astype(x.dtype)


def expert_layers(model: nnx.Module) -> list[tuple[str, ExpertLinear | QuantizedExpertLinear]]:
    """(path, layer) of every stacked expert projection in the model."""
    kinds = (ExpertLinear, QuantizedExpertLinear)
    return [("/".join(map(str, path)), m) for path, m in nnx.iter_modules(model) if isinstance(m, kinds)]


# Tokens up to which a float MoE layer on the CPU runs `run_touched_experts` rather than
# `run_experts`: decode-sized steps, where reading the weights is the cost
# (benchmarks/moe_decode.py). jaxserve.runner.kernels.select_matmul sets it per layer.
EXPERT_LOOP_MAX_TOKENS = 64


def run_touched_experts(
    experts: Experts, x: jax.Array, weights: jax.Array, chosen: jax.Array, num_experts: int
) -> jax.Array:
    """`run_experts` for few tokens and float experts: a loop over the E experts in which each
    expert some token chose runs on all T tokens, its output weighted by each token's routing
    weight for it (zero where the token did not choose it), and the others are skipped.

    NOTE: XLA's CPU ragged_dot computes every expert on every sorted row (a dense product over
    E weights and T * k rows, masked), so a decode step read all E experts' weights and did
    E * k times the work; here only the touched experts' weights are read, each once (but each
    runs on all T tokens: touched * T rows of work, where a grouped kernel would do k * T)."""
    t = x.shape[0]
    routed = (
        jnp.zeros((t, num_experts), jnp.float32).at[jnp.arange(t)[:, None], chosen].add(weights.astype(jnp.float32))
    )
    touched = jnp.zeros((num_experts,), jnp.bool_).at[chosen.reshape(-1)].set(True)
    gate, up, down = experts.gate_proj.kernel[...], experts.up_proj.kernel[...], experts.down_proj.kernel[...]

    def project(h, w):  # as grouped_matmul_reference: float32 accumulation, x's dtype out
        return jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32).astype(h.dtype)

    def add_expert(e, y):  # y [T, D] float32
        def run(y):
            h = jax.nn.silu(project(x, gate[e])) * project(x, up[e])
            return y + project(h, down[e]).astype(jnp.float32) * routed[:, e, None]

        return jax.lax.cond(touched[e], run, lambda y: y, y)

    return jax.lax.fori_loop(0, num_experts, add_expert, jnp.zeros(x.shape, jnp.float32)).astype(x.dtype)


def run_touched_experts_in_cpp(
    experts: Experts, x: jax.Array, weights: jax.Array, chosen: jax.Array, num_experts: int
) -> jax.Array:
    """`run_touched_experts` as one call of the C++ CPU kernel (pallas_kernels.cpu_kernels.moe_experts,
    built and registered first): each touched expert runs on its own tokens only, over both cores.
    XLA runs the loop as many small ops, each paying a dispatch and a wake-up of its thread pool."""
    del num_experts  # the kernel reads E from the stacked weights
    gate, up, down = experts.gate_proj.kernel[...], experts.up_proj.kernel[...], experts.down_proj.kernel[...]
    return cpu_kernels.moe_experts(x, chosen, weights, gate, up, down)


def moe_layers(model: nnx.Module) -> list[tuple[str, SparseMoE]]:
    """(path, layer) of every mixture-of-experts MLP in the model."""
    return [("/".join(map(str, path)), m) for path, m in nnx.iter_modules(model) if isinstance(m, SparseMoE)]


class SparseMoE(nnx.Module):
    """The MLP of a mixture-of-experts layer: router, experts, and Qwen2-MoE's shared expert.

    `experts_runner`: how the routed tokens reach the experts, `run_experts`'s signature;
    jaxserve.parallel.experts sets it to split the experts over a mesh (expert parallelism).
    `expert_loop_max_tokens`: steps of up to that many tokens run `few_tokens_runner`
    instead (float experts on one CPU device; select_matmul sets it, 0: never):
    `run_touched_experts`, or `run_touched_experts_in_cpp` where the CPU kernels build."""

    experts_runner = staticmethod(run_experts)
    expert_loop_max_tokens = 0
    few_tokens_runner = staticmethod(run_touched_experts)

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quant: QuantConfig | None = None):
        self.cfg = cfg
        d = cfg.hidden_size
        self.gate = nnx.Linear(d, cfg.num_experts, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg, dtype, rngs, quant)
        if cfg.shared_expert_intermediate_size:
            shared = quant and quant.under("shared_expert")
            self.shared_expert = MLP(cfg, dtype, rngs, shared, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nnx.Linear(d, 1, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def in_fixed_order(self, x: jax.Array) -> jax.Array:
        """`self(x)` with a row's result independent of the other rows (batch invariance, float
        experts on the CPU): the router's and the shared expert's products through the C++
        small_matmul in blocks, the routing in fixed 16-row blocks, the experts through the C++
        kernel, which sums each token on its own in ascending expert order."""
        cfg = self.cfg

        def product(h, linear: nnx.Linear):
            return cpu_kernels.in_row_blocks(cpu_kernels.small_matmul, (h,), linear.kernel[...])

        def routing(logits):
            return route(
                logits,
                cfg.num_experts_per_tok,
                norm_topk_prob=cfg.norm_topk_prob,
                weights_in_float32=cfg.routing_weights_in_float32,
            )

        weights, chosen = in_fixed_row_blocks(routing, product(x, self.gate))
        experts = self.experts
        y = cpu_kernels.moe_experts(
            x,
            chosen,
            weights,
            experts.gate_proj.kernel[...],
            experts.up_proj.kernel[...],
            experts.down_proj.kernel[...],
        )
        if cfg.shared_expert_intermediate_size:
            mlp = self.shared_expert
            up = product(x, mlp.up_proj)
            shared = product(jax.nn.silu(product(x, mlp.gate_proj)) * up, mlp.down_proj)
            y = y + jax.nn.sigmoid(product(x, self.shared_expert_gate)) * shared
        return y

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        with jax.named_scope("moe_router"):
            weights, chosen = route(
                self.gate(x),
                cfg.num_experts_per_tok,
                norm_topk_prob=cfg.norm_topk_prob,
                weights_in_float32=cfg.routing_weights_in_float32,
            )
        with jax.named_scope("moe_experts"):
            few = x.shape[0] <= self.expert_loop_max_tokens and isinstance(self.experts.gate_proj, ExpertLinear)
            run = self.few_tokens_runner if few else self.experts_runner
            y = run(self.experts, x, weights, chosen, cfg.num_experts)
        if cfg.shared_expert_intermediate_size:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
