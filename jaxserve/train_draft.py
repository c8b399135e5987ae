"""Train Medusa or EAGLE draft heads on the serving model's own outputs (self-distillation).

    python -m jaxserve.train_draft --method medusa --preset quick

1. The engine continues each prompt of `--prompts` (greedy by default): the heads learn
   what this target says, not what some dataset says, and the data costs no download.
2. One teacher-forced, paged prefill of the target over prompt + continuation records its
   last hidden states (`DecoderLM.hidden_states`, the serving code path).
3. optax AdamW with a cosine schedule trains the heads alone; the target is an argument of
   the loss, never in the optimizer, and never changes.
4. On the held-out prompts (every tenth), offline and greedy: at each continuation
   position, how many of k chained drafts match the target's own next tokens, for the
   heads and for n-gram prompt lookup on the same positions: mean acceptance length
   (accepted + 1) for k = 1..K.

Outputs (heads, info.json, loss.png, results.json) go to the cache directory, never git.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.extras import require_extra
from jaxserve.flags import HelpFormatter
from jaxserve.logs import configure_logging
from jaxserve.model.inputs import ModelInputs
from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.spec_decode.heads import (
    METHODS,
    EagleHead,
    MedusaHeads,
    make_heads,
    prefill_inputs,
    save_heads,
    trainable_attention,
)
from jaxserve.spec_decode.ngram import propose_ngram

# Shipped as package data (pyproject: [tool.setuptools.package-data]), so an installed wheel has it.
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "train_draft_prompts.jsonl"
TARGET_BLOCK = 16  # the target's pages while recording hidden states
EAGLE_CE_WEIGHT = 0.1  # EAGLE-1: feature regression plus 0.1 x token cross-entropy


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that decides a run's result (a cached run with equal settings is reused)."""

    method: str = "medusa"
    num_heads: int = 4  # Medusa heads, or EAGLE draft steps evaluated
    num_prompts: int = 1000  # at most, from the prompt file; every tenth is held out
    max_tokens: int = 96  # continuation length
    temperature: float = 0.0
    steps: int = 1000
    batch: int = 64  # Medusa: positions per step; EAGLE: batch // 32 whole sequences per step (at least 1)
    lr: float = 1e-3
    seed: int = 0


# quick, measured on 2 busy CPU cores with the default model and the shipped 201 prompts:
# generation ~5.5 min, target features ~2 min, training 0.5 s (Medusa) / 0.9 s (EAGLE) a
# step, evaluation < 1 min: ~17 min for Medusa, ~25 for EAGLE.
PRESETS = {
    "quick": Settings(),
    "long": Settings(max_tokens=256, steps=5000, batch=128),
}


@dataclasses.dataclass
class Corpus:
    """Prompt + continuation token ids, padded to one length, and the target's features."""

    tokens: np.ndarray  # int32 [N, L]
    lengths: np.ndarray  # int32 [N]: real tokens
    starts: np.ndarray  # int32 [N]: first continuation position
    features: np.ndarray  # f32 [N, L, D]: the target's last hidden state (pre-norm)

    def draft_positions(self) -> list[tuple[int, int]]:
        """(sequence, t) where the target has just produced x_{t+1} and x_{t+2} is known."""
        return [(n, t) for n in range(len(self.tokens)) for t in range(self.starts[n] - 1, self.lengths[n] - 2)]

    def subset(self, rows) -> Corpus:
        return Corpus(self.tokens[rows], self.lengths[rows], self.starts[rows], self.features[rows])


# -- data -------------------------------------------------------------------------------


def read_prompts(path: Path, tokenizer, vocab_size: int, limit: int) -> list[list[int]]:
    """Token ids of the file's prompts, through the chat template when the tokenizer has one."""
    from jaxserve.engine.tokenization import encode_chat, encode_prompt

    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or any("prompt" not in x for x in lines):
        raise ValueError(f"{path}: every line must be a JSON object with a 'prompt' field")
    texts = [x["prompt"] for x in lines[:limit]]
    if getattr(tokenizer, "chat_template", None):
        return [encode_chat(tokenizer, [{"role": "user", "content": p}], vocab_size)[1] for p in texts]
    return [encode_prompt(tokenizer, p, vocab_size) for p in texts]


def self_distill(loaded, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int) -> list[list[int]]:
    """The target's own continuations of `prompts`, by the serving engine."""
    from jaxserve.engine import EngineConfig, LLMEngine
    from scheduler import SamplingParams

    engine = LLMEngine(
        loaded,
        EngineConfig(
            max_num_seqs=32,
            max_num_batched_tokens=512,
            warm_up=False,
            max_model_len=min(max(map(len, prompts)) + max_tokens, loaded.config.max_position_embeddings),
        ),
    )
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i))
    done = {}
    with tqdm(total=len(prompts), desc="self-distillation", unit="prompt") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[int(out.request_id)] = out.outputs[0].token_ids
                    bar.update(1)
    return [done[i] for i in range(len(prompts))]


def record_features(model, prompts: list[list[int]], continuations: list[list[int]], batch: int = 8) -> Corpus:
    """Teacher-forced paged prefill of the target over prompt + continuation, `batch` sequences a call."""
    seqs = [p + c for p, c in zip(prompts, continuations)]
    length = -(-max(map(len, seqs)) // TARGET_BLOCK) * TARGET_BLOCK
    tokens = np.zeros((len(seqs), length), np.int32)
    for n, s in enumerate(seqs):
        tokens[n, : len(s)] = s
    batch = min(batch, len(seqs))
    inputs = prefill_inputs([length] * batch, length, TARGET_BLOCK)
    kv = allocate_kv_cache(model.cfg, 1 + batch * length // TARGET_BLOCK, TARGET_BLOCK, model.dtype)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, inputs, kv: nnx.merge(graphdef, state).hidden_states(inputs, kv)[0])
    features = np.zeros((len(seqs), length, model.cfg.hidden_size), np.float32)
    for lo in tqdm(range(0, len(seqs), batch), desc="target features", unit="batch"):
        rows = tokens[lo : lo + batch]
        ids = np.concatenate([rows, np.zeros((batch - len(rows), length), np.int32)]).reshape(-1)
        h = run(state, dataclasses.replace(inputs, input_ids=jnp.asarray(ids)), kv)
        features[lo : lo + batch] = np.asarray(h).reshape(batch, length, -1)[: len(rows)]
    return Corpus(
        tokens, np.array(list(map(len, seqs)), np.int32), np.array(list(map(len, prompts)), np.int32), features
    )


# -- losses -----------------------------------------------------------------------------


def medusa_batch(corpus: Corpus, positions: list[tuple[int, int]], k: int) -> dict:
    """Features h_t and head j's target x_{t+j+2} (mask: inside the sequence)."""
    n, t = np.array(positions).T
    offsets = t[None, :] + 2 + np.arange(k)[:, None]  # [k, P]
    mask = offsets < corpus.lengths[n][None, :]
    targets = corpus.tokens[n[None, :], np.minimum(offsets, corpus.tokens.shape[1] - 1)]
    return {"h": corpus.features[n, t], "targets": targets, "mask": mask.astype(np.float32)}


def medusa_loss(heads: MedusaHeads, target, batch: dict) -> jax.Array:
    ce = optax.softmax_cross_entropy_with_integer_labels(heads(target, batch["h"]), batch["targets"])
    return (ce * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1)


def eagle_batch(corpus: Corpus) -> dict:
    """Per position i: input (h_i, x_{i+1}), targets h_{i+1} (regression) and x_{i+2} (tokens
    the target produced), flattened over the sequences."""
    n, length = corpus.tokens.shape
    i = np.arange(length)[None, :]
    shift = lambda a, s: np.concatenate([a[:, s:], np.zeros_like(a[:, :s])], axis=1)  # noqa: E731
    lengths, starts = corpus.lengths[:, None], corpus.starts[:, None]
    return {
        "features": corpus.features.reshape(n * length, -1),
        "next_ids": shift(corpus.tokens, 1).reshape(-1),
        "next_features": shift(corpus.features, 1).reshape(n * length, -1),
        "next_next_ids": shift(corpus.tokens, 2).reshape(-1),
        "reg_mask": (i + 1 < lengths).reshape(-1).astype(np.float32),
        "ce_mask": ((i + 2 < lengths) & (i >= starts - 1)).reshape(-1).astype(np.float32),
    }


def eagle_loss(head: EagleHead, target, batch: dict, inputs, kv, attention=trainable_attention) -> jax.Array:
    f, _ = head(target, batch["features"], batch["next_ids"], inputs, kv, attention)
    reg = optax.huber_loss(f, batch["next_features"]).mean(-1)  # smooth L1 with delta 1
    ce = optax.softmax_cross_entropy_with_integer_labels(target.logits(f), batch["next_next_ids"])
    mean = lambda x, m: (x * m).sum() / jnp.maximum(m.sum(), 1)  # noqa: E731
    return mean(reg, batch["reg_mask"]) + EAGLE_CE_WEIGHT * mean(ce, batch["ce_mask"])


# -- training ---------------------------------------------------------------------------


def train_heads(heads, target, corpus: Corpus, settings: Settings) -> list[float]:
    """AdamW with warm-up and cosine decay on the heads' parameters alone; the loss per step."""
    rng = np.random.default_rng(settings.seed)
    if isinstance(heads, MedusaHeads):
        positions = corpus.draft_positions()
        loss_fn = medusa_loss
        next_batch = lambda: medusa_batch(  # noqa: E731
            corpus, [positions[i] for i in rng.integers(len(positions), size=settings.batch)], heads.num_heads
        )
    else:
        rows = max(1, settings.batch // 32)
        length = corpus.tokens.shape[1]
        inputs, kv = prefill_inputs([length] * rows, length), heads.allocate_kv(1 + rows * length, 1)
        loss_fn = lambda h, t, b: eagle_loss(h, t, b, inputs, kv, trainable_attention)  # noqa: E731
        next_batch = lambda: eagle_batch(corpus.subset(rng.integers(len(corpus.tokens), size=rows)))  # noqa: E731
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, settings.lr, max(1, settings.steps // 20), settings.steps, settings.lr * 0.05
    )
    opt = optax.adamw(schedule, weight_decay=0.0)
    head_def, params = nnx.split(heads, nnx.Param)
    target_def, target_state = nnx.split(target)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, target_state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(head_def, p), nnx.merge(target_def, target_state), batch)
        )(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    with tqdm(
        range(settings.steps), desc=f"training {'medusa' if isinstance(heads, MedusaHeads) else 'eagle'}", unit="step"
    ) as bar:
        for _ in bar:
            params, opt_state, loss = step(params, opt_state, target_state, next_batch())
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    nnx.update(heads, params)
    return losses


# -- acceptance -------------------------------------------------------------------------


def head_drafts(heads, target, corpus: Corpus, k: int) -> np.ndarray:
    """int32 [N, L, k]: the greedy chain of k drafts at every position t (guesses for x_{t+2} ...)."""
    head_def, state = nnx.split(heads)
    target_def, target_state = nnx.split(target)
    if isinstance(heads, MedusaHeads):
        # One sequence a call: the logits are k x L x vocab.
        run = jax.jit(lambda s, ts, h: jnp.argmax(nnx.merge(head_def, s)(nnx.merge(target_def, ts), h), -1).T)
        return np.stack([np.asarray(run(state, target_state, h)) for h in corpus.features])
    rows, length = 4, corpus.tokens.shape[1]
    chains = _chains(rows, length, k)
    run = jax.jit(
        lambda s, ts, batch: _eagle_chain_drafts(nnx.merge(head_def, s), nnx.merge(target_def, ts), batch, chains, k)
    )
    out = np.zeros((len(corpus.tokens), length, k), np.int32)
    for lo in range(0, len(corpus.tokens), rows):
        part = corpus.subset(slice(lo, lo + rows))
        pad = (rows - len(part.tokens)) * length
        batch = {
            key: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)])
            for key, v in eagle_batch(part).items()
            if key in ("features", "next_ids")
        }
        out[lo : lo + rows] = np.asarray(run(state, target_state, batch))[: len(part.tokens)]
    return out


class Chains(NamedTuple):
    """Pages (size 1) of one EAGLE draft chain per (sequence, t) over `rows` sequences of `length`."""

    t: np.ndarray  # [C]: the chain's last teacher-forced position
    tables: np.ndarray  # [C, length + k]: the sequence's pages of positions 0..t, then the chain's own
    private: np.ndarray  # [C, k - 1]: the chain's pages for positions t + 1 .. t + k - 1
    num_blocks: int


def _chains(rows: int, length: int, k: int) -> Chains:
    """Chains share the teacher-forced pages of their prefix and write only their own, so every
    position's chain is drafted in one batch of single-token steps (as serving drafts)."""
    c = rows * length
    base = 1 + np.arange(c).reshape(rows, length).repeat(length, axis=0)  # [C, length]: the sequence's pages
    private = 1 + c + np.arange(c * max(k - 1, 1)).reshape(c, -1)
    t = np.tile(np.arange(length), rows)
    col = np.arange(length + k)[None, :]
    own = np.take_along_axis(private, np.clip(col - t[:, None] - 1, 0, private.shape[1] - 1), axis=1)
    tables = np.where(col <= t[:, None], base[:, np.minimum(col[0], length - 1)], own)
    return Chains(t, tables, private, 1 + c + private.size)


def _eagle_chain_drafts(head: EagleHead, target, batch: dict, chains: Chains, k: int) -> jax.Array:
    """A teacher-forced pass over the sequences, then k - 1 single-token steps of every chain."""
    c, length = len(chains.t), chains.tables.shape[1] - k
    rows = c // length
    kv = head.allocate_kv(chains.num_blocks, 1)
    f, kv = head(target, batch["features"], batch["next_ids"], prefill_inputs([length] * rows, length), kv)
    drafts = [jnp.argmax(target.logits(f), -1)]
    for s in range(1, k):
        pos = chains.t + s
        # input_ids is unused: the head reads the drafted tokens as `next_ids`.
        inputs = ModelInputs.from_numpy(
            input_ids=np.zeros(c),
            positions=pos,
            slot_mapping=chains.private[:, s - 1],
            query_start_loc=np.arange(c + 1),
            seq_lens=pos + 1,
            block_tables=chains.tables,
            logits_indices=np.arange(c),
        )
        f, kv = head(target, f, drafts[-1], inputs, kv)
        drafts.append(jnp.argmax(target.logits(f), -1))
    return jnp.stack(drafts, -1).reshape(rows, length, k)


def ngram_drafts(corpus: Corpus, k: int, min_n: int = 2, max_n: int = 4) -> dict[tuple[int, int], list[int]]:
    """Prompt lookup at every draft position, over the tokens known there (x_0 .. x_{t+1})."""
    return {(n, t): propose_ngram(corpus.tokens[n, : t + 2], k, min_n, max_n) for n, t in corpus.draft_positions()}


def acceptance(corpus: Corpus, drafts, k: int, positions: list[tuple[int, int]] | None = None) -> list[float]:
    """Mean acceptance length (leading drafts equal to the target's tokens, + 1) for 1..k drafts
    over `positions` (default: all draft positions); `drafts[n, t]` is the chain at position t
    of sequence n."""
    matched = []
    for n, t in corpus.draft_positions() if positions is None else positions:
        chain, m = list(drafts[n, t]), 0
        while m < min(k, len(chain)) and t + m + 2 < corpus.lengths[n] and chain[m] == corpus.tokens[n, t + m + 2]:
            m += 1
        matched.append(m)
    matched = np.array(matched)
    return [float(1 + np.minimum(matched, j).mean()) for j in range(1, k + 1)]


# -- the command ------------------------------------------------------------------------


def run(settings: Settings, loaded, prompts: list[list[int]], out: Path | None, source: str) -> dict:
    """Distill, train, measure; save to `out` when given. The results table as a dict."""
    continuations = self_distill(loaded, prompts, settings.max_tokens, settings.temperature, settings.seed)
    corpus = record_features(loaded.model, prompts, continuations)
    held_out = np.arange(len(prompts)) % 10 == 9
    train, evaluate = corpus.subset(~held_out), corpus.subset(held_out)
    heads = make_heads(settings.method, loaded.config, settings.num_heads, seed=settings.seed)
    losses = train_heads(heads, loaded.model, train, settings)
    k = settings.num_heads
    results = {
        "k": list(range(1, k + 1)),
        "positions": len(evaluate.draft_positions()),
        settings.method: acceptance(evaluate, head_drafts(heads, loaded.model, evaluate, k), k),
        "ngram": acceptance(evaluate, ngram_drafts(evaluate, k), k),
        "first_loss": losses[0],
        "last_loss": float(np.mean(losses[-10:])),
    }
    if out is not None:
        info = {
            "method": settings.method,
            "num_heads": k,
            "target_source": source,
            "target_config": dataclasses.asdict(loaded.config),
            "settings": dataclasses.asdict(settings),
        }
        save_heads(out / "heads", heads, info)
        (out / "results.json").write_text(json.dumps({**results, "losses": losses}, indent=1))
        plot_losses(losses, out / "loss.png", f"{settings.method} on {Path(source).stem}")
    return results


def plot_losses(losses: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses)
    ax.set(xlabel="step", ylabel="loss", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(results: dict, method: str) -> str:
    rows = [f"{'k':>3} {method:>8} {'ngram':>8}"]
    rows += [f"{k:>3} {a:>8.3f} {b:>8.3f}" for k, a, b in zip(results["k"], results[method], results["ngram"])]
    return "\n".join(rows) + f"\n(mean acceptance length, accepted + 1, over {results['positions']} held-out positions)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxserve.train_draft", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: the embedded model)")
    p.add_argument("--preset", default="quick", choices=sorted(PRESETS), help="the settings the other flags override")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL, one {'prompt': ...} a line")
    p.add_argument("--out", type=Path, default=None, help="default: <cache>/draft_heads/<model>-<method>-<preset>")
    for field in ("num_heads", "num_prompts", "max_tokens", "steps", "batch", "seed"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="self-distillation sampling (0: greedy)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--force", action="store_true", help="retrain even if the output exists for these settings")
    args = p.parse_args(argv)
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(Settings)
        if f.name != "method" and getattr(args, f.name) is not None
    }
    for name, value in overrides.items():
        if value <= 0 and not (name in ("temperature", "seed") and value == 0):
            p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not args.prompts.is_file():
        p.error(f"--prompts {args.prompts}: no such file")
    args.settings = dataclasses.replace(PRESETS[args.preset], method=args.method, **overrides)
    return args


def default_out(model: str | None, method: str, preset: str) -> Path:
    """Where a run's heads go unless --out: the cache directory, never the repository."""
    from jaxserve.weights.load import default_cache_dir, resolve_source

    return default_cache_dir() / "draft_heads" / f"{Path(resolve_source(model)).stem}-{method}-{preset}"


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging("warning")  # its own bars and table say how it goes
    require_extra("matplotlib", "train", "python -m jaxserve.train_draft (loss.png)")
    from jaxserve.engine.builder import enable_compilation_cache
    from jaxserve.weights import load_model
    from jaxserve.weights.load import resolve_source

    source = str(resolve_source(args.model))
    out = args.out or default_out(args.model, args.method, args.preset)
    settings = args.settings
    info_file = out / "heads" / "info.json"
    if info_file.is_file() and (out / "results.json").is_file() and not args.force:
        info = json.loads(info_file.read_text())
        if info["settings"] == dataclasses.asdict(settings) and info["target_source"] == source:
            print(f"cached: {out} already holds heads trained with these settings (--force retrains)")
            print(format_table(json.loads((out / "results.json").read_text()), args.method))
            return 0
        print(f"{out} holds heads trained with other settings; retraining over them")
    enable_compilation_cache()
    loaded = load_model(args.model)
    prompts = read_prompts(args.prompts, loaded.tokenizer, loaded.config.vocab_size, settings.num_prompts)
    if len(prompts) < 10:
        print(
            f"error: {args.prompts} has {len(prompts)} prompts; at least 10 are needed (a tenth is held out)",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    results = run(settings, loaded, prompts, out, source)
    print(format_table(results, args.method))
    print(f"loss {results['first_loss']:.3f} -> {results['last_loss']:.3f}; heads, loss.png, results.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
