"""benchmarks/quality.py: its metrics against independent computations, its text windows,
and a smoke run of the script on a tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.special import log_softmax, softmax

from benchmarks.quality import (
    LogitStats,
    compare_logits,
    greedy_agreement,
    logit_stats,
    prefix_agreement,
    text_windows,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def logits():
    rng = np.random.default_rng(0)
    ref = rng.normal(scale=3.0, size=(40, 57)).astype(np.float32)
    targets = rng.integers(0, 57, size=40)
    return ref, targets


def test_logits_against_themselves(logits):
    ref, targets = logits
    got = compare_logits(ref, ref.copy(), targets)
    nll = -log_softmax(ref.astype(np.float64), axis=-1)[np.arange(len(targets)), targets]
    assert got["tokens"] == 40
    assert got["ref_perplexity"] == got["test_perplexity"]
    assert got["ref_perplexity"] == pytest.approx(np.exp(nll.mean()), rel=1e-12)
    assert abs(got["mean_kl"]) < 1e-12
    assert got["top1_agreement"] == 1.0


def test_perturbed_logits(logits):
    ref, targets = logits
    test = ref.copy()
    changed = [0, 7, 8, 31, 39]
    for row in changed:  # sink the top token below all others: the argmax moves, nothing else
        test[row, ref[row].argmax()] = ref[row].min() - 1.0
    test[3] += 5.0  # a constant shift changes no probability
    got = compare_logits(ref, test, targets)

    ref64, test64 = ref.astype(np.float64), test.astype(np.float64)
    p, log_p, log_q = softmax(ref64, -1), log_softmax(ref64, -1), log_softmax(test64, -1)
    want_kl = (p * (log_p - log_q)).sum(-1)
    assert got["top1_agreement"] == (40 - len(changed)) / 40
    assert got["mean_kl"] > 0
    assert got["mean_kl"] == pytest.approx(want_kl.mean(), rel=1e-6)
    assert np.abs(want_kl[[r for r in range(40) if r not in changed]]).max() < 1e-6
    test_nll = -log_q[np.arange(40), targets]
    assert got["test_perplexity"] == pytest.approx(np.exp(test_nll.mean()), rel=1e-6)
    assert got["test_perplexity"] != got["ref_perplexity"]


def test_windows_add_up_and_chunks_do_not_matter(logits):
    ref, targets = logits
    test = ref + np.random.default_rng(1).normal(size=ref.shape).astype(np.float32)
    whole = logit_stats(ref, test, targets)
    halves = logit_stats(ref[:15], test[:15], targets[:15]) + logit_stats(ref[15:], test[15:], targets[15:])
    small_chunks = logit_stats(ref, test, targets, chunk=3)
    for stats in (halves, small_chunks):
        assert stats.tokens == whole.tokens and stats.top1_equal == whole.top1_equal
        for field in ("ref_nll", "test_nll", "kl"):
            assert getattr(stats, field) == pytest.approx(getattr(whole, field), rel=1e-12)
    assert LogitStats() + whole == whole
    with pytest.raises(ValueError, match="shapes differ"):
        logit_stats(ref, test[:, :-1], targets)


def test_greedy_agreement_is_the_common_prefix_over_n():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4], 4) == 1.0
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 9, 4], 4) == 0.5  # the match after a divergence does not count
    assert prefix_agreement([5, 2, 3, 4], [1, 2, 3, 4], 4) == 0.0
    got = greedy_agreement([[1, 2, 3, 4], [1, 2, 3, 4], [7, 7, 7, 7]], [[1, 2, 3, 4], [1, 0, 3, 4], [8, 7, 7, 7]], 4)
    assert got == {"greedy_agreement": pytest.approx((1 + 0.25 + 0) / 3), "greedy_identical": 1}


def test_text_windows_start_with_bos_and_cover_the_text(tiny_llama_tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_tok_dir)
    text = "the cat sat on the mat and the dog ran to the big red house " * 5
    ids = tok.encode(text, add_special_tokens=False)
    windows = text_windows(tok, text, 16)
    assert all(w[0] == tok.bos_token_id and 2 <= len(w) <= 16 for w in windows)
    assert [t for w in windows for t in w[1:]] == ids
    assert len(windows) == -(-len(ids) // 15)


@pytest.mark.slow
def test_script_smoke_on_tiny_model(tiny_llama_tok_dir, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/quality.py",
            "--model",
            str(tiny_llama_tok_dir),
            "--window",
            "32",
            "--long-window",
            "64",
            "--kv-cache-dtype",
            "fp8,int8",
            "--max-windows",
            "2",
            "--max-tokens",
            "4",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAXSERVE_CACHE": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["windows"] == 2 and result["tokens"] == 2 * 31 and result["max_tokens"] == 4
    assert "gguf" in result["skipped"]  # a HF folder has no GGUF blocks
    assert result["reference"]["perplexity"] > 1
    assert sorted(result["schemes"]) == ["fp8", "int4", "int8"]
    for row in result["schemes"].values():
        assert row["perplexity"] > 1 and row["mean_kl"] >= 0
        assert 0 <= row["top1_agreement"] <= 1 and 0 <= row["greedy_agreement"] <= 1
        assert 0 < row["weight_mib"] < result["reference"]["weight_mib"]
    assert sorted(result["kv_cache"]) == ["fp8", "int8"]
    for row in result["kv_cache"].values():
        assert row["bytes_per_token"] < row["full_bytes_per_token"]
        assert sorted(row["windows"], key=int) == ["32", "64"]
        for w in row["windows"].values():
            assert w["windows"] == 2 and w["mean_kl"] >= 0 and 0 <= w["top1_agreement"] <= 1
        # The full-cache side of the short windows is the reference row's computation.
        assert row["windows"]["32"]["full_perplexity"] == pytest.approx(result["reference"]["perplexity"], rel=1e-6)
        assert 0 <= row["greedy_agreement"] <= 1


@pytest.mark.slow
def test_a_checkpoint_quantized_elsewhere_is_compared_with_its_float_model(tmp_path):
    """`--checkpoint NAME=PATH`: a GPTQ checkpoint against a float model holding exactly the
    weights it stands for (tests/jaxserve/weights/test_gptq_awq.py's oracle), so the row
    shows no difference at all."""
    from tests.jaxserve.weights.test_compressed_tensors import write_float_copy
    from tests.jaxserve.weights.test_gptq_awq import write_checkpoint
    from tests.tiny_models import make_tiny_tokenizer

    weights = write_checkpoint(tmp_path / "gptq", "gptq")
    write_float_copy(tmp_path / "gptq", weights, tmp_path / "float")
    for folder in ("gptq", "float"):
        make_tiny_tokenizer(tmp_path / folder)
    args = ["--model", str(tmp_path / "float"), "--quantization", "", "--kv-cache-dtype", ""]
    args += ["--checkpoint", f"gptq={tmp_path / 'gptq'}", "--window", "32", "--max-windows", "2", "--max-tokens", "4"]
    out = subprocess.run(
        [sys.executable, "benchmarks/quality.py", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAXSERVE_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    ((name, row),) = result["schemes"].items()
    assert name == "gptq" and row["label"] == "gptq: gptq (int4, group 32)"
    assert row["perplexity"] == pytest.approx(result["reference"]["perplexity"], rel=1e-5)
    assert row["mean_kl"] < 1e-8 and row["top1_agreement"] == 1
    assert row["greedy_identical"] == result["prompts"]
    assert row["weight_mib"] < result["reference"]["weight_mib"]
