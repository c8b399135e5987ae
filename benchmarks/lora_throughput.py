"""Throughput with 1, 4 and 16 LoRA adapters in the mix against the base model alone (issue 41).

The model is random float32 weights of the default model's shape (SmolLM2-135M: hidden 576,
30 layers, 49152 tokens; no download), and the adapters random rank-R PEFT folders on all
seven projections (q/k/v/o, gate/up/down), written with `write_peft_adapter`. Every
configuration serves the same N requests (P random prompt tokens, O output tokens each,
greedy, ignore_eos), all queued at once, request i with adapter i mod A:

    base       LoRA off: no slot stacks, the plain programs
    lora-0     --enable-lora --max-loras 1, every request on the base model (the cost of
               the LoRA path when no row uses it)
    lora-A     --enable-lora --max-loras A, A adapters in the mix (A = 1, 4, 16 by default)

The configurations alternate within every round (their order reversed every other round),
each engine compiled before the first. Reported per configuration: the median over rounds
of the wall time, output tokens/s, CPU time per output token (process time, all threads),
and the ratio of tokens/s to the base model's.

    python benchmarks/lora_throughput.py [--adapters 1,4,16] [--requests 32] [--rounds 3]
    python benchmarks/lora_throughput.py --smoke     # a tiny model, for a test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.moe_decode import hf_configs, random_model  # noqa: E402 (after the path)

BLOCK_SIZE = 16


def write_random_adapters(folder: Path, cfg, count: int, rank: int, seed: int) -> list[Path]:
    """`count` random PEFT adapters of `rank` on all seven projections of every layer."""
    from jaxserve.lora.peft_adapter import write_peft_adapter
    from jaxserve.model.lora import TARGET_MODULES, projection_shapes

    shapes = projection_shapes(cfg)
    rng = np.random.default_rng(seed)
    folders = []
    for i in range(count):
        weights = {
            (layer, module): (
                rng.standard_normal((rank, shapes[module][0]), np.float32) / shapes[module][0] ** 0.5,
                rng.standard_normal((shapes[module][1], rank), np.float32) / rank**0.5,
            )
            for layer in range(cfg.num_layers)
            for module in TARGET_MODULES
        }
        folders.append(write_peft_adapter(folder / f"adapter-{i}", weights, lora_alpha=2 * rank))
    return folders


def make_engine(loaded, args, adapters: int | None):
    """An engine for N requests at once; `adapters` None: LoRA off, else that many device slots."""
    from jaxserve.engine import EngineConfig, LLMEngine

    max_len = args.prompt_len + args.output_len
    lora = {} if adapters is None else dict(enable_lora=True, max_loras=max(adapters, 1), max_lora_rank=args.rank)
    return LLMEngine(
        loaded,
        EngineConfig(
            num_blocks=args.requests * -(-max_len // BLOCK_SIZE) + 1,
            max_num_seqs=args.requests,
            max_num_batched_tokens=args.prefill_tokens,
            max_model_len=max_len,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=False,  # every round computes every prompt
            **lora,
        ),
    )


def run_requests(engine, prompts, loras, args, tag: str) -> dict:
    """Queue every request, step until all are done: wall and CPU seconds, output tokens."""
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    wall, cpu = time.perf_counter(), time.process_time()
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"{tag}-{i}", prompt, params, lora_request=lora)
    outputs = engine.generate_all()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ids = {int(o.request_id.rsplit("-", 1)[1]): o.outputs[0].token_ids for o in outputs}
    tokens = sum(map(len, ids.values()))
    assert tokens == len(prompts) * args.output_len, f"{tokens} output tokens"
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "ids": [ids[i] for i in range(len(prompts))]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapters", default="1,4,16", help="adapter counts in the mix, comma-separated")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a tiny model and workload, for a test")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.prompt_len, args.output_len, args.prefill_tokens = 4, 8, 4, 32
        args.rank, args.rounds = 4, 1
    counts = [int(c) for c in args.adapters.split(",")]

    from jaxserve.lora.request import LoRARequest

    loaded = random_model(hf_configs("smoke" if args.smoke else "default", 8, 2)["dense"], seed=0)
    cfg = loaded.config
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_random_adapters(Path(tmp), cfg, max(counts), args.rank, seed=2)
        configs = {"base": (None, [None] * args.requests), "lora-0": (0, [None] * args.requests)}
        for count in counts:
            requests = [LoRARequest(f"a{i}", i + 1, str(folders[i])) for i in range(count)]
            configs[f"lora-{count}"] = (count, [requests[i % count] for i in range(args.requests)])
        engines, warm = {}, {}
        for name, (adapters, loras) in configs.items():
            print(f"compiling {name} ...", file=sys.stderr, flush=True)
            engines[name] = make_engine(loaded, args, adapters)
            warm[name] = run_requests(engines[name], prompts, loras, args, f"warm-{name}")["ids"]  # compiles
        # What is timed is what it claims: the LoRA path with no adapter in use gives the base
        # model's tokens, and a mix with adapters does not.
        assert warm["lora-0"] == warm["base"], "LoRA on, no adapter used: not the base model's tokens"
        for count in counts:
            assert warm[f"lora-{count}"] != warm["base"], f"{count} adapters changed no token"
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for r in range(args.rounds):
            order = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in order:
                runs[name].append(run_requests(engines[name], prompts, configs[name][1], args, f"r{r}-{name}"))
    rows = []
    for name, results in runs.items():
        wall = statistics.median(x["wall_s"] for x in results)
        rows.append(
            {
                "config": name,
                "adapters": configs[name][0],
                "wall_s": wall,
                "wall_spread_s": [min(x["wall_s"] for x in results), max(x["wall_s"] for x in results)],
                "tokens_per_s": results[0]["tokens"] / wall,
                "cpu_ms_per_token": 1e3 * statistics.median(x["cpu_s"] / x["tokens"] for x in results),
            }
        )
    base = rows[0]["tokens_per_s"]
    print(
        f"{args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output tokens), "
        f"rank {args.rank} on all seven projections, {args.rounds} rounds"
    )
    print(f"{'config':<10} {'wall s':>8} {'(spread)':>16} {'tok/s':>9} {'CPU ms/tok':>11} {'vs base':>8}")
    for row in rows:
        row["ratio_to_base"] = row["tokens_per_s"] / base
        lo, hi = row["wall_spread_s"]
        print(
            f"{row['config']:<10} {row['wall_s']:>8.2f} {f'({lo:.2f}-{hi:.2f})':>16} {row['tokens_per_s']:>9.1f} "
            f"{row['cpu_ms_per_token']:>11.2f} {row['ratio_to_base']:>8.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
