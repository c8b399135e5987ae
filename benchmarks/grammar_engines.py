"""Structured-output grammar engines, xgrammar against llguidance, on the default model's tokenizer.

Both engines constrain decoding the same way: compile a spec (a JSON schema, a regex, a
choice, a grammar) once, then per sequence a matcher follows the output tokens and fills
a packed bitmask of the allowed next tokens (int32 [ceil(V / 32)], bit j of word i:
token 32 * i + j). This measures, on SmolLM2's tokenizer (V = 49,152, read from the
embedded GGUF file the way the engine reads it), per case and engine:

- setup: the tokenizer info each engine builds once per tokenizer (printed apart);
- compile: the engine's own compile call, cold (a grammar it has not compiled before:
  xgrammar's cache is off, llguidance has none across compiles); median of `--repeat`,
  after one untimed compile of an unrelated grammar so no process start-up is counted.
  llguidance's compile is lazy (its lexer states are built as masks need them),
  xgrammar's is eager (it precomputes per-state token masks), hence the next column;
- 1st mask: the mask before the first token, on a matcher made right after the compile;
- mask mean / p99: the masks after each token of a valid output (its compact text
  tokenized by the tokenizer, fed token by token, up to the mask where EOS must be
  allowed), over all repeats, each repeat a fresh compile and matcher;
- warm mean / p99: the same output again on a second matcher of the same compiled
  grammar, all masks (a schema seen before: llguidance's copies reuse the lexer states
  the first matcher built).

JSON is compact in both (no free whitespace, "," and ":" separators) and schemas set
`additionalProperties: false` so neither engine's default for it matters. The grammar
case is written in each engine's dialect (Lark for llguidance, EBNF for xgrammar).

Validity is checked on every drive: each output token must be allowed by the mask before
it and accepted, and the matcher must end accepting, with EOS allowed. The two engines'
masks are also compared step by step (first repeat) and any difference is listed.

    .venv/bin/python benchmarks/grammar_engines.py [--repeat N] [--json PATH]

xgrammar is not a project dependency: `.venv/bin/pip install xgrammar`.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.weights.default_model import default_model_path
from jaxserve.weights.gguf_reader import GGUFFile
from jaxserve.weights.gguf_tokenizer import tokenizer_from_gguf


class Case(NamedTuple):
    name: str
    kind: str  # "json" | "regex" | "choice" | "grammar"
    spec: Any  # a schema dict, a regex, a list of strings, or {engine name: grammar text}
    output: Any  # a valid output: a JSON value (dumped compactly) or the text itself


def _obj(required: list[str], **properties) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_STR = {"type": "string"}
_ADDRESS = _obj(
    ["street", "city", "postcode", "country"],
    street=_STR,
    city=_STR,
    postcode=_STR,
    country={"type": "string", "minLength": 2, "maxLength": 2},
)

CASES = [
    Case(
        "flat, enums + bounded numbers",
        "json",
        _obj(
            [
                "product",
                "category",
                "condition",
                "rating",
                "price",
                "discount_percent",
                "in_stock",
                "currency",
                "weight_kg",
            ],
            product={"type": "string", "maxLength": 60},
            category={"enum": ["electronics", "books", "garden", "toys", "grocery", "clothing"]},
            condition={"type": "string", "enum": ["new", "used", "refurbished"]},
            rating={"type": "integer", "minimum": 1, "maximum": 5},
            price={"type": "number", "minimum": 0, "maximum": 10000},
            discount_percent={"type": "integer", "minimum": 0, "maximum": 90},
            in_stock={"type": "boolean"},
            currency={"enum": ["USD", "EUR", "GBP", "JPY"]},
            weight_kg={"type": "number", "minimum": 0, "maximum": 500},
        ),
        {
            "product": "Noise-cancelling over-ear headphones, black",
            "category": "electronics",
            "condition": "refurbished",
            "rating": 4,
            "price": 199.99,
            "discount_percent": 15,
            "in_stock": True,
            "currency": "EUR",
            "weight_kg": 0.35,
        },
    ),
    Case(
        "nested objects + arrays",
        "json",
        _obj(
            ["order_id", "customer", "items", "tags"],
            order_id=_STR,
            customer=_obj(["name", "email", "address"], name=_STR, email=_STR, address=_ADDRESS),
            items={
                "type": "array",
                "minItems": 1,
                "items": _obj(
                    ["sku", "quantity", "unit_price"],
                    sku=_STR,
                    quantity={"type": "integer", "minimum": 1},
                    unit_price={"type": "number"},
                ),
            },
            tags={"type": "array", "items": _STR, "maxItems": 5},
        ),
        {
            "order_id": "ORD-204817",
            "customer": {
                "name": "Maria Rossi",
                "email": "maria.rossi@example.com",
                "address": {"street": "Via Roma 12", "city": "Torino", "postcode": "10121", "country": "IT"},
            },
            "items": [
                {"sku": "KB-87-US", "quantity": 1, "unit_price": 89.5},
                {"sku": "MS-220", "quantity": 2, "unit_price": 24.99},
                {"sku": "USB-C-2M", "quantity": 3, "unit_price": 7.25},
            ],
            "tags": ["gift", "express"],
        },
    ),
    Case(
        "optional fields",
        "json",
        _obj(
            ["id", "username"],
            id={"type": "integer"},
            username=_STR,
            display_name=_STR,
            age={"type": "integer", "minimum": 0},
            bio=_STR,
            website=_STR,
            languages={"type": "array", "items": _STR},
            verified={"type": "boolean"},
            timezone=_STR,
        ),
        {
            "id": 48213,
            "username": "kzhang",
            "age": 34,
            "bio": "Backend engineer; likes compilers, climbing and bad puns.",
            "languages": ["en", "zh", "de"],
            "timezone": "Europe/Berlin",
        },
    ),
    Case(
        "$ref / $defs",
        "json",
        {
            "$defs": {
                "address": _ADDRESS,
                "person": _obj(["name", "address"], name=_STR, phone=_STR, address={"$ref": "#/$defs/address"}),
                "parcel": _obj(
                    ["weight_g", "fragile"], weight_g={"type": "integer", "minimum": 1}, fragile={"type": "boolean"}
                ),
            },
            **_obj(
                ["sender", "recipient", "parcels"],
                sender={"$ref": "#/$defs/person"},
                recipient={"$ref": "#/$defs/person"},
                parcels={"type": "array", "items": {"$ref": "#/$defs/parcel"}},
            ),
        },
        {
            "sender": {
                "name": "Ana Lima",
                "phone": "+351 912 345 678",
                "address": {"street": "Rua Augusta 100", "city": "Lisboa", "postcode": "1100-053", "country": "PT"},
            },
            "recipient": {
                "name": "Tom Berg",
                "address": {"street": "Storgatan 5", "city": "Uppsala", "postcode": "753 20", "country": "SE"},
            },
            "parcels": [{"weight_g": 1250, "fragile": False}, {"weight_g": 300, "fragile": True}],
        },
    ),
    Case(
        "regex, ISO 8601 date-time",
        "regex",
        r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
        r"(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})",
        "2026-12-02T13:12:07.123456+01:00",
    ),
    Case(
        "regex, e-mail",
        "regex",
        r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}",
        "jane.doe+newsletters@mail.example-university.co.uk",
    ),
    Case(
        "choice of 4",
        "choice",
        [
            "The customer is satisfied",
            "The customer is dissatisfied",
            "The customer is neutral",
            "Not enough information to decide",
        ],
        "The customer is dissatisfied",
    ),
    Case(
        "grammar, arithmetic",
        "grammar",
        {
            "llguidance": (
                "start: expr\n"
                'expr: term (("+" | "-") term)*\n'
                'term: factor (("*" | "/") factor)*\n'
                'factor: NUMBER | "(" expr ")" | "-" factor\n'
                "NUMBER: /[0-9]+(\\.[0-9]+)?/\n"
            ),
            "xgrammar": (
                "root ::= expr\n"
                'expr ::= term (("+" | "-") term)*\n'
                'term ::= factor (("*" | "/") factor)*\n'
                'factor ::= number | "(" expr ")" | "-" factor\n'
                'number ::= [0-9]+ ("." [0-9]+)?\n'
            ),
        },
        "(12.5+3)*(7-2)/4-((18*3.25)-(6/2))*2+100/(5+5)-(-3*(2+8))+0.125*(64-(3*7))",
    ),
]


def output_text(case: Case) -> str:
    return json.dumps(case.output, separators=(",", ":"), ensure_ascii=False) if case.kind == "json" else case.output


# Compact JSON (no free whitespace), as jaxserve/structured/llguidance.py asks llguidance for it.
LLGUIDANCE_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class LLGuidance:
    """llguidance: compile = build an `LLMatcher` (the prototype), a matcher = its deep copy."""

    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos: int):
        import llguidance.hf
        from llguidance import LLMatcher

        self.LLMatcher = LLMatcher
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=[eos])

    def compile(self, case: Case):
        M = self.LLMatcher
        if case.kind == "json":
            grammar = M.grammar_from_json_schema(case.spec, defaults=LLGUIDANCE_JSON_OPTIONS)
        elif case.kind == "regex":
            grammar = M.grammar_from_regex(case.spec)
        elif case.kind == "choice":
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in case.spec))
        else:
            grammar = M.grammar_from_lark(case.spec[self.name])
        matcher = M(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {case.name}: {matcher.get_error()}")
        return matcher

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, row: np.ndarray) -> None:
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def is_accepting(self, matcher) -> bool:
        return matcher.is_accepting()

    def is_terminated(self, matcher) -> bool:
        return matcher.is_stopped()


class XGrammar:
    """xgrammar: compile with a `GrammarCompiler` (cache off), a matcher = a `GrammarMatcher`."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, eos: int, max_threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, case: Case):
        c = self.compiler
        if case.kind == "json":
            # NOTE: any_whitespace=False alone gives ", " and ": "; compact needs the separators too.
            return c.compile_json_schema(json.dumps(case.spec), any_whitespace=False, separators=(",", ":"))
        if case.kind == "regex":
            return c.compile_regex(case.spec)
        if case.kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in case.spec))
        return c.compile_grammar(case.spec[self.name])

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, row: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(row)  # [1, words]; a numpy array is taken through DLPack

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def is_accepting(self, matcher) -> bool:
        return matcher.is_completed()

    def is_terminated(self, matcher) -> bool:
        return matcher.is_terminated()


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row.reshape(-1)[token // 32]) >> (token % 32)) & 1)


class Drive(NamedTuple):
    compile_s: float
    mask_s: list[float]  # [num_tokens + 1]: before each token, then the one where EOS must be allowed
    warm_mask_s: list[float]  # the same on a second matcher of the same compiled grammar
    masks: np.ndarray  # int32 [num_tokens + 1, words], the first matcher's
    problems: list[str]


def follow(engine, matcher, tokens: list[int], eos: int, masks: np.ndarray, problems: list[str]) -> list[float]:
    """Feed `tokens` then EOS to `matcher`, filling masks[i] before token i; the mask times.
    What goes wrong (a token refused, no EOS at the end) is appended to `problems`."""
    mask_s = []
    for i, token in enumerate(tokens + [eos]):
        start = time.perf_counter_ns()
        engine.fill(matcher, masks[i])
        mask_s.append((time.perf_counter_ns() - start) * 1e-9)
        if not allowed(masks[i], token):
            problems.append(f"token {i} ({token}) not in the mask")
        if token != eos and not engine.accept(matcher, token):
            problems.append(f"token {i} ({token}) refused")
            break
    if not engine.is_accepting(matcher):
        problems.append("not accepting at the end")
    if not engine.accept(matcher, eos) or not engine.is_terminated(matcher):
        problems.append("EOS refused at the end")
    return mask_s


def drive(engine, case: Case, tokens: list[int], eos: int, words: int) -> Drive:
    """Compile `case` cold, follow `tokens` with a new matcher, then with a second one (warm)."""
    masks = np.zeros((len(tokens) + 1, 1, words), np.int32)
    scratch = np.zeros_like(masks)
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        compiled = engine.compile(case)
        compile_s = time.perf_counter() - start
        problems = []
        mask_s = follow(engine, engine.new_matcher(compiled), tokens, eos, masks, problems)
        warm_mask_s = follow(engine, engine.new_matcher(compiled), tokens, eos, scratch, problems)
    finally:
        gc.enable()
    return Drive(compile_s, mask_s, warm_mask_s, masks[:, 0], problems)


def mask_differences(
    name_a: str, a: np.ndarray, name_b: str, b: np.ndarray, tokens: list[int], tokenizer, examples: int = 3
) -> list[str]:
    """How two engines' masks for the same steps differ: added (special) tokens apart, then a few
    steps where ordinary tokens differ, with the text so far and some tokens on each side."""
    added = np.zeros(a.shape[1] * 32, bool)
    added[list(tokenizer.added_tokens_decoder)] = True
    differ = np.flatnonzero((a != b).any(axis=1))
    if differ.size == 0:
        return []
    added_steps = {name_a: 0, name_b: 0}
    candidates = []  # (which sides allow ordinary tokens the other does not, step, line)
    for step in differ:
        bits_a = np.unpackbits(a[step].view(np.uint8), bitorder="little").astype(bool)
        bits_b = np.unpackbits(b[step].view(np.uint8), bitorder="little").astype(bool)
        only = {name_a: bits_a & ~bits_b, name_b: bits_b & ~bits_a}
        for name, bits in only.items():
            added_steps[name] += bool((bits & added).any())
        ordinary = {name: np.flatnonzero(bits & ~added) for name, bits in only.items()}
        if any(ids.size for ids in ordinary.values()):
            text = tokenizer.decode(tokens[:step])[-20:]
            sides = "; ".join(
                f"only {name}: {ids.size} {tokenizer.convert_ids_to_tokens(ids[:4].tolist())}"
                for name, ids in ordinary.items()
                if ids.size
            )
            kind = tuple(bool(ids.size) for ids in ordinary.values())
            candidates.append((kind, step, f"    step {step}, after {text!r}: {sides}"))
    first_of_kind = {}
    for kind, step, line in candidates:
        first_of_kind.setdefault(kind, (step, line))
    rest = [(step, line) for _, step, line in candidates if (step, line) not in first_of_kind.values()]
    chosen = sorted(list(first_of_kind.values()) + rest[: max(0, examples - len(first_of_kind))])
    head = (
        f"{differ.size} of {len(a)} steps differ; steps allowing added tokens (<|im_start|>, ...) only in "
        + ", ".join(f"{name}: {n}" for name, n in added_steps.items())
    )
    return [head] + [line for _, line in chosen]


def summarize(drives: list[Drive]) -> dict:
    later = np.array([s for d in drives for s in d.mask_s[1:]]) * 1e6
    warm = np.array([s for d in drives for s in d.warm_mask_s]) * 1e6
    return {
        "compile_ms": float(np.median([d.compile_s for d in drives]) * 1e3),
        "first_mask_us": float(np.median([d.mask_s[0] for d in drives]) * 1e6),
        "mask_mean_us": float(later.mean()),
        "mask_p99_us": float(np.percentile(later, 99)),
        "warm_mean_us": float(warm.mean()),
        "warm_p99_us": float(np.percentile(warm, 99)),
        "problems": sorted({p for d in drives for p in d.problems}),
    }


def geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


COLUMNS = [
    ("compile ms", "compile_ms", ".2f"),
    ("1st mask µs", "first_mask_us", ".1f"),
    ("mask mean µs", "mask_mean_us", ".1f"),
    ("mask p99 µs", "mask_p99_us", ".1f"),
    ("warm mean µs", "warm_mean_us", ".1f"),
    ("warm p99 µs", "warm_p99_us", ".1f"),
]


def print_table(results: list[dict]) -> None:
    head = [("case", 30), ("tokens", 6), ("engine", 10)] + [(title, len(title)) for title, _, _ in COLUMNS]
    print("| " + " | ".join(f"{t:<{w}}" for t, w in head) + " | valid |")
    print("|" + "|".join("-" * (w + 2) for _, w in head) + "|-------|")
    for r in results:
        cells = [f"{r['case']:<30}", f"{r['tokens']:>6}", f"{r['engine']:<10}"]
        cells += [f"{r[key]:>{len(title)}{fmt}}" for title, key, fmt in COLUMNS]
        print("| " + " | ".join(cells) + f" | {'yes' if not r['problems'] else 'NO':<5} |")
    for r in results:
        for problem in r["problems"]:
            print(f"INVALID {r['engine']} / {r['case']}: {problem}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5, help="cold compiles + drives per case and engine")
    p.add_argument("--xgrammar-threads", type=int, default=8, help="GrammarCompiler max_threads (its default: 8)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    try:
        import xgrammar  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"xgrammar is not installed ({e}); install it with:\n"
            "    .venv/bin/pip install xgrammar\n"
            "(it requires torch; if pip wants to replace the venv's torch, use --no-deps and add "
            "apache-tvm-ffi by hand)"
        ) from None
    tokenizer = tokenizer_from_gguf(GGUFFile(default_model_path()).field)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    words = (vocab + 31) // 32
    setup, engines = {}, []
    for make in (
        lambda: LLGuidance(tokenizer, vocab, eos),
        lambda: XGrammar(tokenizer, vocab, eos, args.xgrammar_threads),
    ):
        start = time.perf_counter()
        engine = make()
        setup[engine.name] = time.perf_counter() - start
        engine.compile(Case("warm-up", "regex", "[a-z]+@[a-z]+", "a@b"))  # process start-up, not timed
        engines.append(engine)
    versions = {e.name: version(e.name) for e in engines}
    print(
        f"default model tokenizer: {vocab} tokens, mask {words} int32 words, EOS {eos} "
        f"({tokenizer.convert_ids_to_tokens(eos)}); {os.cpu_count()} CPUs; --repeat {args.repeat}"
    )
    print(
        "tokenizer info, built once: "
        + ", ".join(f"{e.name} {versions[e.name]} {setup[e.name] * 1e3:.0f} ms" for e in engines)
        + f" (xgrammar compiler max_threads={args.xgrammar_threads})"
    )
    print()

    results, notes = [], []
    for case in CASES:
        tokens = tokenizer.encode(output_text(case), add_special_tokens=False)
        drives = {e.name: [drive(e, case, tokens, eos, words) for _ in range(args.repeat)] for e in engines}
        for name, ds in drives.items():
            results.append({"case": case.name, "engine": name, "tokens": len(tokens), **summarize(ds)})
        diffs = mask_differences(
            "llguidance", drives["llguidance"][0].masks, "xgrammar", drives["xgrammar"][0].masks, tokens, tokenizer
        )
        if diffs:
            notes += [f"{case.name}: {diffs[0]}"] + diffs[1:]
    print_table(results)
    print()
    print("masks, llguidance against xgrammar:")
    print("\n".join(notes) if notes else "identical at every step of every case")
    print()

    by = {(r["case"], r["engine"]): r for r in results}
    ratios = {
        key: [by[c.name, "xgrammar"][key] / by[c.name, "llguidance"][key] for c in CASES] for _, key, _ in COLUMNS
    }
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"vocab": vocab, "setup_s": setup, "versions": versions, "results": results, "ratios": ratios}, indent=2
            )
        )
    print(
        f"xgrammar / llguidance, geometric mean over {len(CASES)} cases [min-max] (>1: xgrammar slower): "
        + ", ".join(
            f"{title.rsplit(' ', 1)[0]} x{geomean(ratios[key]):.2f} [{min(ratios[key]):.2f}-{max(ratios[key]):.2f}]"
            for title, key, _ in COLUMNS
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
