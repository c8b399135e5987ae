"""Our Mosaic GPU kernels exported for CUDA (`jax.export`, no GPU needed) at given shapes,
and the production shapes they are checked at.

Shared by the lowering tests (tests/pallas_kernels/test_*_mgpu.py) and the sm_90a compile
report (benchmarks/gpu_compile.py), so both look at the same cases.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul_mgpu as grouped_mgpu
from pallas_kernels import quantized_matmul_mgpu as matmul_mgpu
from pallas_kernels import ragged_paged_attention_mgpu as attention_mgpu

KV8 = {"fp8": jnp.uint8, "int8": jnp.int8}  # an 8-bit cache's page dtype (fp8 pages are e4m3 bits)

# -- attention -------------------------------------------------------------------------

# (name, tokens, seqs, context, page_size, head_dim, window, soft_cap); 32 query / 8 KV heads
ATTENTION_PRODUCTION = [
    ("decode_b1_32k", 1, 1, 32768, 16, 128, None, None),
    ("decode_b8_32k", 8, 8, 32768, 16, 128, None, None),
    ("decode_b64_8k", 64, 64, 8192, 16, 128, None, None),
    ("decode_b256_4k", 256, 256, 4096, 16, 128, None, None),
    ("decode_b64_8k_window_cap", 64, 64, 8192, 16, 128, 4096, 30.0),
    ("decode_b64_page32", 64, 64, 8192, 32, 128, None, None),
    ("decode_b64_page64", 64, 64, 8192, 64, 128, None, None),
    ("verify_b64_k4", 256, 64, 8192, 16, 128, None, None),
    ("mixed_512_tokens_64_seqs", 512, 64, 8192, 16, 128, None, 50.0),
    ("prefill_8k_tokens_4_seqs", 8192, 4, 32768, 16, 128, None, None),
    ("prefill_window_cap", 2048, 2, 16384, 16, 128, 1024, 30.0),
    ("decode_b1_32k_hd64", 1, 1, 32768, 16, 64, None, None),
    ("prefill_hd64_page64", 4096, 2, 8192, 64, 64, 512, None),
]

# The cases above that are also checked with an 8-bit cache.
KV8_PRODUCTION = [
    p
    for p in ATTENTION_PRODUCTION
    if p[0]
    in (
        "decode_b1_32k",
        "decode_b64_8k_window_cap",
        "decode_b64_page64",
        "mixed_512_tokens_64_seqs",
        "prefill_8k_tokens_4_seqs",
        "decode_b1_32k_hd64",
        "prefill_hd64_page64",
    )
]

# Tree verification: 64 or 8 sequences of a 16-node (or 32-node) tree each beside decodes,
# and a mixed batch; bf16 and 8-bit caches, one and two compute warpgroups.
# (name, tokens, seqs, context, page_size, head_dim, window, soft_cap, kv8)
TREE_PRODUCTION = [
    ("tree_b64_n16", 1024, 64, 8192, 16, 128, None, None, None, 1),
    ("tree_b8_n32_window_cap", 256, 8, 32768, 16, 128, 4096, 30.0, None, 1),
    ("tree_mixed_512_tokens_64_seqs", 512, 64, 8192, 16, 128, None, 50.0, None, 1),
    ("tree_b64_n16_fp8", 1024, 64, 8192, 16, 128, None, None, "fp8", 1),
    ("tree_decode_b64_int8_hd64", 64, 64, 8192, 16, 64, None, None, "int8", 1),
    # Trees past 32 positions: 2 and 4 mask words a token (EAGLE-2-sized trees of 64 and 127 nodes).
    ("tree_b8_n64", 512, 8, 8192, 16, 128, None, None, None, 2),
    ("tree_b4_n127_int8_hd64", 512, 4, 8192, 16, 64, None, None, "int8", 4),
]

# (name, tokens, seqs, query heads, KV heads, head_dim): the default model (SmolLM2-135M:
# 9 / 3 heads, head_dim 64) and MQA, decode and prefill buckets.
OTHER_HEAD_GROUPINGS = [
    ("smollm2_decode", 64, 64, 9, 3, 64),
    ("smollm2_prefill", 2048, 8, 9, 3, 64),
    ("mqa_decode", 32, 32, 32, 1, 128),
    ("mqa_prefill", 1024, 2, 32, 1, 128),
]


def lower_attention(
    num_tokens,
    num_seqs,
    context,
    page_size,
    head_dim,
    window,
    soft_cap,
    *,
    num_heads=32,
    num_kv_heads=8,
    config=None,
    dtype=jnp.bfloat16,
    kv_dtype=None,
    tree_words=0,
    batch_invariant=False,
):
    """jax.export of the attention kernel for CUDA; returns (exported, config, shared-memory
    bytes Mosaic GPU allocated). `config` None is what the engine picks for this bucket;
    `kv_dtype` uint8 / int8 lowers for an 8-bit cache (pages of that dtype, float32 scales);
    `tree_words` with a tree mask of that many words a token; `batch_invariant` in that mode
    (fixed blocks and splits)."""
    max_pages = -(-context // page_size)
    num_pages = num_seqs * max_pages + 1
    config = config or attention_mgpu.default_config(
        num_tokens,
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        kv_dtype=kv_dtype,
        tree_words=tree_words,
        batch_invariant=batch_invariant,
    )
    optional = (("k_scales", "v_scales") if kv_dtype is not None else ()) + (("tree_mask",) if tree_words else ())

    def fn(*args):  # the six arrays, then the optional ones
        return attention_mgpu.ragged_paged_attention(
            *args[:6],
            **dict(zip(optional, args[6:])),
            sm_scale=head_dim**-0.5,
            sliding_window=window,
            soft_cap=soft_cap,
            config=config,
        )

    pages = jax.ShapeDtypeStruct((num_pages, page_size, num_kv_heads, head_dim), kv_dtype or dtype)
    args = (
        jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), dtype),
        pages,
        pages,
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),
    )
    if kv_dtype is not None:
        args += (jax.ShapeDtypeStruct((num_pages, num_kv_heads, page_size), jnp.float32),) * 2
    if tree_words:
        args += (jax.ShapeDtypeStruct((num_tokens, tree_words), jnp.int32),)
    with record_smem() as smem:
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    return exported, config, smem


# -- quantized matmuls -----------------------------------------------------------------

# (name, K, N): Llama-3-8B's fused QKV, gate/up and down projections.
LLAMA3_8B_PROJECTIONS = [("qkv", 4096, 6144), ("gate_up", 4096, 14336), ("down", 14336, 4096)]

# The dense (bf16 weight) kernel: (name, K, N, transposed) at SmolLM2-135M's MLP up projection and
# tied LM head ([N, K]: the embedding table), and a Llama-3.2-1B-like MLP up projection.
DENSE_PROJECTIONS = [
    ("smollm2_up", 576, 1536, False),
    ("smollm2_lm_head", 576, 49152, True),
    ("llama1b_up", 2048, 8192, False),
]


def int4_weight_shapes(k, n, group):
    s = jax.ShapeDtypeStruct
    return matmul_mgpu.Int4KernelWeights(
        s((n, k), jnp.int4), s((k // group, n), jnp.float32), s((k // group, n), jnp.float32), n
    )


def fp8_weight_shapes(k, n):
    s = jax.ShapeDtypeStruct
    return matmul_mgpu.Fp8KernelWeights(s((n, k), jnp.float8_e4m3fn), s((n,), jnp.float32), n)


def lower_matmul(
    kind, tokens, k, n, *, group=128, config=None, dtype=jnp.bfloat16, transposed=False, batch_invariant=False
):
    """jax.export of the int4, fp8 or dense (16-bit weight [K, N], or [N, K] when `transposed`)
    matmul kernel for CUDA; returns (exported, shared-memory bytes Mosaic GPU allocated).
    `config` None is what the engine picks for this many tokens (or the batch-invariant one)."""
    x = jax.ShapeDtypeStruct((tokens, k), dtype)
    options = dict(config=config, batch_invariant=batch_invariant)
    if kind == "int4":
        fn, weights = functools.partial(matmul_mgpu.int4_matmul, **options), int4_weight_shapes(k, n, group)
    elif kind == "fp8":
        fn, weights = functools.partial(matmul_mgpu.fp8_matmul, **options), fp8_weight_shapes(k, n)
    else:
        fn = functools.partial(matmul_mgpu.dense_matmul, transposed=transposed, **options)
        weights = jax.ShapeDtypeStruct((n, k) if transposed else (k, n), dtype)
    with record_smem() as smem:
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(x, weights)
    return exported, smem


# -- grouped (MoE expert) matmuls --------------------------------------------------------

# Qwen3-30B-A3B's experts: hidden 2048, expert intermediate 768, 128 experts, 8 per token.
# (name, K, N): the fused gate/up projection and the down projection.
QWEN3_MOE_PROJECTIONS = [("moe_gate_up", 2048, 2 * 768), ("moe_down", 768, 2048)]
QWEN3_MOE_EXPERTS, QWEN3_MOE_TOP_K = 128, 8
MOE_TOKENS = (8, 256, 2048)  # decode, a small and a large prefill chunk: rows = tokens * top-k


def lower_grouped_matmul(kind, rows, k, n, *, groups=QWEN3_MOE_EXPERTS, group=128, config=None, dtype=jnp.bfloat16):
    """jax.export of the grouped matmul kernel ("float", "int4" or "fp8" expert weights) for
    CUDA with `rows` sorted rows over `groups` experts; returns (exported, shared-memory bytes)."""
    s = jax.ShapeDtypeStruct
    x, sizes = s((rows, k), dtype), s((groups,), jnp.int32)
    if kind == "float":
        fn, weights = grouped_mgpu.grouped_matmul, s((groups, k, n), dtype)
    elif kind == "int4":
        fn = grouped_mgpu.int4_grouped_matmul
        weights = matmul_mgpu.Int4KernelWeights(
            s((groups, n, k), jnp.int4),
            s((groups, k // group, n), jnp.float32),
            s((groups, k // group, n), jnp.float32),
            n,
        )
    else:
        fn = grouped_mgpu.fp8_grouped_matmul
        weights = matmul_mgpu.Fp8KernelWeights(s((groups, n, k), jnp.float8_e4m3fn), s((groups, n), jnp.float32), n)
    with record_smem() as smem:
        exported = jax.export.export(jax.jit(functools.partial(fn, config=config)), platforms=["cuda"])(
            x, weights, sizes
        )
    return exported, smem


class record_smem:
    """Records the shared memory Mosaic GPU allocates while lowering (a private hook; if
    a jax version lacks it, nothing is recorded and the tests' budget checks are skipped)."""

    def __enter__(self):
        from jax.experimental.mosaic.gpu import core as mosaic_core

        self.sizes = []
        self.core, self.original = mosaic_core, getattr(mosaic_core, "_smem_tree_size", None)
        if self.original is not None:

            def spy(tree):
                self.sizes.append(self.original(tree))
                return self.sizes[-1]

            mosaic_core._smem_tree_size = spy
        return self.sizes

    def __exit__(self, *exc):
        if self.original is not None:
            self.core._smem_tree_size = self.original


# -- LoRA's segmented gather matmul (SGMV) ---------------------------------------------------

# Llama-3-8B's projections an adapter targets most (name, d_in, d_out), 8 adapters of rank 16
# (rounded up to the kernel's 64) and the empty slot 0.
LLAMA3_8B_LORA = [("q_proj", 4096, 4096), ("k_proj", 4096, 1024), ("down_proj", 14336, 4096)]
LORA_TOKENS = (8, 256, 2048)
LORA_SLOTS = 9


def lower_sgmv(tokens, d_in, d_out, *, slots=LORA_SLOTS, rank=16, dtype=jnp.bfloat16):
    """jax.export of `sgmv` (its shrink and expand kernels) for CUDA; returns (exported, smem)."""
    from pallas_kernels import sgmv_mgpu

    r = sgmv_mgpu.kernel_rank(rank)
    s = jax.ShapeDtypeStruct
    args = (s((tokens, d_in), dtype), s((slots, d_in, r), dtype), s((slots, r, d_out), dtype), s((tokens,), jnp.int32))
    with record_smem() as smem:
        exported = jax.export.export(jax.jit(sgmv_mgpu.sgmv), platforms=["cuda"])(*args)
    return exported, smem
