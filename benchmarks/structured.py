"""Structured output on the default model: constrained against free decode, cold against cached grammars.

SmolLM2-135M-Instruct in float32 (or `--model`), greedy, a server's settings (max_num_seqs
64, max_model_len 1024). The same chat prompts (asking for a JSON list, cycled to fill a
batch) run in two arms, alternating round by round so both see the machine's drift:

- free: `SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)`;
- constrained: the same with `structured_outputs` (`--constraint json`: a JSON schema, an
  array of at least N objects {id, name, tags}; `regex`: `[a-z ]{64 N + 1}`), a grammar that
  cannot end within N tokens, so both arms generate N tokens per request (ignore_eos is no
  use with a grammar: once it is complete only EOS is allowed). The tokens actually
  generated are reported.

Decode tokens/s at batch 1 and 32 (`--batch-sizes`): a run adds its requests together and
steps the engine until all finish; it decodes from the moment every request has its first
token to the last token, and the tokens that arrive in that window count (spec_decode.py's
rule); a row is the median over the rounds. The ratio is the median of each round's
constrained / free (the two arms run back to back, so a burst of load on this shared
machine spoils one round's pair, not the figure), printed per round too; the issue's aim is
within 10 % at batch 32. NOTE: the free arm runs the engine's overlapped step loop and the
constrained arm its serial loop (a mask needs the latest token on the host), so the ratio
is net of the overlap given up.

Time to first token, measured around `add_request` (which waits for the grammar's compile)
to the first output token, max_tokens 1: free, with a grammar never compiled before (cold:
a JSON property name or regex length with a counter) and with the same grammar again
(cached); medians. Also `engine.compile_grammar(spec).result()` timed alone, cold and cached,
and the grammar engine's one-off setup (its tokenizer tables, on the engine's first grammar).

`--profile` (batch 32 of `--batch-sizes`, its largest) adds two arms that split the gap:
free on the serial loop, and free on the serial loop with the sampler's adjust variant (a
zero `logit_bias` selects it: the variant grammar masks share with penalties and the token
bias). Per arm: jaxserve's step profiler (host ms/step by phase), the host time in the
grammar's mask fill and token accept and in building the sampler's inputs; for free and
constrained the device's time by part (the sampler apart) of the commonest step; and the
jitted sampler alone by variant (plain, adjust, the grammar's mask alone).

    python benchmarks/structured.py [--max-tokens 64] [--batch-sizes 1,32] [--rounds 3] [--constraint json|regex]
    python benchmarks/structured.py --profile
    python benchmarks/structured.py --smoke --json     # batch 1 and 2, 8 tokens, one round, a small engine
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import ClassVar, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.spec_decode import positive_ints  # noqa: E402

PROMPTS = [
    "List the users of a small chess club as JSON: each with an id, a name and a few tags.",
    "Give me a JSON array of books, each an object with an id, a title as name and genre tags.",
    "Output JSON only: the planets of the solar system, with id, name and tags describing each.",
    "Make up a JSON list of cities, one object each with an id, its name and tags for what it is known for.",
]
ARMS = ("free", "constrained")
# Run in this order (free and constrained back to back); shown as a ladder from free to constrained.
PROFILE_ARMS = ("free", "constrained", "free, serial loop", "free, serial loop, adjust sampler")
LADDER = ("free", "free, serial loop", "free, serial loop, adjust sampler", "constrained")


class RunResult(NamedTuple):
    """One run: a group of requests added together and stepped until all finished."""

    decode_tokens: int
    decode_seconds: float
    generated: int  # output tokens, all of the group's
    finish_reasons: collections.Counter


# -- what is asked --------------------------------------------------------------------------


def structured_outputs(kind: str, max_tokens: int, serial: int = 0) -> dict:
    """A constraint that cannot be complete within `max_tokens` tokens; each `serial` a new grammar."""
    if kind == "regex":  # no token of the default model's vocabulary is longer than 64 characters
        return {"regex": f"[a-z ]{{{64 * max_tokens + 1 + serial}}}"}
    item = {
        "type": "object",
        "additionalProperties": False,
        "required": [f"id{serial or ''}", "name", "tags"],
        "properties": {
            f"id{serial or ''}": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
    }
    return {"json": {"type": "array", "minItems": max_tokens, "items": item}}  # an item is several tokens


def arm_params(arm: str, args, max_tokens: int | None = None, serial: int = 0):
    from scheduler import SamplingParams

    n = max_tokens or args.max_tokens
    if arm == "constrained":
        return SamplingParams(
            temperature=0, max_tokens=n, structured_outputs=structured_outputs(args.constraint, args.max_tokens, serial)
        )
    bias = {"logit_bias": {0: 0.0}} if arm.endswith("adjust sampler") else {}  # the adjust variant, no change
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **bias)


def encode_prompts(engine) -> list[list[int]]:
    """The prompts through the model's chat template (its plain text without one)."""
    from jaxserve.engine.tokenization import encode_chat, encode_prompt

    vocab = engine.loaded.config.vocab_size
    if not getattr(engine.tokenizer, "chat_template", None):
        return [encode_prompt(engine.tokenizer, p, vocab) for p in PROMPTS]
    return [encode_chat(engine.tokenizer, [{"role": "user", "content": p}], vocab)[1] for p in PROMPTS]


# -- runs -----------------------------------------------------------------------------------


@contextlib.contextmanager
def step_loop(engine, arm: str):
    """The engine's own loop, except the profile's serial-loop arms.

    NOTE: `async_scheduling` is read at each step; flipped only while nothing is in flight."""
    saved = engine.async_scheduling
    engine.async_scheduling = saved and "serial loop" not in arm
    try:
        yield
    finally:
        engine.async_scheduling = saved


def run_group(engine, prompts: list[list[int]], params, tag: str) -> RunResult:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    done = {out.request_id: out for out in engine.generate_all()}
    outs = [done[i] for i in ids]
    start = max(o.metrics.first_token_time for o in outs)  # every prompt prefilled
    end = max(o.metrics.last_token_time for o in outs)
    return RunResult(
        sum(t > start for o in outs for t in o.metrics.token_times),
        end - start,
        sum(len(o.outputs[0].token_ids) for o in outs),
        collections.Counter(o.outputs[0].finish_reason for o in outs),
    )


def batch_of(prompts: list[list[int]], size: int, first: int = 0) -> list[list[int]]:
    """`size` prompts from the `first`, the list cycled (batch 1 takes a different one each round)."""
    return [prompts[(first + i) % len(prompts)] for i in range(size)]


def measure_decode(engine, prompts, args, profiles=None) -> tuple[dict, int]:
    """{(arm, batch): [RunResult per round]}, and the XLA compilations while timed.
    `profiles`: {(arm, batch): (StepProfiler, host Counter)}: those runs are profiled, and
    the arms named there run at that batch size instead of the two plain ones."""
    from jaxserve.engine.profiling import NullProfiler

    profiles = profiles or {}

    def arms(batch: int) -> list[str]:
        return [arm for arm in PROFILE_ARMS if (arm, batch) in profiles] or list(ARMS)

    for batch in args.batch_sizes:  # warm-up, untimed: compiles and caches the grammar
        for arm in arms(batch):
            with step_loop(engine, arm):
                run_group(engine, batch_of(prompts, batch), arm_params(arm, args, 8), f"warm-{arm}-{batch}")
    compiled = engine.compilations
    results = collections.defaultdict(list)
    for r in range(args.rounds):
        for batch in args.batch_sizes:
            for arm in arms(batch):
                profiler, host = profiles.get((arm, batch), (NullProfiler(), None))
                engine.profiler = profiler
                with step_loop(engine, arm), HOST_TIMERS.counting(host):
                    run = run_group(engine, batch_of(prompts, batch, r), arm_params(arm, args), f"{arm}-{batch}-{r}")
                engine.profiler = NullProfiler()
                results[arm, batch].append(run)
                print(
                    f"  round {r}, batch {batch}, {arm}: {run.decode_tokens / run.decode_seconds:.1f} decode tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    return dict(results), engine.compilations - compiled


def decode_rate(runs: list[RunResult]) -> float:
    """Decode tokens/s: the median over the rounds."""
    return statistics.median(r.decode_tokens / r.decode_seconds for r in runs)


def paired_ratios(constrained: list[RunResult], free: list[RunResult]) -> list[float]:
    """Each round's constrained / free decode tokens/s."""
    return [decode_rate([c]) / decode_rate([f]) for c, f in zip(constrained, free)]


def first_token_seconds(engine, prompt: list[int], params, tag: str) -> float:
    """From add_request (which waits for the grammar) to the first output token."""
    start = time.perf_counter()
    engine.add_request(tag, prompt, params)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
    return first - start


def measure_grammar_latency(engine, prompt: list[int], args) -> dict:
    """Medians (ms) of TTFT free / cold / cached grammar and compile alone cold / cached;
    the serials of cold grammars start past any the decode runs used."""
    from scheduler import StructuredOutputsParams

    samples = collections.defaultdict(list)
    for i in range(args.ttft_samples):
        serial = 1000 + 2 * i
        cold, cached = arm_params("constrained", args, 1, serial), arm_params("constrained", args, 1, serial)
        samples["ttft_free"].append(first_token_seconds(engine, prompt, arm_params("free", args, 1), f"t-free-{i}"))
        samples["ttft_cold"].append(first_token_seconds(engine, prompt, cold, f"t-cold-{i}"))
        samples["ttft_cached"].append(first_token_seconds(engine, prompt, cached, f"t-cached-{i}"))
        spec = StructuredOutputsParams.from_dict(structured_outputs(args.constraint, args.max_tokens, serial + 1))
        for key in ("compile_cold", "compile_cached"):
            start = time.perf_counter()
            engine.compile_grammar(spec).result()
            samples[key].append(time.perf_counter() - start)
    return {key: 1000 * statistics.median(v) for key, v in samples.items()}


# -- the profile ----------------------------------------------------------------------------


class HostTimers:
    """Seconds spent in a few host methods, into the Counter being counted (profile only)."""

    TARGETS: ClassVar[dict[str, tuple[str, str, str]]] = {
        "mask fill": ("jaxserve.structured.request_grammar", "RequestGrammar", "fill_bitmask"),
        "token accept": ("jaxserve.structured.request_grammar", "RequestGrammar", "accept"),
        "sampler inputs": ("jaxserve.runner.model_runner", "ModelRunner", "_pad_sampling"),
    }

    def __init__(self):
        self.current: collections.Counter | None = None

    def install(self) -> None:
        import importlib

        for key, (module, cls, name) in self.TARGETS.items():
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, name, self._timed(getattr(owner, name), key))

    def _timed(self, fn, key: str):
        def timed(*a, **kw):
            if self.current is None:
                return fn(*a, **kw)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.current[key] += time.perf_counter() - start

        return timed

    @contextlib.contextmanager
    def counting(self, counter: collections.Counter | None):
        self.current = counter
        try:
            yield
        finally:
            self.current = None


HOST_TIMERS = HostTimers()


def print_profile(profiles: dict, results: dict, batch: int, engine) -> None:
    from jaxserve.engine.profiling import HOST_PHASES, breakdown_table, device_breakdown

    width = 34
    print(
        f"\nwhere the time goes, batch {batch} (host ms per engine step, all rounds; "
        "mask fill runs inside schedule, sampler inputs inside dispatch)"
    )
    print(
        f"| {'arm':<{width}} | decode tok/s | ms/decode step | "
        + " | ".join(f"{p:>10}" for p in HOST_PHASES)
        + f" | {'mask fill':>9} | {'accept':>6} | {'sampler inputs':>14} |"
    )
    print(
        f"|{'-' * (width + 2)}|--------------|----------------|"
        + "|".join("-" * 12 for _ in HOST_PHASES)
        + "|-----------|--------|----------------|"
    )
    for arm in LADDER:
        profiler, host = profiles[arm, batch]
        steps = max(profiler.steps, 1)
        rate = decode_rate(results[arm, batch])
        print(
            f"| {arm:<{width}} | {rate:>12.1f} | {1000 * batch / rate:>14.1f} | "
            + " | ".join(f"{1000 * profiler.seconds[p] / steps:>10.2f}" for p in HOST_PHASES)
            + f" | {1000 * host['mask fill'] / steps:>9.2f} | {1000 * host['token accept'] / steps:>6.2f}"
            f" | {1000 * host['sampler inputs'] / steps:>14.2f} |"
        )
    examples = {}
    for arm in ("free", "constrained"):
        profiler, _ = profiles[arm, batch]
        shape, count = max(profiler.shapes.items(), key=lambda kv: kv[1])
        examples[arm] = profiler.examples[shape]
        title = (
            f"\n{arm}: device time of its commonest step ({shape[0]} tokens, {shape[1]} sequences, "
            f"{count} steps), replayed:"
        )
        print(breakdown_table(device_breakdown(engine.runner, examples[arm]), title))
    times = sampler_times(engine.runner, examples["free"], examples["constrained"])
    rows = engine.runner.rows_for(examples["constrained"].num_seqs)
    print(f"\nthe sampler alone, {rows} rows, median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))


def sampler_times(runner, free_batch, constrained_batch, repeats: int = 20) -> dict[str, float]:
    """The jitted sampler alone on random logits, by variant: the plain one (free rows), the
    adjust variant the engine runs for grammar rows (mask, a zero bias, penalties over a zero
    history), and the grammar's mask alone (what the adjust variant would be without the rest)."""
    import dataclasses

    import jax

    from jaxserve.sample.sampler import sample

    rows = runner.rows_for(constrained_batch.num_seqs)
    adjust = runner._pad_sampling(constrained_batch.sampling, rows)
    variants = {
        "plain": runner._pad_sampling(free_batch.sampling, rows),
        "adjust variant": adjust,
        "mask alone": dataclasses.replace(adjust, history=None, history_lens=None, prompt_lens=None, token_bias=None),
    }
    logits = jax.random.normal(jax.random.key(0), (rows, runner.config.vocab_size))
    run = jax.jit(sample)
    times = {}
    for name, meta in variants.items():
        meta = jax.device_put(meta)
        run(logits, meta).token_ids.block_until_ready()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(logits, meta).token_ids.block_until_ready()
            samples.append(time.perf_counter() - start)
        times[name] = 1000 * statistics.median(samples)
    return times


# -- report ---------------------------------------------------------------------------------


def make_result(results: dict, latency: dict, setup_ms: float, args, compilations: int) -> dict:
    decode = {}
    for batch in args.batch_sizes:
        free, con = results["free", batch], results["constrained", batch]
        decode[batch] = {
            "free_tok_s": decode_rate(free),
            "constrained_tok_s": decode_rate(con),
            "ratio": statistics.median(paired_ratios(con, free)),
            "round_ratios": paired_ratios(con, free),
            "free_tokens": sum(r.generated for r in free),
            "constrained_tokens": sum(r.generated for r in con),
            "constrained_finish": dict(sum((r.finish_reasons for r in con), collections.Counter())),
        }
    return {
        "model": args.model or "default",
        "constraint": args.constraint,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "max_num_seqs": args.max_num_seqs,
        "decode": decode,
        "grammar_ms": {**latency, "engine_setup": setup_ms},
        "compilations_while_timed": compilations,
    }


def print_table(result: dict, args) -> None:
    print(
        f"{args.model or 'SmolLM2-135M-Instruct (default)'}, float32, CPU; greedy, {args.max_tokens} tokens per "
        f"request; constraint: {args.constraint} ({describe(args)}); "
        f"{args.rounds} round{'s' * (args.rounds != 1)}, the arms alternating; "
        f"max_num_seqs {args.max_num_seqs}"
    )
    head, widths = ("metric", "free", "constrained", "constrained/free"), (40, 10, 13, 16)
    print(
        "| " + " | ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(head, widths))) + " |"
    )
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    rows = []
    for batch, d in result["decode"].items():
        rows.append(
            (
                f"decode tok/s, batch {batch}",
                f"{d['free_tok_s']:.1f}",
                f"{d['constrained_tok_s']:.1f}",
                f"{d['ratio']:.2f}x",
            )
        )
        rows.append(
            (f"  constrained/free by round, batch {batch}", "", "", " ".join(f"{x:.2f}" for x in d["round_ratios"]))
        )
        rows.append((f"tokens generated, batch {batch}", d["free_tokens"], d["constrained_tokens"], ""))
    g = result["grammar_ms"]
    rows += [
        (
            "time to first token (ms), cached grammar",
            f"{g['ttft_free']:.1f}",
            f"{g['ttft_cached']:.1f}",
            f"{g['ttft_cached'] / g['ttft_free']:.2f}x",
        ),
        (
            "time to first token (ms), cold grammar",
            f"{g['ttft_free']:.1f}",
            f"{g['ttft_cold']:.1f}",
            f"{g['ttft_cold'] / g['ttft_free']:.2f}x",
        ),
        ("grammar compile alone (ms), cold", "-", f"{g['compile_cold']:.2f}", ""),
        ("grammar compile alone (ms), cached", "-", f"{g['compile_cached']:.3f}", ""),
        ("grammar engine setup, once (ms)", "-", f"{g['engine_setup']:.0f}", ""),
    ]
    for cells in rows:
        print(
            "| "
            + " | ".join(f"{c:<{w}}" if i == 0 else f"{c!s:>{w}}" for i, (c, w) in enumerate(zip(cells, widths)))
            + " |"
        )
    top = result["decode"][max(result["decode"])]
    verdict = "met" if top["ratio"] >= 0.9 else "missed"
    print(
        f"aim: constrained decode within 10 % of free at batch {max(result['decode'])}: {top['ratio']:.2f}x, {verdict}"
    )
    finish = {b: d["constrained_finish"] for b, d in result["decode"].items()}
    print(f"constrained finish reasons: {finish}; TTFT and compile: medians of {args.ttft_samples}")
    if result["compilations_while_timed"]:
        print(f"note: {result['compilations_while_timed']} XLA compilations during the timed runs")


def describe(args) -> str:
    if args.constraint == "regex":
        return f"[a-z ]{{{64 * args.max_tokens + 1}}}"
    return f"a JSON array of at least {args.max_tokens} objects {{id, name, tags}}"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="a Hugging Face folder, GGUF file or hub id (default: the embedded one)"
    )
    p.add_argument("--constraint", choices=("json", "regex"), default="json")
    p.add_argument("--batch-sizes", type=positive_ints, default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, each arm once per batch size")
    p.add_argument("--ttft-samples", type=int, default=5, help="cold and cached grammars timed (medians)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the engine's max_num_seqs (a server's setting)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--profile",
        action="store_true",
        help="at the largest batch, two more arms and a step profile of each (host phases, mask fill, "
        "device time by part)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny: batch 1 and 2, 8 tokens, 1 round, an engine with few programs (max_num_seqs 4)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.max_tokens, args.rounds, args.ttft_samples = [1, 2], 8, 1, 2
        args.max_num_seqs, args.max_num_batched_tokens = 4, 64
    if max(args.batch_sizes) > args.max_num_seqs:
        p.error(f"--batch-sizes up to {max(args.batch_sizes)} need --max-num-seqs at least that")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxserve.engine.llm import LLM
    from jaxserve.engine.profiling import StepProfiler
    from scheduler import StructuredOutputsParams

    start = time.perf_counter()
    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=1024,
        kv_cache_memory=1 << 30,
    )
    engine = llm.engine
    print(f"engine built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    prompts = encode_prompts(engine)
    start = time.perf_counter()  # the first grammar also builds the engine's tokenizer tables
    engine.compile_grammar(StructuredOutputsParams.from_dict(structured_outputs(args.constraint, 1, 999))).result()
    setup_ms = 1000 * (time.perf_counter() - start)

    profiles = None
    if args.profile:
        HOST_TIMERS.install()
        profiles = {(arm, max(args.batch_sizes)): (StepProfiler(), collections.Counter()) for arm in PROFILE_ARMS}
    results, compilations = measure_decode(engine, prompts, args, profiles)
    latency = measure_grammar_latency(engine, prompts[0], args)
    result = make_result(results, latency, setup_ms, args, compilations)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result, args)
    if args.profile:  # with --json, on stderr: stdout stays one JSON object
        with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
            print_profile(profiles, results, max(args.batch_sizes), engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
