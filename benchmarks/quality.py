"""Quality of the quantized models against the unquantized one, on a fixed text.

The unquantized model (`--dtype`, float32 by default) is the reference; each scheme of
`--quantization` is loaded from the same checkpoint and compared with it. Reported:

- perplexity on the text, of the reference (the baseline row) and of each scheme:
  exp of the mean negative log-likelihood of every token given the ones before it;
- mean KL divergence per token, KL(p_ref || p_quant), natural log (nats), over the same
  predicted positions;
- top-1 agreement: the fraction of those positions where both models' argmax is the same
  token (not accuracy against the text);
- greedy agreement: each prompt (single_stream.py's PROMPTS and a few more) is continued
  greedily for `--max-tokens` N tokens by both models (EOS ignored, so both give N); a
  prompt scores (length of the common prefix of the two continuations) / N, and the
  figure is the mean over prompts. "identical" counts prompts whose N tokens all agree;
- resident weight bytes (MiB) of each model.

An 8-bit KV cache (`--kv-cache-dtype`, fp8 and int8 by default) is compared the same way:
the unquantized model with an 8-bit cache against itself with the full-precision cache,
on `--window` token windows and again on `--long-window` token windows (errors in the
cache add up over a long context), with the cache bytes per token of each.

The text is benchmarks/quality_text.txt, about 4,100 tokens with SmolLM2's tokenizer,
all public domain: the US Declaration of Independence (the National Archives
transcription), Lincoln's Gettysburg Address (Bliss copy) and Second Inaugural Address,
the Preamble and Article I, Sections 1-2 of the US Constitution, and a few small Python
functions written for this benchmark (also public domain). It is tokenized once and cut
into `--window` token windows, each evaluated as an independent sequence from position 0
and starting with BOS when the tokenizer adds one; the metrics are summed window by
window, so no more than one window's logits is ever held.

A checkpoint quantized by another tool (GPTQ, AWQ, compressed-tensors) is compared the same
way with `--checkpoint NAME=PATH` against `--model`, the float checkpoint it was made from;
such a row measures that tool's quantization (jaxserve serves the file's values as stored).

"gguf" keeps a GGUF file's own 4-bit blocks (it is skipped, with a note, for a model that
is not a .gguf file); the reference is dequantized from the same blocks, so the two should
agree up to float rounding. "int4" re-quantizes the reference's float weights (for the
default model: weights that were already Q4_1, rounded again to int4 groups of 128).

    python benchmarks/quality.py [--quantization gguf,int4,int8,fp8] [--kv-cache-dtype fp8,int8] [--window 512] [--json]
    python benchmarks/quality.py --model path/to/hf-folder --dtype bfloat16
    python benchmarks/quality.py --model float-folder --quantization int4 --checkpoint gptq=gptq-folder
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.single_stream import PROMPTS as STREAM_PROMPTS  # noqa: E402

TEXT = ROOT / "benchmarks" / "quality_text.txt"
PROMPTS = [
    *STREAM_PROMPTS,
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Explain in two sentences why the sky is blue.",
    "import numpy as np\n\ndef mean_squared_error(",
]
BLOCK_SIZE = 16


# --- metrics: pure functions of logits ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LogitStats:
    """Sums over predicted positions, so windows add up before the means are taken."""

    tokens: int = 0
    ref_nll: float = 0.0  # sum of -log p_ref(target)
    test_nll: float = 0.0  # sum of -log p_test(target)
    kl: float = 0.0  # sum of KL(p_ref || p_test)
    top1_equal: int = 0  # positions where the two argmaxes are the same token

    def __add__(self, other: LogitStats) -> LogitStats:
        return LogitStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis, in float64."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def nll_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum over rows t of -log softmax(logits[t])[targets[t]]."""
    logp = log_softmax(logits)
    return float(-logp[np.arange(len(targets)), targets].sum())


def logit_stats(ref_logits: np.ndarray, test_logits: np.ndarray, targets: np.ndarray, chunk: int = 128) -> LogitStats:
    """The sums behind `compare_logits`. ref_logits, test_logits: [T, vocab], row t
    predicting targets[t]; rows are taken `chunk` at a time to bound the float64 copies."""
    ref_logits, test_logits, targets = np.asarray(ref_logits), np.asarray(test_logits), np.asarray(targets)
    if ref_logits.shape != test_logits.shape or ref_logits.shape[:1] != targets.shape:
        raise ValueError(f"shapes differ: {ref_logits.shape=} {test_logits.shape=} {targets.shape=}")
    total = LogitStats()
    for start in range(0, len(targets), chunk):
        rows = slice(start, start + chunk)
        ref, test, tgt = log_softmax(ref_logits[rows]), log_softmax(test_logits[rows]), targets[rows]
        at = np.arange(len(tgt))
        total += LogitStats(
            tokens=len(tgt),
            ref_nll=float(-ref[at, tgt].sum()),
            test_nll=float(-test[at, tgt].sum()),
            kl=float((np.exp(ref) * (ref - test)).sum()),
            top1_equal=int((ref_logits[rows].argmax(-1) == test_logits[rows].argmax(-1)).sum()),
        )
    return total


def summarize(stats: LogitStats) -> dict:
    """Perplexity of each model, mean KL per token and top-1 agreement from summed stats."""
    n = stats.tokens
    return {
        "tokens": n,
        "ref_perplexity": float(np.exp(stats.ref_nll / n)),
        "test_perplexity": float(np.exp(stats.test_nll / n)),
        "mean_kl": stats.kl / n,
        "top1_agreement": stats.top1_equal / n,
    }


def compare_logits(ref_logits: np.ndarray, test_logits: np.ndarray, targets: np.ndarray) -> dict:
    """Perplexity of each model on `targets`, mean KL(p_ref || p_test) and top-1 agreement."""
    return summarize(logit_stats(ref_logits, test_logits, targets))


def prefix_agreement(ref_tokens: list[int], test_tokens: list[int], n: int) -> float:
    """Length of the common prefix of the two continuations (at most n), over n."""
    common = 0
    for a, b in zip(ref_tokens[:n], test_tokens[:n]):
        if a != b:
            break
        common += 1
    return common / n


def greedy_agreement(ref_outputs: list[list[int]], test_outputs: list[list[int]], n: int) -> dict:
    """Mean prefix agreement over prompts, and how many prompts agree on all n tokens."""
    scores = [prefix_agreement(r, t, n) for r, t in zip(ref_outputs, test_outputs, strict=True)]
    return {"greedy_agreement": float(np.mean(scores)), "greedy_identical": sum(s == 1.0 for s in scores)}


# --- running the models ---------------------------------------------------------------


def text_windows(tokenizer, text: str, window: int) -> list[list[int]]:
    """The text's tokens in consecutive windows of at most `window` tokens, each starting
    with the tokens the tokenizer adds in front (BOS), if any; a window has >= 2 tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    with_special = tokenizer.encode("a", add_special_tokens=True)
    prefix = with_special[: len(with_special) - len(tokenizer.encode("a", add_special_tokens=False))]
    step = window - len(prefix)
    if step < 1:
        raise ValueError(f"{window=} leaves no room for text after the {len(prefix)} prefix tokens")
    windows = [prefix + ids[i : i + step] for i in range(0, len(ids), step)]
    return [w for w in windows if len(w) >= 2]


def window_logits_fn(loaded, window: int, kv_cache_dtype: str = "auto"):
    """A function from a token list (at most `window` long) to the logits at every one of
    its positions ([len, vocab] float32), the sequence prefilled from position 0 into a
    cache of `kv_cache_dtype`. One compiled program per model: every window is padded to
    `window` tokens."""
    import jax
    from flax import nnx

    from jaxserve.model.inputs import ModelInputs
    from jaxserve.model.kv_cache import allocate_kv_cache, resolve_kv_cache_dtype

    graphdef, state = nnx.split(loaded.model)
    step = jax.jit(lambda state, kv, inputs: nnx.merge(graphdef, state)(inputs, kv), donate_argnums=(1,))
    num_blocks = -(-window // BLOCK_SIZE)
    kv = allocate_kv_cache(
        loaded.config, num_blocks + 1, BLOCK_SIZE, resolve_kv_cache_dtype(kv_cache_dtype, loaded.model.dtype)
    )
    table = np.arange(1, num_blocks + 1)  # block 0 is the null block
    pad_pos = np.arange(window)

    def logits(ids: list[int]) -> np.ndarray:
        nonlocal kv
        n = len(ids)
        pos = np.arange(n)
        pad = window - n  # padding tokens: slot 0 (the null block), in no sequence
        inputs = ModelInputs.from_numpy(
            input_ids=list(ids) + [0] * pad,
            positions=np.concatenate([pos, np.zeros(pad)]),
            slot_mapping=np.concatenate([table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE, np.zeros(pad)]),
            query_start_loc=[0, n],
            seq_lens=[n],
            block_tables=table[None],
            logits_indices=np.minimum(pad_pos, n - 1),
        )
        out, kv = step(state, kv, inputs)
        return np.asarray(out[:n])

    return logits


def greedy_continuations(loaded, prompts: list[str], max_tokens: int, kv_cache_dtype: str = "auto") -> list[list[int]]:
    """Each prompt continued greedily for max_tokens tokens (EOS ignored), batched in one engine."""
    from jaxserve.engine import EngineConfig, LLMEngine
    from scheduler import SamplingParams

    longest = max(len(loaded.tokenizer.encode(p)) for p in prompts)
    engine = LLMEngine(
        loaded,
        EngineConfig(
            max_num_seqs=len(prompts),
            max_num_batched_tokens=256,
            max_model_len=longest + max_tokens,
            kv_cache_memory=64 << 20,
            kv_cache_dtype=kv_cache_dtype,
            warm_up=False,
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs = {o.request_id: list(o.outputs[0].token_ids) for o in engine.generate_all()}
    return [outputs[str(i)] for i in range(len(prompts))]


def run(args) -> dict:
    """Load the reference and every scheme once, score the text window by window, then
    generate with each model, freeing each quantized model when it is done."""
    from jaxserve.weights import load_model
    from jaxserve.weights.load import resolve_source

    is_gguf = resolve_source(args.model).is_file()
    schemes = [s for s in args.quantization.split(",") if s]
    kv_dtypes = [d for d in args.kv_cache_dtype.split(",") if d]
    skipped = {}
    if "gguf" in schemes and not is_gguf:
        schemes.remove("gguf")
        skipped["gguf"] = "not a .gguf file: there are no GGUF blocks to keep"
    reference = load_model(args.model, dtype=args.dtype, progress=False)
    models = {s: load_model(args.model, dtype=args.dtype, progress=False, quantization=s) for s in schemes}
    checkpoints = dict(args.checkpoint)
    models.update({name: load_model(path, dtype=args.dtype, progress=False) for name, path in checkpoints.items()})
    schemes += list(checkpoints)
    windows = text_windows(reference.tokenizer, TEXT.read_text(), args.window)[: args.max_windows]

    ref_logits = window_logits_fn(reference, args.window)
    logit_fns = {s: window_logits_fn(m, args.window) for s, m in models.items()}
    stats = {s: LogitStats() for s in schemes}
    ref_nll = 0.0
    for i, ids in enumerate(windows):
        print(f"window {i + 1}/{len(windows)}", file=sys.stderr, flush=True)
        ref, targets = ref_logits(ids)[:-1], np.asarray(ids[1:])
        ref_nll += nll_sum(ref, targets)
        for s, fn in logit_fns.items():
            stats[s] += logit_stats(ref, fn(ids)[:-1], targets)
    del ref_logits, logit_fns, ref

    ref_out = greedy_continuations(reference, PROMPTS, args.max_tokens)
    rows = {}
    for s in schemes:
        summary = summarize(stats[s])
        loaded = models.pop(s)
        label = loaded.quantization.label if loaded.quantization else f"{args.dtype} (not quantized)"
        rows[s] = {
            "label": f"{s}: {label}" if s in checkpoints else label,
            "weight_mib": loaded.weight_bytes / 2**20,
            "perplexity": summary["test_perplexity"],
            "mean_kl": summary["mean_kl"],
            "top1_agreement": summary["top1_agreement"],
            **greedy_agreement(ref_out, greedy_continuations(loaded, PROMPTS, args.max_tokens), args.max_tokens),
        }
        del loaded
        gc.collect()
    tokens = sum(len(w) - 1 for w in windows)
    kv_rows = {d: kv_cache_row(reference, d, args, ref_out) for d in kv_dtypes}
    return {
        "model": args.model or "SmolLM2-135M-Instruct (default, Q4_1 GGUF)",
        "dtype": args.dtype,
        "window": args.window,
        "windows": len(windows),
        "tokens": tokens,
        "max_tokens": args.max_tokens,
        "prompts": len(PROMPTS),
        "reference": {
            "label": f"{args.dtype} (not quantized)",
            "weight_mib": reference.weight_bytes / 2**20,
            "perplexity": float(np.exp(ref_nll / tokens)),
        },
        "schemes": rows,
        "skipped": skipped,
        "long_window": args.long_window,
        "kv_cache": kv_rows,
    }


def kv_cache_row(reference, kv_dtype: str, args, ref_out: list[list[int]]) -> dict:
    """The float model with an 8-bit cache against itself with the full one: logit metrics
    on `--window` and on `--long-window` token windows, then greedy agreement."""
    from jaxserve.model.kv_cache import kv_bytes_per_token, kv_dtype_label, resolve_kv_cache_dtype

    dtype = resolve_kv_cache_dtype(kv_dtype, reference.model.dtype)
    row = {
        "label": kv_dtype_label(dtype, reference.config.kv_scales),
        "bytes_per_token": kv_bytes_per_token(reference.config, dtype),
        "full_bytes_per_token": kv_bytes_per_token(reference.config, reference.model.dtype),
        "windows": {},
    }
    for window in dict.fromkeys((args.window, args.long_window)):
        windows = text_windows(reference.tokenizer, TEXT.read_text(), window)[: args.max_windows]
        full, quantized = window_logits_fn(reference, window), window_logits_fn(reference, window, kv_dtype)
        stats = LogitStats()
        for i, ids in enumerate(windows):
            print(f"kv {kv_dtype}, {window}-token window {i + 1}/{len(windows)}", file=sys.stderr, flush=True)
            stats += logit_stats(full(ids)[:-1], quantized(ids)[:-1], np.asarray(ids[1:]))
        summary = summarize(stats)
        row["windows"][window] = {
            "windows": len(windows),
            "tokens": summary["tokens"],
            "perplexity": summary["test_perplexity"],
            "full_perplexity": summary["ref_perplexity"],
            "mean_kl": summary["mean_kl"],
            "top1_agreement": summary["top1_agreement"],
        }
        del full, quantized
        gc.collect()
    row.update(
        greedy_agreement(ref_out, greedy_continuations(reference, PROMPTS, args.max_tokens, kv_dtype), args.max_tokens)
    )
    return row


def print_table(result: dict) -> None:
    print(
        f"{result['model']}, {result['dtype']}: {result['tokens']} predicted tokens of "
        f"benchmarks/quality_text.txt in {result['windows']} windows of <= {result['window']}; "
        f"greedy {result['max_tokens']} tokens x {result['prompts']} prompts"
    )
    ref = result["reference"]
    header = ("scheme", "weights (MiB)", "perplexity", "mean KL (nats)", "top-1 agree", "greedy agree", "identical")
    rows = [(ref["label"] + " [reference]", f"{ref['weight_mib']:.1f}", f"{ref['perplexity']:.3f}", "-", "-", "-", "-")]
    for r in result["schemes"].values():
        rows.append(
            (
                r["label"],
                f"{r['weight_mib']:.1f}",
                f"{r['perplexity']:.3f}",
                f"{r['mean_kl']:.2e}",
                f"{100 * r['top1_agreement']:.2f}%",
                f"{100 * r['greedy_agreement']:.1f}%",
                f"{r['greedy_identical']}/{result['prompts']}",
            )
        )
    _print_rows(header, rows)
    for scheme, why in result["skipped"].items():
        print(f"{scheme} skipped: {why}")
    if result["kv_cache"]:
        print(f"\nKV cache, against the {ref['label']} model with its full-precision cache:")
        header = (
            "KV cache",
            "bytes/token",
            "window",
            "perplexity (full)",
            "mean KL (nats)",
            "top-1 agree",
            "greedy agree",
            "identical",
        )
        rows = []
        for r in result["kv_cache"].values():
            for window, w in r["windows"].items():
                rows.append(
                    (
                        r["label"],
                        f"{r['bytes_per_token']} vs {r['full_bytes_per_token']}",
                        f"{w['windows']} x {window}",
                        f"{w['perplexity']:.3f} ({w['full_perplexity']:.3f})",
                        f"{w['mean_kl']:.2e}",
                        f"{100 * w['top1_agreement']:.2f}%",
                        f"{100 * r['greedy_agreement']:.1f}%",
                        f"{r['greedy_identical']}/{result['prompts']}",
                    )
                )
        _print_rows(header, rows)


def _print_rows(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    for i, row in enumerate([header, *rows]):
        print(
            "| " + " | ".join(v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(zip(row, widths))) + " |"
        )
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def name_and_path(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not (name and sep and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a HF folder or .gguf file (default: the embedded model)")
    p.add_argument("--dtype", default="float32", help="dtype of the reference and of the quantized models' rest")
    p.add_argument("--quantization", default="gguf,int4,int8,fp8", help="comma-separated schemes to compare")
    p.add_argument(
        "--kv-cache-dtype",
        default="fp8,int8",
        help="comma-separated 8-bit KV caches to compare with the full one ('' for none)",
    )
    p.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="NAME=PATH",
        type=name_and_path,
        help="a checkpoint of --model quantized by another tool, compared like a scheme (repeatable)",
    )
    p.add_argument("--window", type=int, default=512, help="tokens per independent window of the text")
    p.add_argument("--long-window", type=int, default=2048, help="the KV cache rows' long-context windows")
    p.add_argument("--max-windows", type=int, default=None, help="score only the first windows (default: all)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy continuation length N per prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    from jaxserve.engine.builder import enable_compilation_cache

    enable_compilation_cache()  # $JAXSERVE_CACHE's, as the engine scripts use
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
