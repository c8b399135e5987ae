"""Speculating with a tree of candidates must not change greedy output, token for token.

The oracle is the workload run without speculation (tests/jaxserve/spec_decode/test_spec_decode.py's).
A tree proposer knows the true greedy continuation and hides it on one branch per step:
at each depth, the true token is at a sibling rank that changes from step to step, the
other siblings are wrong, and now and then no sibling is right. So every run accepts
paths that are not the first branch (the attention mask, the positions by depth and the
accepted K/V moved into place must all be right for later tokens to match) and rejects
others, and the accepted count is known in advance.
"""

import pytest

from jaxserve.spec_decode.proposers import decoding
from scheduler.draft_tree import DraftTree
from tests.jaxserve.spec_decode.test_spec_decode import VOCAB, OracleProposer, engine, run, tokens, workload

CHOICES = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)]
TREE = DraftTree.from_choices(CHOICES)
SPEC = {"method": "medusa", "model": "unused: the oracle below proposes", "speculative_token_tree": str(CHOICES)}


class TreeOracleProposer(OracleProposer):
    """OracleProposer's bookkeeping; a tree of drafts instead of a chain."""

    def __init__(self, truth: dict[tuple, list[int]], tree: DraftTree = TREE):
        super().__init__(None, truth)  # the engine's config is set when it builds the proposer
        self.tree = tree

    def propose(self, running):
        for req in decoding(running, self.config):
            self.calls += 1
            done = req.num_output_tokens
            truth = self.truth[tuple(req.prompt_token_ids)][done:]
            drafts, on_true_path, node = [], {0: True}, 0
            # Walk the true branch: at depth d the true child is the one of rank (done + d) % siblings,
            # unless this step hides it (then no child at that depth is right).
            true_child = {}
            tree = self.tree
            for d in range(tree.max_depth):
                kids = tree.children[node]
                if not kids or d >= len(truth) - 1:
                    break
                if (done * 5 + d * 3 + len(req.prompt_token_ids)) % 7 == 0:
                    break  # hidden: every child at this depth is wrong
                node = kids[(done + d) % len(kids)]
                true_child[node] = True
            for i in range(1, tree.num_nodes + 1):
                depth = int(tree.depth[i])
                right = truth[depth - 1] if depth - 1 < len(truth) else 3
                on_true_path[i] = on_true_path[int(tree.parent[i])] and i in true_child
                drafts.append(right if on_true_path[i] else (right + 1 + int(tree.rank[i])) % VOCAB)
            room = req.sampling_params.max_tokens - done - 1
            accepted = max(int(tree.depth[i]) for i in [0, *true_child])
            self.expected_accepted += min(accepted, room)
            req.spec_token_ids = drafts


@pytest.fixture(scope="module")
def plain(tiny_llama):
    prompts, params = workload()
    return run(engine(tiny_llama), prompts, params)


def tree_engine(loaded, monkeypatch, prompts, plain_outs, choices=CHOICES, **kw):
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain_outs)}
    oracle = TreeOracleProposer(truth, DraftTree.from_choices(choices))

    def make_proposer(spec, eng):
        oracle.config = spec
        return oracle

    monkeypatch.setattr("jaxserve.engine.builder.make_proposer", make_proposer)
    return engine(loaded, {**SPEC, "speculative_token_tree": str(choices)}, **kw), oracle


@pytest.mark.parametrize("setting", ["batched", "chunked", "preempted"])
def test_greedy_with_a_draft_tree_equals_plain(tiny_llama, plain, monkeypatch, setting):
    kw = {
        "batched": dict(max_num_seqs=6),
        "chunked": dict(long_prefill_token_threshold=5, max_num_batched_tokens=16),
        "preempted": dict(num_blocks=30),
    }[setting]
    prompts, params = workload()
    eng, oracle = tree_engine(tiny_llama, monkeypatch, prompts, plain, **kw)
    compiles = eng.compilations
    assert tokens(run(eng, prompts, params, stream=True)) == tokens(plain)
    assert eng.compilations == compiles, "a program was compiled after warm-up"
    stats = eng.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if setting == "batched":  # every proposal was verified as proposed
        assert stats.num_accepted_tokens == oracle.expected_accepted
        assert stats.num_drafts == oracle.calls
    if setting == "preempted":
        assert eng.scheduler.num_preemptions > 0


# 40 nodes (41 positions: two mask words a token): 4 children of the root, 3 of each, 2 of
# each of those; the oracle's true branch ends on either side of position 32.
BIG_CHOICES = [(a,) for a in range(4)] + [(a, b) for a in range(4) for b in range(3)]
BIG_CHOICES += [(a, b, c) for a in range(4) for b in range(3) for c in range(2)]


def test_greedy_with_a_tree_past_32_positions_equals_plain(tiny_llama, plain, monkeypatch):
    big = DraftTree.from_choices(BIG_CHOICES)
    assert big.num_nodes == 40 and big.mask_words == 2
    prompts, params = workload()
    kw = dict(max_num_seqs=6, max_num_batched_tokens=256, token_buckets=(4, 16, 64, 256))  # every tree whole
    eng, oracle = tree_engine(tiny_llama, monkeypatch, prompts, plain, BIG_CHOICES, **kw)
    assert tokens(run(eng, prompts, params, stream=True)) == tokens(plain)
    stats = eng.scheduler.spec_stats
    assert stats.num_accepted_tokens == oracle.expected_accepted > 0
    assert stats.num_drafts == oracle.calls


def test_tree_config_is_validated():
    from jaxserve.spec_decode import SpeculativeConfig

    spec = SpeculativeConfig.parse(SPEC)
    assert spec.num_speculative_tokens == TREE.max_depth and spec.num_draft_tokens == TREE.num_nodes
    for bad, message in [
        ({"speculative_token_tree": "[(1,)]"}, "ranks"),
        ({"speculative_token_tree": "nonsense"}, "not a list of paths"),
        ({"speculative_token_tree": str(CHOICES), "num_speculative_tokens": 2}, "depth"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse({**SPEC, **bad})


@pytest.mark.parametrize(
    "overrides, engine_kw",
    [
        (dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3), {}),  # history along the path
        (dict(min_tokens=8, stop_token_ids=[40, 41, 42, 43, 44, 45]), {}),
        (dict(logprobs=3), {}),
        ({}, dict(kv_cache_dtype="int8")),  # the accepted path's scales move with its K/V
    ],
    ids=["penalties", "min-and-stop-tokens", "logprobs", "int8-kv"],
)
def test_sampling_parameters_and_8bit_kv_with_a_draft_tree_equal_plain(tiny_llama, monkeypatch, overrides, engine_kw):
    prompts, params = workload(seed=3, count=12, **overrides)
    want = run(engine(tiny_llama, **engine_kw), prompts, params)
    eng, _ = tree_engine(tiny_llama, monkeypatch, prompts, want, **engine_kw)
    got = run(eng, prompts, params, stream=True)
    assert tokens(got) == tokens(want)
    assert eng.scheduler.spec_stats.num_accepted_tokens > 0
    if "logprobs" in overrides:
        for g, w in zip(got, want):
            for gl, wl in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert gl.keys() == wl.keys()
                assert max(abs(gl[t] - wl[t]) for t in gl) < 2e-4
