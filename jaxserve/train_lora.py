"""Train a LoRA adapter with the serving model's own code, and write it as a PEFT folder.

    python -m jaxserve.train_lora --data train.jsonl --out ./adapters/mine
    python -m api --enable-lora --lora-modules mine=./adapters/mine

`--data` is JSONL, one example a line: {"prompt": ..., "completion": ...}, or a chat
{"messages": [..., {"role": "assistant", "content": ...}]} rendered with the tokenizer's chat
template, the last assistant message the completion. The loss is the cross-entropy of the
completion's tokens (and the end-of-sequence token after them), the prompt's tokens masked.

The forward pass is the server's: the same decoder with its LoRA slot stacks
(jaxserve.model.lora), one slot, every token in it, over a paged prefill with a
differentiable attention (`trainable_attention`, as train_draft). `jax.grad` reaches only the
stacks; the base weights are an argument of the loss, never trained. A starts as PEFT
starts it (uniform in +-1/sqrt(d_in)) and B at zero, so step 0 is the base model. optax
AdamW with warm-up and cosine decay. The folder (adapter_config.json,
adapter_model.safetensors) loads in `peft` and in this server; loss.png and training.json
go beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.extras import require_extra
from jaxserve.flags import HelpFormatter
from jaxserve.logs import configure_logging
from jaxserve.model.lora import TARGET_MODULES, attach_lora

PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's own default for Llama-family models


@dataclasses.dataclass(frozen=True)
class Settings:
    rank: int = 8
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] = PEFT_DEFAULT_TARGETS
    steps: int = 200
    batch: int = 8  # examples a step
    lr: float = 2e-4
    max_len: int = 512  # tokens of prompt + completion; longer examples are cut (their completion's end)
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.rank  # peft's, without rsLoRA


@dataclasses.dataclass
class Examples:
    """Prompt + completion token ids, padded to one length, and which tokens are learned."""

    tokens: np.ndarray  # int32 [N, L]
    targets: np.ndarray  # float32 [N, L]: 1 where tokens[n, t + 1] is a completion token


# -- data -------------------------------------------------------------------------------


def read_examples(path: Path, tokenizer, vocab_size: int, max_len: int) -> Examples:
    """The file's examples as prompt and completion ids (see the module's docstring)."""
    from jaxserve.engine.tokenization import encode_chat, encode_prompt

    if tokenizer is None:
        raise ValueError("training on text needs the model's tokenizer; this model has none")
    eos = tokenizer.eos_token_id
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            example = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if isinstance(example, dict) and "messages" in example:
            messages = example["messages"]
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError(f"{where}: a chat example must end with an assistant message (the completion)")
            prompt = encode_chat(tokenizer, messages[:-1], vocab_size)[1]
            completion = messages[-1].get("content") or ""
        elif isinstance(example, dict) and {"prompt", "completion"} <= example.keys():
            prompt, completion = encode_prompt(tokenizer, example["prompt"], vocab_size), example["completion"]
        else:
            raise ValueError(f"{where}: expected {{'prompt', 'completion'}} or {{'messages'}}")
        ids = tokenizer.encode(completion, add_special_tokens=False) + ([eos] if eos is not None else [])
        if not ids:
            raise ValueError(f"{where}: the completion is empty")
        pairs.append((prompt, ids))
    if not pairs:
        raise ValueError(f"{path} holds no examples")
    length = min(max_len, max(len(p) + len(c) for p, c in pairs))
    tokens = np.zeros((len(pairs), length), np.int32)
    targets = np.zeros((len(pairs), length), np.float32)
    for n, (prompt, completion) in enumerate(pairs):
        seq = (prompt + completion)[:length]
        tokens[n, : len(seq)] = seq
        targets[n, len(prompt) - 1 : len(seq) - 1] = 1.0  # position t predicts token t + 1
    if not targets.any():
        raise ValueError(f"every prompt in {path} is longer than --max-len {max_len}: nothing to learn")
    return Examples(tokens, targets)


# -- the model --------------------------------------------------------------------------


def lora_model(loaded, settings: Settings):
    """The serving model with one LoRA slot (slot 1): A initialized as peft does, B zero."""
    from jaxserve.model.decoder import unstack_layers
    from jaxserve.model.lora import projection_shapes

    unknown = sorted(set(settings.target_modules) - set(TARGET_MODULES))
    if unknown or not settings.target_modules:
        raise ValueError(f"--target-modules: choose from {', '.join(TARGET_MODULES)} (got {unknown or 'none'})")
    model = unstack_layers(nnx.merge(*nnx.split(loaded.model)))  # our own modules (the same base arrays)
    attach_lora(model, max_loras=1, max_rank=settings.rank)
    shapes = projection_shapes(model.cfg)
    key = jax.random.key(settings.seed)
    for layer in model.layers:
        for module in settings.target_modules:
            key, sub = jax.random.split(key)
            d_in = shapes[module][0]
            bound = 1 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt(5)), peft's init of lora_A
            a = getattr(layer.lora, f"{module}_a")
            a[...] = a[...].at[1].set(jax.random.uniform(sub, (d_in, settings.rank), a.dtype, -bound, bound))
    return model


def completion_loss(model, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of the target tokens: tokens, targets [B, L], every token in slot 1."""
    from jaxserve.model.kv_cache import allocate_kv_cache
    from jaxserve.spec_decode.heads import prefill_inputs, trainable_attention

    rows, length = tokens.shape
    inputs = prefill_inputs([length] * rows, length)
    inputs = dataclasses.replace(inputs, input_ids=tokens.reshape(-1), lora_slots=jnp.ones(rows * length, jnp.int32))
    kv = allocate_kv_cache(model.cfg, 1 + rows * length, 1, model.dtype)
    hidden, _ = model.hidden_states(inputs, kv, trainable_attention)
    logits = model.logits(hidden)  # [B * L, V], float32
    labels = jnp.concatenate([tokens[:, 1:], jnp.zeros((rows, 1), tokens.dtype)], axis=1).reshape(-1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    mask = targets.reshape(-1)
    return (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def train(model, examples: Examples, settings: Settings) -> list[float]:
    """AdamW on the LoRA stacks alone; the loss of each step."""
    is_lora = nnx.All(nnx.Param, nnx.PathContains("lora"))
    graphdef, lora, rest = nnx.split(model, is_lora, ...)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, settings.lr, max(1, settings.steps // 20), settings.steps, settings.lr * 0.05
    )
    opt = optax.adamw(schedule, weight_decay=0.0)
    opt_state = opt.init(lora)

    @jax.jit
    def step(lora, opt_state, rest, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: completion_loss(nnx.merge(graphdef, p, rest), tokens, targets))(lora)
        updates, opt_state = opt.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    rng = np.random.default_rng(settings.seed)
    batch = min(settings.batch, len(examples.tokens))
    losses = []
    with tqdm(range(settings.steps), desc="training lora", unit="step") as bar:
        for _ in bar:
            rows = rng.choice(len(examples.tokens), size=batch, replace=False)
            tokens, targets = jnp.asarray(examples.tokens[rows]), jnp.asarray(examples.targets[rows])
            lora, opt_state, loss = step(lora, opt_state, rest, tokens, targets)
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    nnx.update(model, lora)
    return losses


def save_adapter(model, settings: Settings, out: Path, source: str) -> Path:
    """Slot 1 of the trained stacks as a PEFT folder (A and B in peft's orientation, B unscaled)."""
    from jaxserve.lora.peft_adapter import write_peft_adapter

    weights = {}
    for i, layer in enumerate(model.layers):
        for module in settings.target_modules:
            a = np.asarray(getattr(layer.lora, f"{module}_a")[1], np.float32)  # [d_in, r]
            b = np.asarray(getattr(layer.lora, f"{module}_b")[1], np.float32)  # [r, d_out], scaled
            weights[i, module] = (a.T, b.T / settings.scaling)
    return write_peft_adapter(out, weights, lora_alpha=settings.lora_alpha, base_model_name_or_path=source)


# -- the command ------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxserve.train_lora", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--data", type=Path, required=True, help="JSONL: {'prompt', 'completion'} or {'messages'} a line")
    p.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: the embedded model)")
    p.add_argument("--out", type=Path, default=None, help="default: <cache>/lora/<model>-<data file's name>")
    p.add_argument("--rank", type=int, default=Settings.rank)
    p.add_argument("--lora-alpha", type=float, default=Settings.lora_alpha)
    p.add_argument(
        "--target-modules",
        default=",".join(Settings.target_modules),
        help=f"comma-separated, of {','.join(TARGET_MODULES)}",
    )
    for name in ("steps", "batch", "max_len", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(Settings, name))
    p.add_argument("--lr", type=float, default=Settings.lr)
    args = p.parse_args(argv)
    for name in ("rank", "steps", "batch", "max_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.lr <= 0 or args.lora_alpha <= 0:
        p.error("--lr and --lora-alpha must be positive")
    args.settings = Settings(
        rank=args.rank,
        lora_alpha=args.lora_alpha,
        target_modules=tuple(m.strip() for m in args.target_modules.split(",") if m.strip()),
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        max_len=args.max_len,
        seed=args.seed,
    )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.data.is_file():
        print(f"error: --data {args.data}: no such file", file=sys.stderr)
        return 2
    configure_logging("warning")  # its own bar says how it goes
    require_extra("matplotlib", "train", "python -m jaxserve.train_lora (loss.png)")
    from jaxserve.engine.builder import enable_compilation_cache
    from jaxserve.train_draft import plot_losses
    from jaxserve.weights import load_model
    from jaxserve.weights.load import default_cache_dir, resolve_source

    settings = args.settings
    source = str(resolve_source(args.model))
    out = args.out or default_cache_dir() / "lora" / f"{Path(source).stem}-{args.data.stem}"
    enable_compilation_cache()
    loaded = load_model(args.model)
    try:
        examples = read_examples(args.data, loaded.tokenizer, loaded.config.vocab_size, settings.max_len)
        model = lora_model(loaded, settings)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{len(examples.tokens)} examples of up to {examples.tokens.shape[1]} tokens; "
        f"rank {settings.rank} on {', '.join(settings.target_modules)}"
    )
    losses = train(model, examples, settings)
    save_adapter(model, settings, out, source)
    plot_losses(losses, out / "loss.png", f"LoRA rank {settings.rank} on {args.data.name}")
    info = {"settings": dataclasses.asdict(settings), "base_model": source, "data": str(args.data), "losses": losses}
    (out / "training.json").write_text(json.dumps(info, indent=2))
    first, last = np.mean(losses[: max(1, len(losses) // 10)]), np.mean(losses[-max(1, len(losses) // 10) :])
    print(f"loss {first:.3f} -> {last:.3f}; wrote the PEFT adapter to {out}")
    print(f"serve it: python -m api --model {source} --enable-lora --lora-modules {out.name}={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
