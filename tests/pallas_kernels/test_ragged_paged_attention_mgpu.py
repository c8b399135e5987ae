"""The Mosaic GPU ragged paged attention kernel, tested without a GPU in two ways.

1. Run under the Mosaic GPU interpreter (with its race detector) on small shapes, against
   the dense float64 oracle and the pure-JAX reference: mixed prefill + decode batches,
   ragged lengths, contexts ending mid-page and mid-block, scrambled block tables, a
   shared first page, padding tokens and sequences, GQA 1 / 3 / 8, window and soft-cap,
   flash-decoding splits, one and two compute warpgroups. Unused pages and slots are NaN.
   An 8-bit cache (e4m3 / int8 with per-token scales; unused int8 slots hold random
   bytes, unused scales NaN) is checked against both on the dequantized pages. Draft
   trees (a tree mask word per token) in mixed batches. Batch-invariant mode: a token's
   rows == alone and in random batches (hypothesis), prefill chunks == decode.
2. Lowered for CUDA with `jax.export` at production shapes (bf16, e4m3 and int8 caches,
   with and without a tree mask);
   Mosaic GPU targets sm_90 when no GPU is present and checks the shared-memory budget
   (227 KiB) while lowering.

With JAXSERVE_MGPU_ON_GPU=1 (benchmarks/gpu_check.sh) the same cases run compiled on
the GPU instead of interpreted, and production-shape cases (tree verification included)
are added against the reference.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.mosaic_lowering import (
    ATTENTION_PRODUCTION,
    KV8,
    KV8_PRODUCTION,
    OTHER_HEAD_GROUPINGS,
    TREE_PRODUCTION,
    lower_attention,
)
from pallas_kernels import ragged_paged_attention_mgpu as mgpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.attention_cases import (
    batch_tree_mask,
    dense_attention,
    kary_tree,
    make_case,
    pack_case,
    quantize_case,
    random_sequence,
    tree_words,
)

ON_GPU = os.environ.get("JAXSERVE_MGPU_ON_GPU") == "1"
if ON_GPU and jax.devices()[0].platform != "gpu":
    pytest.skip("JAXSERVE_MGPU_ON_GPU=1 but there is no GPU", allow_module_level=True)

ARGS = ("q", "k_pages", "v_pages", "kv_lens", "block_tables", "query_start_loc")
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def run_kernel(case, **kwargs):
    interpret = None if ON_GPU else plgpu.InterpretGPUParams(detect_races=True)
    if case.k_scales is not None:  # an 8-bit cache
        kwargs.update(k_scales=jnp.asarray(case.k_scales), v_scales=jnp.asarray(case.v_scales))
    out = mgpu.ragged_paged_attention(*(jnp.asarray(getattr(case, a)) for a in ARGS), interpret=interpret, **kwargs)
    return np.asarray(out.astype(jnp.float32), np.float64)


def run_reference(case, **kwargs):
    out = ragged_paged_attention_reference(*(jnp.asarray(getattr(case, a)) for a in ARGS), **kwargs)
    return np.asarray(out.astype(jnp.float32), np.float64)


def small_config(**kwargs):
    """Few CTAs (each walks many work units) and 64-token kv blocks: quick to interpret."""
    return mgpu.TuningConfig(**{"block_kv": 64, "num_ctas": 3, "min_split_blocks": 1, **kwargs})


def check(case, *, config, tol=BF16_TOL, dequantized=None, **kwargs):
    """Kernel vs the float64 oracle and the reference; for an 8-bit `case` both see the
    `dequantized` pages (the reference without scales)."""
    got = run_kernel(case, config=config, **kwargs)
    assert np.isfinite(got).all()
    want = dense_attention(case, **kwargs)
    np.testing.assert_allclose(got, want, **tol)
    np.testing.assert_allclose(got, run_reference(dequantized or case, **kwargs), **tol)
    pad = case.num_real_tokens
    assert not got[pad:].any(), "padding tokens must give zeros"


# -- 1. interpreted (or, with JAXSERVE_MGPU_ON_GPU=1, compiled) ---------------------


@pytest.mark.interpret
@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (24, None), (None, 2.0), (40, 3.0)])
def test_mixed_prefill_and_decode(groups, window, soft_cap):
    rng = np.random.default_rng(groups * 100 + (window or 0))
    # A prefill, a chunk continuing an earlier prefill, decodes and a 3-token verification;
    # contexts end mid-page (ps 8), on a block boundary (64) and past several blocks; one
    # padding sequence and three padding tokens.
    case = make_case(
        rng,
        [13, 5, 1, 1, 3],
        [70, 150, 9, 64, 200],
        num_heads=2 * groups,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
        pad_tokens=3,
        pad_seqs=1,
        dtype=jnp.bfloat16,
    )
    check(case, config=small_config(query_tile=4), sm_scale=0.125, sliding_window=window, soft_cap=soft_cap)


@pytest.mark.interpret
@pytest.mark.parametrize("kv_lens", [[600], [1000, 17, 130]])
def test_flash_decoding_splits(kv_lens):
    """Few sequences, more CTAs than tiles: each context is split and the parts combined."""
    rng = np.random.default_rng(len(kv_lens))
    case = make_case(
        rng,
        [1] * len(kv_lens),
        kv_lens,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        pad_tokens=1,
        dtype=jnp.bfloat16,
    )
    config = small_config(num_ctas=8)
    plan = mgpu.plan_work(case.kv_lens, case.query_start_loc, num_tokens=case.q.shape[0], num_kv_heads=2, config=config)
    items = np.asarray(plan.item_tile)[: int(plan.num_items[0])]
    assert np.bincount(items).max() > 1, "expected a context split over several items"
    check(case, config=config, sm_scale=0.125)
    check(case, config=config, sm_scale=0.125, sliding_window=300)


@pytest.mark.interpret
@pytest.mark.parametrize("groups,query_tile", [(8, 16), (3, 40)])
def test_two_compute_warpgroups(groups, query_tile):
    """Tiles of 128 and 120 rows: two compute warpgroups share each K/V block."""
    rng = np.random.default_rng(groups)
    case = make_case(
        rng,
        [40, 1, 7],
        [100, 130, 7],
        num_heads=2 * groups,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
        share_first_page=True,
        dtype=jnp.bfloat16,
    )
    config = small_config(query_tile=query_tile, num_compute_wgs=2)
    check(case, config=config, sm_scale=0.125)
    check(case, config=config, sm_scale=0.125, sliding_window=33, soft_cap=5.0)


@pytest.mark.interpret
def test_decode_batch_with_padding():
    """One token per sequence (tiles of 1 token, G rows), padding tokens and sequences."""
    rng = np.random.default_rng(3)
    kv_lens = [1, 16, 64, 65, 127, 128, 129, 300]
    case = make_case(
        rng,
        [1] * len(kv_lens),
        kv_lens,
        num_heads=8,
        num_kv_heads=1,
        head_dim=64,
        page_size=16,
        pad_tokens=5,
        pad_seqs=2,
        dtype=jnp.bfloat16,
    )
    check(case, config=small_config(block_kv=128), sm_scale=0.3)


@pytest.mark.interpret
@pytest.mark.parametrize("page_size,block_kv", [(16, 128), (32, 64), (64, 128)])
def test_page_sizes_head_dim_128(page_size, block_kv):
    rng = np.random.default_rng(page_size)
    case = make_case(
        rng,
        [9, 1, 2],
        [9, 200, 131],
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        page_size=page_size,
        dtype=jnp.bfloat16,
    )
    check(case, config=small_config(block_kv=block_kv, query_tile=2, max_concurrent_steps=2), sm_scale=128**-0.5)


@pytest.mark.interpret
def test_float16_and_default_config():
    rng = np.random.default_rng(5)
    case = make_case(
        rng, [6, 1, 1], [50, 77, 3], num_heads=6, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float16
    )
    config = None if ON_GPU else small_config(query_tile=2)  # the default's 132 CTAs interpret slowly
    check(case, config=config, tol=dict(atol=5e-3, rtol=5e-3), sm_scale=0.125, soft_cap=4.0)


@pytest.mark.interpret
def test_plan_reused_under_jit():
    """A plan is a pytree computed once per step and passed to every layer's call."""
    rng = np.random.default_rng(11)
    case = make_case(rng, [3, 1], [40, 90], num_heads=4, num_kv_heads=2, head_dim=64, page_size=8, dtype=jnp.bfloat16)
    config = small_config(query_tile=2)
    interpret = None if ON_GPU else plgpu.InterpretGPUParams()

    @jax.jit
    def two_layers(q, k_pages, v_pages, kv_lens, block_tables, query_start_loc):
        plan = mgpu.plan_work(kv_lens, query_start_loc, num_tokens=q.shape[0], num_kv_heads=2, config=config)
        attend = functools.partial(mgpu.ragged_paged_attention, sm_scale=0.125, plan=plan, interpret=interpret)
        first = attend(q, k_pages, v_pages, kv_lens, block_tables, query_start_loc)
        return first, attend(first, k_pages, v_pages, kv_lens, block_tables, query_start_loc)

    first, second = two_layers(*(jnp.asarray(getattr(case, a)) for a in ARGS))
    np.testing.assert_allclose(np.asarray(first, np.float32), dense_attention(case, sm_scale=0.125), **BF16_TOL)
    case.q = np.asarray(first)
    np.testing.assert_allclose(np.asarray(second, np.float32), dense_attention(case, sm_scale=0.125), **BF16_TOL)


# "fp8" is stored as the engine stores it, e4m3 bit patterns in uint8 (test_8bit_cache_two_compute_warpgroups
# passes float8_e4m3fn pages).
@pytest.mark.interpret
@pytest.mark.parametrize("kv8,groups,window,soft_cap", [("fp8", 3, 24, None), ("int8", 8, None, 2.0)])
def test_8bit_cache_mixed_prefill_and_decode(kv8, groups, window, soft_cap):
    """An e4m3 / int8 cache with per-token scales, dequantized inside the kernel. Unused
    slots hold NaN (int8: random bytes) with NaN scales."""
    rng = np.random.default_rng(groups)
    case = make_case(
        rng,
        [13, 5, 1, 1, 3],
        [70, 150, 9, 64, 200],
        num_heads=2 * groups,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
        pad_tokens=3,
        pad_seqs=1,
        dtype=jnp.bfloat16,
    )
    quantized, dequantized = quantize_case(case, KV8[kv8], rng)
    check(
        quantized,
        dequantized=dequantized,
        config=small_config(query_tile=4),
        sm_scale=0.125,
        sliding_window=window,
        soft_cap=soft_cap,
    )


@pytest.mark.interpret
@pytest.mark.parametrize("kv8", ["fp8", "int8"])
def test_8bit_cache_flash_decoding_head_dim_128(kv8):
    """Decodes split over several items, a 3-token verification tile, head_dim 128."""
    rng = np.random.default_rng(7)
    case = make_case(
        rng,
        [1, 3, 1],
        [600, 131, 17],
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        pad_tokens=1,
        dtype=jnp.bfloat16,
    )
    quantized, dequantized = quantize_case(case, KV8[kv8], rng)
    config = small_config(num_ctas=8, query_tile=2)
    plan = mgpu.plan_work(case.kv_lens, case.query_start_loc, num_tokens=case.q.shape[0], num_kv_heads=2, config=config)
    items = np.asarray(plan.item_tile)[: int(plan.num_items[0])]
    assert np.bincount(items).max() > 1, "expected a context split over several items"
    check(quantized, dequantized=dequantized, config=config, sm_scale=128**-0.5)


@pytest.mark.interpret
def test_8bit_cache_two_compute_warpgroups():
    """Each compute warpgroup upcasts into its own buffer; float16 queries."""
    rng = np.random.default_rng(8)
    case = make_case(rng, [40, 1], [100, 70], num_heads=16, num_kv_heads=2, head_dim=64, page_size=8, dtype=jnp.float16)
    quantized, dequantized = quantize_case(case, jnp.float8_e4m3fn, rng)
    check(
        quantized,
        dequantized=dequantized,
        config=small_config(query_tile=16, num_compute_wgs=2),
        tol=dict(atol=5e-3, rtol=5e-3),
        sm_scale=0.125,
        sliding_window=33,
    )


# Draft trees to verify, in BFS order (each node's parent; the root's is -1): a chain, a
# tree with two children per node, and 20 nodes with three children each.
CHAIN = [-1, 0, 1, 2]
BUSHY = [-1, 0, 0, 1, 1, 2, 2, 3, 5]
TERNARY_20 = kary_tree(20, 3)


@pytest.mark.interpret
@pytest.mark.parametrize("window,soft_cap,kv8", [(None, None, None), (40, 3.0, "int8")])
def test_tree_verification_in_a_mixed_batch(window, soft_cap, kv8):
    """A prefill chunk, decodes and two draft trees (tiles of 4 tokens). The bushy tree's
    new tokens (positions 60..68) cross a kv block boundary: its second tile's tree bits
    fall in a block wholly before its causal diagonal."""
    rng = np.random.default_rng(21 + (window or 0))
    q_lens, kv_lens = [13, 1, len(CHAIN), 1, len(BUSHY)], [70, 9, 150, 64, 60 + len(BUSHY)]
    case = make_case(
        rng,
        q_lens,
        kv_lens,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
        pad_tokens=3,
        pad_seqs=1,
        dtype=jnp.bfloat16,
    )
    mask = batch_tree_mask(case, {2: CHAIN, 4: BUSHY})
    kwargs = dict(
        config=small_config(query_tile=4), sm_scale=0.125, sliding_window=window, soft_cap=soft_cap, tree_mask=mask
    )
    if kv8 is None:
        check(case, **kwargs)
    else:
        quantized, dequantized = quantize_case(case, KV8[kv8], rng)
        check(quantized, dequantized=dequantized, **kwargs)


@pytest.mark.interpret
def test_tree_verification_two_compute_warpgroups():
    """A 20-node tree in 16-token tiles of 128 rows (GQA 8), beside a prefill chunk and a decode."""
    rng = np.random.default_rng(9)
    case = make_case(
        rng,
        [40, 1, len(TERNARY_20)],
        [100, 130, 50],
        num_heads=16,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
        pad_tokens=2,
        dtype=jnp.bfloat16,
    )
    mask = batch_tree_mask(case, {2: TERNARY_20})
    check(case, config=small_config(query_tile=16, num_compute_wgs=2), sm_scale=0.125, tree_mask=mask)


@pytest.mark.interpret
@pytest.mark.parametrize("query_tile,wgs", [(8, 1), (16, 2)])
def test_trees_past_32_positions_in_several_words(query_tile, wgs):
    """Trees of 70 and 40 positions (3 mask words a token) beside a decode: keys at offsets
    32 to 95 are hidden by words 1 and 2."""
    rng = np.random.default_rng(23)
    big, middle = kary_tree(70, 2), kary_tree(40, 4)
    case = make_case(
        rng,
        [len(big), 1, len(middle)],
        [len(big) + 20, 90, len(middle) + 3],
        num_heads=16 if wgs == 2 else 6,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
        pad_tokens=2,
        dtype=jnp.bfloat16,
    )
    mask = batch_tree_mask(case, {0: big, 2: middle}, num_words=3)
    check(case, config=small_config(query_tile=query_tile, num_compute_wgs=wgs), sm_scale=0.125, tree_mask=mask)


# -- batch-invariant mode ------------------------------------------------------------
# A token's output must be bit for bit the same alone or in any batch. Shapes: GQA 3, 16-token
# pages, 64-key blocks and 2-block splits (128 keys), so short contexts are already split.

INV_SHAPE = dict(num_heads=6, num_kv_heads=2, head_dim=64)
INV_PAGE = 16


def invariant_config(case, tree_words=0):
    """What the engine picks for this bucket in batch-invariant mode, with short splits and
    few CTAs (quick to interpret)."""
    tokens, seqs = case.q.shape[0], len(case.kv_lens)
    config = mgpu.default_config(
        tokens, seqs, 6, 2, 64, INV_PAGE, num_ctas=4, tree_words=tree_words, batch_invariant=True
    )
    return dataclasses.replace(config, split_blocks=2)


def run_raw(case, **kwargs):
    """The kernel's own bf16 / f16 output in batch-invariant mode, for == comparisons."""
    interpret = None if ON_GPU else plgpu.InterpretGPUParams()
    config = invariant_config(case, tree_words=int(kwargs.get("tree_mask") is not None))
    out = mgpu.ragged_paged_attention(
        *(jnp.asarray(getattr(case, a)) for a in ARGS),
        config=config,
        batch_invariant=True,
        interpret=interpret,
        **kwargs,
    )
    return np.asarray(out)


def rows_of(out, case, index, seq):
    start = case.query_start_loc[index]
    return out[start : start + len(seq.q)]


decode_shape = st.tuples(st.just(1), st.integers(1, 400))  # (new tokens, context)
prefill_shape = st.integers(2, 24).flatmap(lambda q: st.tuples(st.just(q), st.integers(q, 300)))
sequence_shape = st.one_of(decode_shape, prefill_shape)


@pytest.mark.interpret
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from([jnp.bfloat16, jnp.float16]),
    target=sequence_shape,
    mates=st.lists(sequence_shape, min_size=1, max_size=4),
    where=st.integers(0, 4),
    pad_tokens=st.integers(0, 5),
    window=st.sampled_from([None, 100]),
    seed=st.integers(0, 2**16),
)
def test_batch_invariant_alone_or_in_any_batch(dtype, target, mates, where, pad_tokens, window, seed):
    """The target's rows are == alone and among random prefill / decode mates, at any place,
    in another token bucket (so other query tiles), with padding tokens."""
    rng = np.random.default_rng(seed)
    target = random_sequence(rng, *target, **INV_SHAPE, dtype=dtype)
    batch = [random_sequence(rng, *m, **INV_SHAPE, dtype=dtype) for m in mates]
    where = min(where, len(batch))
    batch.insert(where, target)
    kwargs = dict(sm_scale=0.125, sliding_window=window)
    alone = run_raw(pack_case(rng, [target], page_size=INV_PAGE), **kwargs)
    case = pack_case(rng, batch, page_size=INV_PAGE, pad_tokens=pad_tokens)
    assert np.array_equal(rows_of(run_raw(case, **kwargs), case, where, target), alone)


@pytest.mark.interpret
def test_batch_invariant_with_a_tree_in_the_step():
    """A draft tree's verification tokens and a decode token: alone (the decode without any
    tree mask) and in a step with another tree, a prefill chunk and decodes."""
    rng = np.random.default_rng(4)
    make = functools.partial(random_sequence, rng, **INV_SHAPE, dtype=jnp.bfloat16)
    verify, decode = make(len(BUSHY), 150), make(1, 200)
    words = np.array(tree_words(BUSHY), np.int32)
    verify_alone = run_raw(pack_case(rng, [verify], page_size=INV_PAGE), sm_scale=0.125, tree_mask=words)
    decode_alone = run_raw(pack_case(rng, [decode], page_size=INV_PAGE), sm_scale=0.125)
    batch = [make(13, 70), verify, make(1, 9), decode, make(len(CHAIN), 90)]
    case = pack_case(rng, batch, page_size=INV_PAGE, pad_tokens=2)
    got = run_raw(case, sm_scale=0.125, tree_mask=batch_tree_mask(case, {1: BUSHY, 4: CHAIN}))
    assert np.array_equal(rows_of(got, case, 1, verify), verify_alone)
    assert np.array_equal(rows_of(got, case, 3, decode), decode_alone)


@pytest.mark.interpret
def test_batch_invariant_prefill_chunks_and_decode_agree():
    """A 150-token prompt as one prefill chunk, as chunks of 64 and 86, and its last token
    as a lone decode: each token's rows are ==."""
    rng = np.random.default_rng(6)
    prompt = random_sequence(rng, 150, 150, **INV_SHAPE, dtype=jnp.bfloat16)

    def part(lo, hi):  # tokens [lo, hi) as a chunk over context [0, hi)
        return dataclasses.replace(prompt, q=prompt.q[lo:hi], k=prompt.k[:hi], v=prompt.v[:hi])

    def run(lo, hi):
        return run_raw(pack_case(rng, [part(lo, hi)], page_size=INV_PAGE, pad_tokens=1), sm_scale=0.125)[:-1]

    whole = run(0, 150)
    assert np.array_equal(np.concatenate([run(0, 64), run(64, 150)]), whole)
    assert np.array_equal(run(149, 150), whole[149:])


@pytest.mark.interpret
def test_batch_invariant_is_still_attention():
    """Against the float64 oracle and the reference: splits, window, soft-cap, padding."""
    rng = np.random.default_rng(12)
    case = make_case(
        rng,
        [13, 5, 1, 1, 3],
        [70, 350, 9, 64, 200],
        **INV_SHAPE,
        page_size=INV_PAGE,
        pad_tokens=3,
        pad_seqs=1,
        dtype=jnp.bfloat16,
    )
    check(case, config=invariant_config(case), sm_scale=0.125, sliding_window=150, soft_cap=3.0)


# -- plan and validation (no kernel) ------------------------------------------------


def test_batch_invariant_plan_cuts_the_context_at_fixed_blocks():
    """A decode at context 5000 alone and beside 7 others: the default plan splits it by the
    whole step's work (so its blocks part differently), the invariant one at multiples of c."""

    def target_items(config, batch):
        kv_lens = np.full(batch, 5000, np.int32)
        qsl = np.arange(batch + 1, dtype=np.int32)
        plan = mgpu.plan_work(kv_lens, qsl, num_tokens=batch, num_kv_heads=8, config=config, max_context=8192)
        work = np.asarray(plan.work)[: int(plan.num_items[0])]
        return [(lo, hi) for tile, _, lo, hi, *_ in work if tile == 0]

    default = mgpu.TuningConfig(num_ctas=132)
    assert target_items(default, 1) != target_items(default, 8)
    invariant = mgpu.default_config(1, 1, 32, 8, 128, 16, num_ctas=132, batch_invariant=True)
    c = invariant.split_blocks
    assert (
        target_items(invariant, 1)
        == target_items(invariant, 8)
        == [(lo, min(lo + c, -(-5000 // 64))) for lo in range(0, -(-5000 // 64), c)]
    )


def test_batch_invariant_plan_bound():
    """Each tile's blocks once, in items inside one fixed split each, listed in kv order; the
    static work list (tiles x max_splits) is exactly full in the worst case: every tile as
    long as the block tables allow."""
    config = mgpu.TuningConfig(block_kv=64, query_tile=8, split_blocks=3, batch_invariant=True)
    q_lens, kv_lens = np.array([8, 8, 8, 1, 1]), np.array([1000, 999, 513, 1000, 77])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    for window in (None, 200):

        def plan_for(config):
            plan = mgpu.plan_work(
                kv_lens, qsl, num_tokens=30, num_kv_heads=2, config=config, sliding_window=window, max_context=1000
            )
            return jax.tree.map(np.asarray, plan)

        plan, default = plan_for(config), plan_for(dataclasses.replace(config, batch_invariant=False))
        work, splits = plan.work[: int(plan.num_items[0])], plan.split_item.shape[1]
        assert splits == mgpu.max_splits(config, 1000, window) == (6 if window is None else 3)
        for tile, tile_items in enumerate(plan.split_item):
            items = [i for i in tile_items if i < len(plan.work)]
            assert all(work[i, 0] == tile and work[i, 2] // 3 == (work[i, 3] - 1) // 3 for i in items)
            blocks = [b for i in items for b in range(work[i, 2], work[i, 3])]
            # The blocks the default plan gives the tile (test_plan_covers_every_block_once), each once, in kv order.
            default_items = default.work[: int(default.num_items[0])]
            assert blocks == sorted(b for t, _, lo, hi, *_ in default_items if t == tile for b in range(lo, hi))
    # 4 sequences, 32 tokens: at most 7 tiles of 8 (1 + 1 + 1 + 4), each meeting 6 splits.
    qsl = np.array([0, 1, 2, 3, 32], np.int32)
    worst = mgpu.plan_work(np.full(4, 1000), qsl, num_tokens=32, num_kv_heads=2, config=config, max_context=1000)
    assert int(worst.num_items[0]) == len(worst.work) == 7 * 6


def test_batch_invariant_config_and_inputs():
    # One block_kv whatever the bucket, tree or kv dtype.
    blocks = {
        mgpu.default_config(t, s, 32, 8, 128, 16, kv_dtype=kv, tree_words=tree, batch_invariant=True).block_kv
        for t, s in [(1, 1), (64, 64), (2048, 4)]
        for kv in (None, jnp.int8)
        for tree in (0, 1, 3)
    }
    assert blocks == {64}
    with pytest.raises(ValueError, match="max_context"):
        mgpu.plan_work([5], [0, 1], num_tokens=1, num_kv_heads=1, config=mgpu.TuningConfig(batch_invariant=True))
    with pytest.raises(ValueError, match="split_blocks"):
        mgpu.TuningConfig(split_blocks=0)
    z = jnp.zeros
    args = (z((1, 8, 64), jnp.bfloat16), z((2, 16, 2, 64), jnp.bfloat16), z((2, 16, 2, 64), jnp.bfloat16))
    args += (jnp.ones(1, jnp.int32), z((1, 1), jnp.int32), jnp.array([0, 1], jnp.int32))
    with pytest.raises(ValueError, match="batch-invariant config"):
        mgpu.ragged_paged_attention(*args, sm_scale=1.0, config=mgpu.TuningConfig(), batch_invariant=True)


def test_plan_covers_every_block_once():
    rng = np.random.default_rng(2)
    q_lens, kv_lens = [37, 1, 1, 0, 9], [37, 5000, 300, 0, 40]
    case = make_case(rng, q_lens, kv_lens, num_heads=2, num_kv_heads=1, head_dim=8, page_size=16)
    config = mgpu.TuningConfig(block_kv=128, query_tile=8, num_ctas=16, min_split_blocks=1)
    plan = jax.tree.map(
        np.asarray,
        mgpu.plan_work(
            case.kv_lens, case.query_start_loc, num_tokens=48 + 2, num_kv_heads=1, config=config, sliding_window=1000
        ),
    )
    work = plan.work[: int(plan.num_items[0])]
    for tile in range(plan.tile_tokens.shape[0]):
        mine = work[plan.item_tile[: len(work)] == tile]
        tokens = plan.tile_tokens[tile][plan.tile_tokens[tile] < 50]
        if not len(tokens):
            assert not len(mine)
            continue
        seq = mine[0, 1]
        last_pos = kv_lens[seq] - q_lens[seq] + (tokens[-1] - case.query_start_loc[seq])
        first_key = max(0, last_pos - (len(tokens) - 1) - 1000 + 1)
        blocks = sorted(b for lo, hi in mine[:, 2:4] for b in range(lo, hi))
        assert blocks == list(range(first_key // 128, last_pos // 128 + 1)), tile
    # Every real token finds its own slot; padding tokens are marked.
    assert plan.token_valid[:48].all() and not plan.token_valid[48:].any()
    assert (plan.tile_tokens.reshape(-1)[plan.token_row[:48]] == np.arange(48)).all()


@pytest.mark.parametrize("batch,context", [(1, 32768), (8, 32768), (8, 2048), (64, 8192), (256, 512)])
def test_splits_balance_the_persistent_grid(batch, context):
    """Round-robin over 132 CTAs: the busiest CTA loads at most ~5% more blocks than average."""
    config = mgpu.TuningConfig(num_ctas=132)
    kv_lens = np.full(batch, context, np.int32)
    qsl = np.arange(batch + 1, dtype=np.int32)
    plan = jax.tree.map(np.asarray, mgpu.plan_work(kv_lens, qsl, num_tokens=batch, num_kv_heads=8, config=config))
    work = plan.work[: int(plan.num_items[0])]
    unit_blocks = np.repeat(work[:, 3] - work[:, 2], 8)  # (item, kv head) units, heads fastest
    per_cta = np.bincount(np.arange(len(unit_blocks)) % 132, weights=unit_blocks, minlength=132)
    assert unit_blocks.sum() == batch * 8 * (context // 128)
    assert per_cta.max() <= 1.05 * per_cta.mean() + 1, (per_cta.max(), per_cta.mean())


def test_unsupported_inputs_raise_clear_errors():
    q = jnp.zeros((4, 8, 64), jnp.float32)
    pages = jnp.zeros((4, 16, 2, 64), jnp.float32)
    assert "bf16" in mgpu.unsupported_reason(q, pages)
    with pytest.raises(NotImplementedError, match="bf16"):
        mgpu.ragged_paged_attention(
            q,
            pages,
            pages,
            jnp.ones(1, jnp.int32),
            jnp.zeros((1, 1), jnp.int32),
            jnp.array([0, 1], jnp.int32),
            sm_scale=1.0,
        )

    def bf(shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    assert "head_dim" in mgpu.unsupported_reason(bf((4, 8, 32)), bf((4, 16, 2, 32)))
    assert "page_size" in mgpu.unsupported_reason(bf((4, 8, 64)), bf((4, 12, 2, 64)))
    assert mgpu.is_supported(bf((4, 8, 128)), bf((4, 16, 2, 128)))
    with pytest.raises(ValueError, match="block_kv"):
        mgpu.TuningConfig(block_kv=96)
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        mgpu.TuningConfig(max_concurrent_steps=1)
    too_tall = mgpu.TuningConfig(query_tile=32, num_compute_wgs=1)
    assert "query rows" in mgpu.unsupported_reason(bf((4, 8, 64)), bf((4, 16, 2, 64)), config=too_tall)
    idle_wg = mgpu.TuningConfig(query_tile=4, num_compute_wgs=2)
    assert "idle" in mgpu.unsupported_reason(bf((4, 8, 64)), bf((4, 16, 2, 64)), config=idle_wg)
    too_deep = mgpu.TuningConfig(block_kv=256, max_concurrent_steps=4)
    assert "shared memory" in mgpu.unsupported_reason(bf((4, 8, 128)), bf((4, 16, 2, 128)), config=too_deep)


def test_8bit_cache_inputs_are_checked():
    sds = jax.ShapeDtypeStruct
    q, bf_pages = sds((4, 8, 128), jnp.bfloat16), sds((4, 16, 2, 128), jnp.bfloat16)
    fp8, i8 = sds((4, 16, 2, 128), jnp.float8_e4m3fn), sds((4, 16, 2, 128), jnp.int8)
    scales = sds((4, 2, 16), jnp.float32)
    for pages in (fp8, i8):
        assert mgpu.is_supported(q, pages, pages, k_scales=scales, v_scales=scales)
        assert mgpu.is_supported(sds(q.shape, jnp.float16), pages, pages, k_scales=scales, v_scales=scales)
        assert "need k_scales" in mgpu.unsupported_reason(q, pages, pages)
        assert "together" in mgpu.unsupported_reason(q, pages, pages, k_scales=scales)
        assert "q must be bf16" in mgpu.unsupported_reason(
            sds(q.shape, jnp.float32), pages, pages, k_scales=scales, v_scales=scales
        )
    assert "float8_e4m3fn or all int8" in mgpu.unsupported_reason(
        q, bf_pages, bf_pages, k_scales=scales, v_scales=scales
    )
    assert "float8_e4m3fn or all int8" in mgpu.unsupported_reason(q, fp8, i8, k_scales=scales, v_scales=scales)
    for bad in (sds((4, 16, 2), jnp.float32), sds((4, 2, 16), jnp.bfloat16), sds((3, 2, 16), jnp.float32)):
        assert "k_scales must be float32 (4, 2, 16)" in mgpu.unsupported_reason(
            q, fp8, fp8, k_scales=bad, v_scales=scales
        )
        assert "v_scales" in mgpu.unsupported_reason(q, fp8, fp8, k_scales=scales, v_scales=bad)
    with pytest.raises(NotImplementedError, match="need k_scales"):
        mgpu.ragged_paged_attention(
            jnp.zeros((4, 8, 64), jnp.bfloat16),
            jnp.zeros((4, 16, 2, 64), jnp.int8),
            jnp.zeros((4, 16, 2, 64), jnp.int8),
            jnp.ones(1, jnp.int32),
            jnp.zeros((1, 1), jnp.int32),
            jnp.array([0, 1], jnp.int32),
            sm_scale=1.0,
        )
    # The 8-bit ring costs half, the upcast buffers more: the config check knows which.
    deep = mgpu.TuningConfig(block_kv=128, max_concurrent_steps=4)
    assert "shared memory" in mgpu.unsupported_reason(q, bf_pages, config=deep)
    assert mgpu.is_supported(q, fp8, fp8, k_scales=scales, v_scales=scales, config=deep)


def test_tree_mask_input_is_checked():
    sds = jax.ShapeDtypeStruct
    q, pages = sds((4, 8, 64), jnp.bfloat16), sds((4, 16, 2, 64), jnp.bfloat16)
    assert mgpu.is_supported(q, pages, pages, tree_mask=sds((4,), jnp.int32))
    assert mgpu.is_supported(q, pages, pages, tree_mask=sds((4, 3), jnp.int32))  # 3 words a token
    for bad in (sds((4,), jnp.uint32), sds((5,), jnp.int32), sds((5, 2), jnp.int32), sds((4, 1, 1), jnp.int32)):
        assert "tree_mask must be int32 (4,)" in mgpu.unsupported_reason(q, pages, pages, tree_mask=bad)
    # The words' buffer counts against shared memory.
    config = mgpu.TuningConfig(block_kv=128, max_concurrent_steps=2)
    assert config.smem_bytes(64, tree_words=1) == config.smem_bytes(64) + 1024  # int32 [2, 1, 1, 64], 1 KiB aligned
    assert config.smem_bytes(64, tree_words=4) == config.smem_bytes(64) + 2048  # int32 [2, 1, 4, 64]


# -- 2. lowered for an H100 / H200 at production shapes ----------------------------
# (the shapes live in benchmarks/mosaic_lowering.py: the sm_90a compile report uses them too)


@pytest.mark.parametrize(
    "name,tokens,seqs,context,page_size,head_dim,window,soft_cap",
    ATTENTION_PRODUCTION,
    ids=[p[0] for p in ATTENTION_PRODUCTION],
)
def test_lowers_for_hopper(name, tokens, seqs, context, page_size, head_dim, window, soft_cap):
    exported, config, smem = lower_attention(tokens, seqs, context, page_size, head_dim, window, soft_cap)
    assert exported.platforms == ("cuda",)
    assert "mosaic_gpu" in exported.mlir_module()
    if smem:  # the hook exists in jax 0.11.2 and 0.12
        assert smem == [config.smem_bytes(head_dim)], (smem, config)
        assert smem[0] <= mgpu.SMEM_BYTES


@pytest.mark.parametrize("kv8", ["fp8", "int8"])
@pytest.mark.parametrize(
    "name,tokens,seqs,context,page_size,head_dim,window,soft_cap", KV8_PRODUCTION, ids=[p[0] for p in KV8_PRODUCTION]
)
def test_8bit_cache_lowers_for_hopper(name, tokens, seqs, context, page_size, head_dim, window, soft_cap, kv8):
    exported, config, smem = lower_attention(
        tokens, seqs, context, page_size, head_dim, window, soft_cap, kv_dtype=KV8[kv8]
    )
    assert "mosaic_gpu" in exported.mlir_module()
    if smem:
        assert smem == [config.smem_bytes(head_dim, 2, 1)], (smem, config)
        assert smem[0] <= mgpu.SMEM_BYTES


@pytest.mark.parametrize(
    "name,tokens,seqs,context,page_size,head_dim,window,soft_cap,kv8,words",
    TREE_PRODUCTION,
    ids=[p[0] for p in TREE_PRODUCTION],
)
def test_tree_mask_lowers_for_hopper(name, tokens, seqs, context, page_size, head_dim, window, soft_cap, kv8, words):
    kv_dtype = KV8[kv8] if kv8 else None
    exported, config, smem = lower_attention(
        tokens, seqs, context, page_size, head_dim, window, soft_cap, kv_dtype=kv_dtype, tree_words=words
    )
    assert "mosaic_gpu" in exported.mlir_module()
    if smem:
        assert smem == [config.smem_bytes(head_dim, 2, 1 if kv8 else 2, tree_words=words)], (smem, config)
        assert smem[0] <= mgpu.SMEM_BYTES


@pytest.mark.parametrize(
    "name,tokens,seqs,heads,kv_heads,head_dim", OTHER_HEAD_GROUPINGS, ids=[m[0] for m in OTHER_HEAD_GROUPINGS]
)
def test_lowers_other_head_groupings(name, tokens, seqs, heads, kv_heads, head_dim):
    _, config, smem = lower_attention(
        tokens, seqs, 8192, 16, head_dim, None, None, num_heads=heads, num_kv_heads=kv_heads
    )
    assert config.query_tile * heads // kv_heads <= 64 * config.num_compute_wgs
    if smem:
        assert smem == [config.smem_bytes(head_dim)]


@pytest.mark.parametrize(
    "tokens,seqs,context,heads,kv_heads,head_dim", [(64, 64, 8192, 9, 3, 64), (8192, 4, 32768, 32, 8, 128)]
)
def test_batch_invariant_lowers_for_hopper(tokens, seqs, context, heads, kv_heads, head_dim):
    """SmolLM2's decode bucket and a long prefill (two compute warpgroups) at 64-key blocks."""
    _, config, smem = lower_attention(
        tokens, seqs, context, 16, head_dim, None, None, num_heads=heads, num_kv_heads=kv_heads, batch_invariant=True
    )
    assert config.batch_invariant and config.block_kv == 64
    if smem:
        assert smem == [config.smem_bytes(head_dim)]


@pytest.mark.parametrize("p_via_smem", [False, True])
@pytest.mark.parametrize("block_kv,steps,wgs", [(64, 4, 1), (128, 2, 2), (256, 2, 1)])
def test_lowers_other_configs(p_via_smem, block_kv, steps, wgs):
    config = mgpu.TuningConfig(
        block_kv=block_kv,
        max_concurrent_steps=steps,
        num_compute_wgs=wgs,
        query_tile=32 if wgs == 2 else 1,
        p_via_smem=p_via_smem,
    )
    if config.smem_bytes(128) > mgpu.SMEM_BYTES:
        with pytest.raises(NotImplementedError, match="shared memory"):
            lower_attention(64, 4, 4096, 16, 128, None, None, config=config)
        return
    _, _, smem = lower_attention(64, 4, 4096, 16, 128, 512, 20.0, config=config)
    if smem:
        assert smem == [config.smem_bytes(128)]


def test_shared_memory_overflow_is_caught_when_lowering(monkeypatch):
    """A config past 227 KiB fails at lowering, not on the GPU (shown with our own check off)."""
    config = mgpu.TuningConfig(block_kv=256, max_concurrent_steps=3)
    assert config.smem_bytes(128) > mgpu.SMEM_BYTES
    monkeypatch.setattr(mgpu, "unsupported_reason", lambda *args, **kwargs: None)
    with pytest.raises(Exception, match="shared memory"):
        lower_attention(8, 8, 4096, 16, 128, None, None, config=config)


# -- production shapes on a real GPU (JAXSERVE_MGPU_ON_GPU=1) ------------------------

GPU_CASES = [
    ("decode_b1_32k", [1], [32768], None, None),
    ("decode_b8_mixed_lengths", [1] * 8, [1, 17, 300, 2048, 4095, 4096, 9000, 32768], None, None),
    ("decode_b64_window_cap", [1] * 64, list(range(100, 64 * 1000, 1000)), 4096, 30.0),
    ("mixed_prefill_decode", [512, 100, 1, 1, 4], [512, 3000, 7000, 16, 8000], None, None),
    ("prefill_chunk_window", [1024, 300], [5000, 300], 1024, 20.0),
]


@pytest.mark.skipif(not ON_GPU, reason="production shapes need a GPU (set JAXSERVE_MGPU_ON_GPU=1)")
@pytest.mark.parametrize("kv8", ["fp8", "int8"])
@pytest.mark.parametrize("name,q_lens,kv_lens,window,soft_cap", GPU_CASES[1:4], ids=[c[0] for c in GPU_CASES[1:4]])
def test_8bit_cache_production_shapes_on_gpu(name, q_lens, kv_lens, window, soft_cap, kv8):
    """An 8-bit cache at production shapes vs the reference on the dequantized pages."""
    rng = np.random.default_rng(len(name))
    case = make_case(
        rng,
        q_lens,
        kv_lens,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        pad_tokens=3,
        pad_seqs=1,
        dtype=jnp.bfloat16,
    )
    quantized, dequantized = quantize_case(case, KV8[kv8], rng)
    tokens, seqs = case.q.shape[0], len(case.kv_lens)
    config = mgpu.default_config(tokens, seqs, 32, 8, 128, 16, kv_dtype=KV8[kv8])
    kwargs = dict(sm_scale=128**-0.5, sliding_window=window, soft_cap=soft_cap)
    got = run_kernel(quantized, config=config, **kwargs)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, run_reference(dequantized, **kwargs), **BF16_TOL)
    assert not got[case.num_real_tokens :].any()


@pytest.mark.skipif(not ON_GPU, reason="production shapes need a GPU (set JAXSERVE_MGPU_ON_GPU=1)")
@pytest.mark.parametrize("p_via_smem", [False, True])
@pytest.mark.parametrize("name,q_lens,kv_lens,window,soft_cap", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_production_shapes_on_gpu(name, q_lens, kv_lens, window, soft_cap, p_via_smem):
    rng = np.random.default_rng(len(name))
    case = make_case(
        rng,
        q_lens,
        kv_lens,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        pad_tokens=3,
        pad_seqs=1,
        dtype=jnp.bfloat16,
    )
    tokens, seqs = case.q.shape[0], len(case.kv_lens)
    config = dataclasses.replace(mgpu.default_config(tokens, seqs, 32, 8, 128, 16), p_via_smem=p_via_smem)
    kwargs = dict(sm_scale=128**-0.5, sliding_window=window, soft_cap=soft_cap)
    got = run_kernel(case, config=config, **kwargs)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, run_reference(case, **kwargs), **BF16_TOL)
    assert not got[case.num_real_tokens :].any()


@pytest.mark.skipif(not ON_GPU, reason="production shapes need a GPU (set JAXSERVE_MGPU_ON_GPU=1)")
@pytest.mark.parametrize("window,soft_cap", [(None, None), (1024, 30.0)])
def test_tree_verification_production_shapes_on_gpu(window, soft_cap):
    """A prefill chunk, decodes and ten draft trees (chains, 2- to 4-ary, 8 to 127 positions:
    four mask words a token)."""
    rng = np.random.default_rng(17)
    shapes = [(16, 1), (16, 2), (16, 3), (16, 4), (32, 2), (31, 3), (8, 2), (24, 4), (64, 2), (127, 3)]
    trees = [kary_tree(n, k) for n, k in shapes]
    q_lens = [512, 1, 1, 1, 1] + [len(t) for t in trees]
    contexts = [0, 63, 1000, 4090, 8000, 20000, 5, 777, 3000, 12]  # before each tree's new tokens
    kv_lens = [3000, 100, 4096, 9000, 17] + [c + len(t) for c, t in zip(contexts, trees)]
    case = make_case(
        rng,
        q_lens,
        kv_lens,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        pad_tokens=3,
        pad_seqs=1,
        dtype=jnp.bfloat16,
    )
    mask = batch_tree_mask(case, {5 + i: t for i, t in enumerate(trees)}, num_words=4)
    tokens, seqs = case.q.shape[0], len(case.kv_lens)
    config = mgpu.default_config(tokens, seqs, 32, 8, 128, 16, tree_words=4)
    kwargs = dict(sm_scale=128**-0.5, sliding_window=window, soft_cap=soft_cap, tree_mask=mask)
    got = run_kernel(case, config=config, **kwargs)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, run_reference(case, **kwargs), **BF16_TOL)
    assert not got[case.num_real_tokens :].any()


def test_kernel_runs_per_device_under_tensor_parallelism():
    """The engine's tensor-parallel wrapper (jax.shard_map over KV heads) around the kernel,
    one device's share at a time: device d's query heads and KV head d through the wrapper
    give the unsplit reference's heads for d. The split itself (specs across several devices)
    is checked with the reference attention in tests/jaxserve/parallel/test_tensor_parallel.py.

    NOTE: the interpreter cannot run the kernel on two devices at once: after each device's
    grid it asserts that no barrier is allocated in the memory shared by all devices, with no
    device barrier before the check, so it fails when the other device is mid-kernel (jax
    0.12, mosaic_gpu/interpret/interpret_pallas_call.py). Hence one device, one share per call."""
    from jaxserve.parallel.sharding import make_mesh, shard_attention

    tp, num_heads, num_kv_heads = 2, 8, 2
    rng = np.random.default_rng(7)
    case = make_case(
        rng,
        [9, 1, 1],
        [40, 70, 9],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        page_size=8,
        pad_tokens=2,
        dtype=jnp.bfloat16,
    )
    interpret = None if ON_GPU else plgpu.InterpretGPUParams(detect_races=True)
    kernel = functools.partial(mgpu.ragged_paged_attention, config=small_config(), interpret=interpret)
    sharded = jax.jit(functools.partial(shard_attention(kernel, make_mesh(1)), sm_scale=0.125))
    want = run_reference(case, sm_scale=0.125)
    heads, kv_heads = num_heads // tp, num_kv_heads // tp
    for d in range(tp):
        share = dict(
            q=case.q[:, d * heads : (d + 1) * heads],
            k_pages=case.k_pages[:, :, d * kv_heads : (d + 1) * kv_heads],
            v_pages=case.v_pages[:, :, d * kv_heads : (d + 1) * kv_heads],
        )
        got = sharded(*(jnp.asarray(share.get(a, getattr(case, a))) for a in ARGS))
        np.testing.assert_allclose(
            np.asarray(got.astype(jnp.float32), np.float64), want[:, d * heads : (d + 1) * heads], **BF16_TOL
        )
