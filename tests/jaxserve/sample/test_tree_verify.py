"""Tree verification (`jaxserve.sample.tree_verify.verify_tree`) and its static tree
(`scheduler.draft_tree.DraftTree`) against math they do not implement.

The main test simulates generation as test_rejection_sampler.py does, with a tree of
drafts in each step: the synthetic Markov target of tests/sampling_oracle.py, children
that are the draft model's top tokens (point masses) or drawn from it without replacement
(EAGLE's way), trees pruned per stream and step; the joint law of the first three tokens
must be the target's (chi-square), and deliberately wrong rules must fail the same test.
The others compare with NumPy statements of the rules: greedy rows' longest path of
argmaxes, the chain tree against `rejection_sampler.verify`, draws that match
`sampler.sample`'s, logprobs.

Layout: row r * (N + 1) + i of the logits and the metadata is request r's tree position
i, sampling output token `output_index + depth(i)` after the path to i.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.sample import tree_verify
from jaxserve.sample.rejection_sampler import verify
from jaxserve.sample.sampler import MAX_LOGPROBS, sample
from jaxserve.sample.tree_verify import verify_tree
from scheduler.draft_tree import DraftTree
from tests.sampling_oracle import (
    DRAFT,
    IGNORED_POSITION,
    LENGTH,
    PROMPT,
    SETTINGS,
    STOP,
    TARGET,
    Setting,
    V,
    draw,
    goodness_of_fit,
    log_softmax,
    meta,
    seed_words,
    table_rows,
)

verify_tree_jit = jax.jit(verify_tree, static_argnames="tree")
verify_jit = jax.jit(verify)
sample_jit = jax.jit(sample)

TREE = DraftTree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1)])  # 3 siblings, then 2


# --------------------------------------------------------------------------------------
# The static tree
# --------------------------------------------------------------------------------------


def test_positions_parents_depths_and_masks_by_hand():
    """            0
                 /   \\
                1     2           (0,)   (1,)
               / \\     \\
              3   4     5         (0, 0) (0, 1) (1, 0)"""
    tree = DraftTree.from_choices([[1, 0], [0, 1], [1], [0, 0], [0]])  # any order, lists as from JSON
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert (tree.num_nodes, tree.max_depth) == (5, 2)
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.rank.tolist() == [0, 0, 1, 0, 1, 0]
    assert tree.children == ((1, 2), (3, 4), (5,), (), (), ())
    assert tree.ancestor_mask.tolist() == [[0b1], [0b11], [0b101], [0b1011], [0b10011], [0b100101]]
    assert all(a.dtype == np.int32 for a in (tree.parent, tree.depth, tree.rank, tree.ancestor_mask))
    # A jit static argument: equal and hashed by its paths.
    same = DraftTree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    assert tree == same and hash(tree) == hash(same) and tree != DraftTree.chain(2)

    chain = DraftTree.chain(31)  # the largest tree of one word: bit 31 is the int32 sign bit
    assert chain.parent.tolist() == [-1] + list(range(31))
    assert chain.mask_words == 1 and chain.ancestor_mask[-1, 0] == -1 and chain.ancestor_mask[3, 0] == 0b1111

    # Past 32 positions, bit j lies in word j // 32; the oracle: sets of ancestors walked up
    # the parents, one position at a time.
    big = DraftTree.from_choices(
        [(r,) for r in range(3)] + [(r, s) for r in range(3) for s in range(3)] + [(0, 0, t) for t in range(50)]
    )
    assert (big.num_nodes, big.mask_words) == (62, 2)
    for i in range(big.num_nodes + 1):
        seen, j = set(), i
        while j >= 0:
            seen.add(j)
            j = big.parent[j]
        bits = {32 * w + b for w in range(2) for b in range(32) if int(big.ancestor_mask[i, w]) >> b & 1}
        assert bits == seen, i
    assert DraftTree.chain(127).mask_words == 4


@pytest.mark.parametrize(
    "choices, message",
    [
        ([], "at least one node"),
        ([(0,), (0,)], "duplicate"),
        ([(0,), (0, 1, 0)], "no parent"),
        ([(1,)], "ranks"),
        ([(0,), (2,)], "ranks"),
        ([(0,), (-1,)], "ranks"),
        ([(0,) * d for d in range(1, 129)], "at most 127"),
        ([(0.0,)], "int"),
        ([("0",)], "int"),
        ([(True,)], "int"),
        ([0, 1], "int"),
        ([(), (0,)], "root"),
    ],
)
def test_malformed_trees_are_refused(choices, message):
    with pytest.raises(ValueError, match=message):
        DraftTree.from_choices(choices)


# --------------------------------------------------------------------------------------
# The distribution of generated tokens
# --------------------------------------------------------------------------------------

NUM_STREAMS = 30_000
# How many children of each depth's nodes a stream keeps in a step: pruning drops a node's
# last siblings with their subtrees (as a tree drawn without replacement must be pruned).
PRUNING = np.array([[3, 2], [3, 2], [1, 2], [2, 1], [3, 0], [0, 0]])


def pruned(tree: DraftTree, keep: np.ndarray) -> np.ndarray:
    """valid [n, N+1]: nodes whose rank is below `keep[:, depth - 1]`, and their ancestors'."""
    valid = np.ones((len(keep), tree.num_nodes + 1), bool)
    for i in range(1, tree.num_nodes + 1):
        valid[:, i] = valid[:, tree.parent[i]] & (tree.rank[i] < keep[:, tree.depth[i] - 1])
    return valid


def propose(tree: DraftTree, tokens, count, drafts: str, rng):
    """Draft tokens at every position, parents first: the children of a position are the
    draft model's top tokens after the path to it ('fixed': point masses) or drawn from it
    without replacement ('model'). Returns each position's context [n, N+1, W] and length
    [n, N+1], draft_ids [n, N+1] and draft_probs [n, N+1, V]."""
    n, positions = len(tokens), tree.num_nodes + 1
    rows = np.arange(n)
    context = np.repeat(tokens[:, None, :], positions, axis=1)
    lengths = count[:, None] + tree.depth[None, :]
    draft_ids = np.zeros((n, positions), np.int64)
    draft_probs = np.zeros((n, positions, V), np.float32)
    for a, kids in enumerate(tree.children):
        if not kids:
            continue
        q = table_rows(DRAFT, context[:, a], lengths[:, a])
        draft_probs[:, a] = q
        if drafts == "fixed":
            chosen = np.argsort(-q, axis=-1, kind="stable")[:, : len(kids)].T
        else:
            left, chosen = q.copy(), []
            for _ in kids:
                chosen.append(draw(left / left.sum(-1, keepdims=True), rng))
                left[rows, chosen[-1]] = 0.0
        for child, token in zip(kids, chosen):
            draft_ids[:, child] = token
            context[:, child] = context[:, a]
            context[rows, child, lengths[:, a]] = token
    return context, lengths, draft_ids, draft_probs


def check_path(tree: DraftTree, out, draft_ids, valid) -> None:
    """The accepted path runs from the root through valid children, and its tokens are theirs."""
    tokens, num, path = np.asarray(out.token_ids), np.asarray(out.num_tokens), np.asarray(out.path)
    rows = np.arange(len(num))
    assert ((1 <= num) & (num <= tree.max_depth + 1)).all() and (path[:, 0] == 0).all()
    assert (tree.depth[path[:, -1]] == num - 1).all()
    for k in range(tree.max_depth):
        step = k < num - 1
        child = path[step, k + 1]
        assert (tree.parent[child] == path[step, k]).all() and valid[rows[step], child].all()
        np.testing.assert_array_equal(tokens[step, k], draft_ids[rows[step], child])
        assert (path[~step, k + 1] == path[~step, k]).all(), "past the path, its end repeats"


def generate(setting: Setting, drafts: str, told: str, verify_fn=verify_tree_jit, tree=TREE) -> np.ndarray:
    """LENGTH tokens for each of NUM_STREAMS streams, by repeated tree verify steps;
    `told`: 'q' (the draft distributions) or 'nothing' (point masses). [NUM_STREAMS, LENGTH]"""
    rng = np.random.default_rng(0)
    n, positions = NUM_STREAMS, tree.num_nodes + 1
    rows = np.arange(n)
    tokens = np.zeros((n, LENGTH + 2 * tree.max_depth + 1), np.int64)  # emitted (then this step's drafts)
    count = np.zeros(n, np.int64)
    seeds = seed_words(rows.astype(np.uint64) * np.uint64(104729) + np.uint64(1 << 40))
    sample_index = (rows % 3).astype(np.int32)
    for step in range(LENGTH):
        valid = pruned(tree, PRUNING[(rows + step) % len(PRUNING)])
        context, lengths, draft_ids, draft_probs = propose(tree, tokens, count, drafts, rng)
        logits = np.zeros((n, positions, V), np.float32)
        for i in range(positions):
            logits[:, i] = np.where(
                valid[:, i, None], table_rows(TARGET, context[:, i], lengths[:, i]), IGNORED_POSITION
            )
        output_index = lengths.reshape(-1)
        fields = dict(
            temperature=setting.temperature,
            top_k=setting.top_k,
            seeds=np.repeat(seeds, positions, axis=0),
            sample_index=np.repeat(sample_index, positions),
            output_index=output_index,
            ban=output_index < setting.min_tokens,
            banned_token_ids=np.full((n * positions, 4), STOP),
        )
        if setting.penalties:
            history = np.concatenate([np.tile(PROMPT, (n * positions, 1)), context.reshape(n * positions, -1)], 1)
            fields.update(
                presence_penalty=setting.presence,
                frequency_penalty=setting.frequency,
                repetition_penalty=setting.repetition,
                history=history,
                history_lens=len(PROMPT) + output_index,
                prompt_lens=np.full(n * positions, len(PROMPT)),
            )
        out = verify_fn(
            logits.reshape(n * positions, V),
            meta(n * positions, **fields),
            tree,
            draft_ids.astype(np.int32),
            valid,
            draft_probs if told == "q" else None,
        )
        check_path(tree, out, draft_ids, valid)
        emitted, num = np.asarray(out.token_ids), np.asarray(out.num_tokens)
        for j in range(tree.max_depth + 1):
            writes = (count < LENGTH) & (j < num)
            tokens[rows[writes], count[writes] + j] = emitted[writes, j]
        count = np.where(count < LENGTH, count + num, count)
        if (count >= LENGTH).all():
            return tokens[:, :LENGTH]
    raise AssertionError("every step emits at least one token")


@pytest.mark.parametrize("drafts, told", [("model", "q"), ("fixed", "nothing")])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_generated_tokens_follow_the_target_distribution(name, drafts, told):
    """Siblings drawn without replacement from the draft model (verify told q) or its top
    tokens (point masses): either way exactly the target's distribution."""
    result = goodness_of_fit(generate(SETTINGS[name], drafts, told), SETTINGS[name])
    assert result.impossible == 0, "a token the target gives no probability was emitted"
    assert result.p_pairs > 1e-3 and result.p_triples > 1e-3, result


def test_siblings_drawn_without_replacement_verified_as_point_masses_are_exact():
    """Point-mass verification does not care where the candidates came from (they do not
    depend on the verifier's random numbers): exact, only accepting less."""
    setting = SETTINGS["temperature-top-k"]
    result = goodness_of_fit(generate(setting, "model", "nothing"), setting)
    assert result.impossible == 0
    assert result.p_pairs > 1e-3 and result.p_triples > 1e-3, result


def drawing_from_p_after_a_rejection(logits, meta, tree, draft_ids, valid, draft_probs=None):
    """Wrong: the path is verify_tree's, but the last token is drawn from the target at its
    end, residual or not."""
    out = verify_tree(logits, meta, tree, draft_ids, valid, draft_probs)
    from_p = sample(logits, meta).token_ids.reshape(draft_ids.shape)  # independent of acceptance
    rows = jax.numpy.arange(draft_ids.shape[0])
    last = from_p[rows, out.path[:, -1]]
    steps = jax.numpy.arange(tree.max_depth + 1)[None, :]
    return dataclasses.replace(
        out, token_ids=jax.numpy.where(steps < out.num_tokens[:, None] - 1, out.token_ids, last[:, None])
    )


def keeping_rejected_siblings_in_q(monkeypatch):
    """Wrong for siblings drawn without replacement: each is tested as if drawn from the
    whole q (SpecInfer's rule for i.i.d. siblings)."""
    test = tree_verify._sibling_test

    def iid_test(p, q, token, u):
        accept, p_next, _ = test(p, q, token, u)
        return accept, p_next, q

    monkeypatch.setattr(tree_verify, "_sibling_test", iid_test)
    return jax.jit(lambda *args: verify_tree(*args), static_argnums=2)  # a fresh trace, patched


@pytest.mark.parametrize("wrong", ["no residual", "rejected siblings kept in q"])
def test_the_distribution_test_fails_wrong_rules(wrong, monkeypatch):
    if wrong == "no residual":
        verify_fn = jax.jit(drawing_from_p_after_a_rejection, static_argnames="tree")
    else:
        verify_fn = keeping_rejected_siblings_in_q(monkeypatch)
    result = goodness_of_fit(generate(SETTINGS["plain"], "model", "q", verify_fn), SETTINGS["plain"])
    assert result.p_pairs < 1e-6, result


# --------------------------------------------------------------------------------------
# The rules one by one, against NumPy
# --------------------------------------------------------------------------------------

R, V_ = 2000, 24
WIDE = DraftTree.from_choices(
    [
        (0,),
        (1,),
        (2,),
        (3,),
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (2, 0),
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 0),
        (0, 0, 0, 0),
        (0, 0, 0, 1),
    ]
)


def random_case(tree: DraftTree, seed: int, keep: float = 0.85):
    """Logits [R*(N+1), V_]; nodes kept with probability `keep` (with their ancestors);
    drafts mostly equal to the argmax at their parent, so that long paths are accepted
    (and siblings sometimes repeat a token)."""
    rng = np.random.default_rng(seed)
    positions = tree.num_nodes + 1
    logits = rng.normal(0, 1.5, (R * positions, V_)).astype(np.float32)
    best = logits.reshape(R, positions, V_).argmax(-1)
    valid = np.ones((R, positions), bool)
    draft_ids = np.zeros((R, positions), np.int32)
    for i in range(1, positions):
        valid[:, i] = valid[:, tree.parent[i]] & (rng.random(R) < keep)
        draft_ids[:, i] = np.where(rng.random(R) < 0.7, best[:, tree.parent[i]], rng.integers(0, V_, R))
    return rng, logits, draft_ids, valid


def greedy_oracle(tree: DraftTree, best, draft_ids, valid) -> list[list[int]]:
    """Of the paths from the root whose drafts all equal the argmax at their parent, the
    longest (the first in BFS order among equally long ones). Each request's path."""
    paths = []
    for r in range(len(best)):
        matching = {0: [0]}
        for i in range(1, tree.num_nodes + 1):
            a = int(tree.parent[i])
            if a in matching and valid[r, i] and draft_ids[r, i] == best[r, a]:
                matching[i] = matching[a] + [i]
        paths.append(max(matching.values(), key=len))  # max keeps the first of the longest
    return paths


def per_position(values, tree: DraftTree) -> np.ndarray:
    return np.repeat(np.asarray(values), tree.num_nodes + 1, axis=0)


@pytest.mark.parametrize("tree", [TREE, WIDE], ids=["3-2", "wide"])
def test_greedy_rows_accept_the_longest_path_of_argmaxes(tree):
    """Siblings often repeat a token here (drafts are mostly their parent's argmax), so the
    longest path is not always the first match's."""
    _, logits, draft_ids, valid = random_case(tree, seed=tree.num_nodes)
    best = logits.reshape(R, tree.num_nodes + 1, V_).argmax(-1)
    paths = greedy_oracle(tree, best, draft_ids, valid)
    assert {len(p) for p in paths} == set(range(1, tree.max_depth + 2)), "every path length occurs"
    greedy = meta(R * (tree.num_nodes + 1), temperature=0.0)

    def check(out, requests):
        check_path(tree, out, draft_ids, valid)
        tokens, num, path = np.asarray(out.token_ids), np.asarray(out.num_tokens), np.asarray(out.path)
        for r in requests:
            assert path[r, : num[r]].tolist() == paths[r], (r, path[r], paths[r])
            assert tokens[r, num[r] - 1] == best[r, paths[r][-1]]

    check(verify_tree_jit(logits, greedy, tree, draft_ids, valid), range(R))
    # Mixed with sampled rows (every other request): the greedy rows' result is unchanged.
    mixed = meta(
        R * (tree.num_nodes + 1), temperature=per_position(np.arange(R) % 2, tree), output_index=np.tile(tree.depth, R)
    )
    out = verify_tree_jit(logits, mixed, tree, draft_ids, valid)
    check(out, range(0, R, 2))
    differs = [np.asarray(out.path)[r, : len(paths[r])].tolist() != paths[r] for r in range(1, R, 2)]
    assert np.mean(differs) > 0.2, "the sampled rows were not sampled"


def test_a_chain_verifies_as_verify_does():
    """DraftTree.chain(k): greedy rows and point-mass drafts give `verify`'s tokens and logprobs."""
    k = 3
    tree = DraftTree.chain(k)
    _, logits, draft_ids, valid = random_case(tree, seed=5, keep=0.8)
    num_drafts = valid.sum(-1).astype(np.int32) - 1
    fields = dict(temperature=0.0, want_logprobs=np.bool_(True), output_index=np.tile(np.arange(k + 1), R))
    want = verify_jit(logits, meta(R * (k + 1), **fields), draft_ids[:, 1:], num_drafts)
    out = verify_tree_jit(logits, meta(R * (k + 1), **fields), tree, draft_ids, valid)
    num = np.asarray(want.num_tokens)
    assert set(num) == set(range(1, k + 2))
    np.testing.assert_array_equal(np.asarray(out.num_tokens), num)
    emitted = np.arange(k + 1)[None, :] < num[:, None]
    for name in ("token_ids", "top_logprob_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(out, name))[emitted], np.asarray(getattr(want, name))[emitted])
    for name in ("logprobs", "top_logprobs"):
        np.testing.assert_allclose(
            np.asarray(getattr(out, name))[emitted], np.asarray(getattr(want, name))[emitted], atol=1e-6
        )


def test_draws_without_a_rejection_are_the_samplers_and_logprobs_are_raw():
    """Where a row ends without rejecting a candidate (no valid children there), its token
    is what `sampler.sample` draws from that row: same seed, same output index. Logprobs:
    the raw log_softmax at the position each token was drawn from. Same seeds, same result."""
    tree = WIDE
    positions = tree.num_nodes + 1
    rng, logits, draft_ids, valid = random_case(tree, seed=6, keep=0.6)
    kind = per_position(np.arange(R) % 4, tree)  # greedy, plain, top-k, top-p
    fields = dict(
        temperature=np.array([0.0, 1.0, 0.8, 1.3])[kind],
        top_k=np.array([0, 0, 3, 0])[kind],
        top_p=np.array([1, 1, 1, 0.7])[kind],
        seeds=per_position(seed_words(rng.integers(0, 2**63, R)), tree),
        sample_index=per_position(rng.integers(0, 4, R), tree),
        output_index=np.tile(tree.depth, R) + 5,
    )
    out = verify_tree_jit(logits, meta(R * positions, want_logprobs=np.bool_(True), **fields), tree, draft_ids, valid)
    check_path(tree, out, draft_ids, valid)
    tokens, num, path = np.asarray(out.token_ids), np.asarray(out.num_tokens), np.asarray(out.path)
    rows = np.arange(R)
    end = path[:, -1]
    leaf = ~np.array([valid[r, list(tree.children[end[r]])].any() for r in rows])
    plain = np.asarray(sample_jit(logits, meta(R * positions, **fields)).token_ids).reshape(R, positions)
    np.testing.assert_array_equal(tokens[rows, num - 1][leaf], plain[rows, end][leaf])
    assert leaf.sum() > R // 4 and (~leaf).sum() > R // 8 and (leaf & (end > 0)).sum() > R // 10

    raw = log_softmax(logits).reshape(R, positions, V_)[rows[:, None], path]  # [R, D+1, V_]
    emitted = np.arange(tree.max_depth + 1)[None, :] < num[:, None]
    want = np.take_along_axis(raw, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs)[emitted], want[emitted], atol=2e-5)
    width = min(MAX_LOGPROBS, V_)
    top = np.argsort(-raw, axis=-1, kind="stable")[..., :width]
    np.testing.assert_array_equal(np.asarray(out.top_logprob_ids)[emitted], top[emitted])

    again = verify_tree_jit(logits, meta(R * positions, **fields), tree, draft_ids, valid)
    np.testing.assert_array_equal(np.asarray(again.token_ids), tokens)
    np.testing.assert_array_equal(np.asarray(again.path), path)
