"""`jaxserve generate "prompt"` (also `python -m jaxserve.generate`): stream a continuation from the command line.

With no --model this is the embedded default model (SmolLM2-135M-Instruct). One prompt
streams to stdout as it is generated; several (--prompts-file, one per line) run as one
continuously batched batch and print as each finishes. A summary goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxserve.config_file import add_config_flag, parse_with_config
from jaxserve.flags import HelpFormatter, add_model_flags, model_engine_kwargs, start_devices
from jaxserve.logs import configure_logging, say_loading
from jaxserve.weights.default_model import DefaultModelMissing
from jaxserve.weights.hub import check_model_reference


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxserve.generate", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("prompt", nargs="?", help="the prompt (or use --prompts-file)")
    p.add_argument("--prompts-file", help="a file of prompts, one per line, run as one batch")
    p.add_argument("--model", help="Hugging Face folder, .gguf file or hub id (default: the embedded model)")
    p.add_argument("--max-tokens", type=int, help="tokens to generate (default 64, or the model's generation config)")
    p.add_argument("--temperature", type=float, help="0 is greedy (default 0, or the model's generation config)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int, help="0 is off")
    p.add_argument("--seed", type=int, default=None, help="the requests' seed: the same seed samples the same text")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument(
        "--no-special-tokens",
        action="store_true",
        help="do not add the tokenizer's special tokens (its BOS) to a plain prompt",
    )
    add_model_flags(p)
    p.add_argument(
        "--cache-dir",
        help="where converted weights and compiled programs are kept (default $JAXSERVE_CACHE or ~/.cache/jaxserve)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log loading and compilation")
    add_config_flag(p)
    args = parse_with_config(p, argv)
    if (args.prompt is None) == (args.prompts_file is None):
        p.error("give exactly one of a prompt or --prompts-file")
    return args


CLI_DEFAULTS = dict(max_tokens=64, temperature=0.0)  # greedy, unless the model's generation config says otherwise


def read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    if not Path(args.prompts_file).is_file():  # NOTE: argparse reads `--prompt TEXT` as --prompts-file TEXT
        raise SystemExit(
            f"error: --prompts-file {args.prompts_file!r} is not a file; "
            "to give one prompt, pass it as the last argument"
        )
    with open(args.prompts_file) as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise SystemExit(f"{args.prompts_file} has no prompts")
    return prompts


def buckets_for(prompt_lens: list[int], limit: int = 2048, tokens_per_seq: int = 1) -> tuple[int, ...]:
    """Just the programs this run needs: all prompts at once, and one token each (or one
    plus its draft tokens, with speculative decoding)."""
    from jaxserve.runner.model_runner import MIN_TOKENS

    def pow2(n):
        return max(MIN_TOKENS, 1 << (n - 1).bit_length())

    decode = {pow2(len(prompt_lens) * n) for n in {1, tokens_per_seq}}
    return tuple(sorted(decode | {min(pow2(sum(prompt_lens)), limit)}))


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging("info" if args.verbose else "warning", fmt="%(message)s")
    try:
        check_model_reference(args.model, args.revision)
        node = start_devices(args, args.tensor_parallel_size)  # before jax starts
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jaxserve.engine import EngineConfig, LLMEngine
    from jaxserve.engine.builder import enable_compilation_cache, load_mesh, node_fingerprint
    from jaxserve.engine.generation_config import read_generation_config
    from jaxserve.engine.tokenization import encode_chat, encode_prompt
    from jaxserve.parallel import multihost
    from jaxserve.runner.model_runner import PLAN_TYPES
    from jaxserve.weights import load_model
    from jaxserve.weights.dtype import resolve_dtype
    from jaxserve.weights.hub import resolve_model
    from scheduler import SamplingParams

    prompts = read_prompts(args)
    try:
        say_loading(args.model, args.cache_dir)
        enable_compilation_cache(args.cache_dir)
        model = resolve_model(args.model, args.revision)  # a hub id: downloaded
        loaded = load_model(
            model,
            dtype=resolve_dtype(args.dtype, model),
            cache_dir=args.cache_dir,
            progress=sys.stderr.isatty(),
            quantization=args.quantization,
            # weights straight into their shards
            mesh=load_mesh(model, args.tensor_parallel_size, expert_parallel=args.enable_expert_parallel),
            expert_parallel=args.enable_expert_parallel,
        )
        # A flag wins over the model's generation config, which wins over the CLI's defaults.
        flags = dict(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
        defaults = read_generation_config(loaded.source, args.generation_config).sampling
        params = SamplingParams(**{**CLI_DEFAULTS, **defaults, **{k: v for k, v in flags.items() if v is not None}})
        vocab = loaded.config.vocab_size
        if args.chat:
            prompt_ids = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p}], vocab)[1] for p in prompts]
        else:
            prompt_ids = [
                encode_prompt(loaded.tokenizer, p, vocab, add_special_tokens=not args.no_special_tokens)
                for p in prompts
            ]
    except (DefaultModelMissing, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lens = [len(ids) for ids in prompt_ids]
    spec = args.speculative_config
    buckets = buckets_for(lens, tokens_per_seq=1 + (spec.num_speculative_tokens if spec else 0))
    config = dict(
        max_num_seqs=len(prompts),
        max_num_batched_tokens=buckets[-1],
        token_buckets=buckets,
        # What the prompts need, within the model's own length (generation stops there)
        max_model_len=min(max(lens) + params.max_tokens + 1, loaded.config.max_position_embeddings),
        kv_cache_memory=256 << 20,
        **model_engine_kwargs(args),
    )
    if node is not None:  # every node reads the same prompts, so their programs match
        try:
            fingerprint = node_fingerprint(model, dtype=args.dtype, quantization=args.quantization, **config)
            node = multihost.connect(node, fingerprint)
        except multihost.DistError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    engine = LLMEngine(loaded, EngineConfig(**config), progress=sys.stderr.isatty())
    if isinstance(node, multihost.Follower):
        node.follow(engine.runner, PLAN_TYPES)  # node 0 schedules; this node runs its steps
        return 0
    if node is not None:
        node.lead(engine.runner, PLAN_TYPES)
    try:
        return run(engine, prompts, prompt_ids, params)
    finally:
        if node is not None:
            node.stop()


def run(engine, prompts: list[str], prompt_ids: list[list[int]], params) -> int:
    """Add the prompts, step until all are done and print them."""
    try:
        for i, ids in enumerate(prompt_ids):
            engine.add_request(str(i), ids, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    stream = len(prompts) == 1
    finished = []
    while engine.has_unfinished():
        for out in engine.step():
            if stream:
                print(out.outputs[0].new_text, end="", flush=True)
            elif out.finished:
                print(f"--- [{out.request_id}] {prompts[int(out.request_id)]!r}\n{out.outputs[0].text}", flush=True)
            if out.finished:
                finished.append(out)
    if stream:
        print(flush=True)
    print(summary(finished), file=sys.stderr)
    return 0


def summary(outputs) -> str:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = max(o.metrics.time_to_first_token for o in outputs)
    decode_tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    decode_time = max(o.metrics.last_token_time for o in outputs) - min(o.metrics.first_token_time for o in outputs)
    rate = decode_tokens / decode_time if decode_time > 0 else float("nan")
    return (
        f"prompt tokens: {prompt_tokens}, generated tokens: {generated}, "
        f"time to first token: {ttft * 1000:.0f} ms, decode: {rate:.1f} tokens/s"
    )


if __name__ == "__main__":
    sys.exit(main())
