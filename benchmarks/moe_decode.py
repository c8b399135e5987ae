"""A mixture-of-experts decode step on the CPU against the dense model of the same active size.

Two random models are built in this process (no download), with the default model's
attention and vocabulary (SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 KV heads, 49152
tokens, tied embeddings):

- moe:   Mixtral's layout (Llama attention, so the attention is the same), E experts of
         intermediate 768, top 2: the two active experts hold 1536 rows, the dense MLP's;
- dense: Llama, intermediate 1536 (SmolLM2-135M itself), run as served: its layers
         through the C++ layer kernels (jaxserve.runner.kernels.select_matmul);
- dense-xla: the same dense model with every layer on XLA (--matmul-backend reference):
         the MoE's layers run on XLA, so this is the like-for-like control.

Each runs the engine's decode step (LLMEngine.step, as `python -m jaxserve.plan --measure`)
at each batch, the models alternating within every round (their order reversed every
other round). Reported per batch: ms per step (the median over rounds of each round's
median; the spread of the round medians in brackets, the machine's noise), tokens/s, CPU
time per token (process time, all threads), the ratio to the dense model, and the ratio the
bytes read justify: per step the dense model reads its MLP once, the MoE its router and the
experts the batch touches, E * (1 - (1 - k/E)^B) per layer in expectation for B tokens
routed uniformly; both read the attention, the LM head and the same K/V.
`--profile` adds the device's time by model part (jaxserve.engine.profiling) for the MoE's
decode step at each batch.

    python benchmarks/moe_decode.py [--experts 8] [--batches 1,4,16,64] [--rounds 3] [--steps 8]
    python benchmarks/moe_decode.py --profile --json moe.json
    python benchmarks/moe_decode.py --smoke     # tiny models, for a test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The default model's shape (SmolLM2-135M) and a tiny one for --smoke.
SHAPES = {
    "default": dict(
        vocab_size=49152,
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        dense_intermediate=1536,
    ),
    "smoke": dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        dense_intermediate=96,
    ),
}
BLOCK_SIZE = 16


def hf_configs(shape: str, experts: int, top_k: int) -> dict[str, dict]:
    """The Hugging Face config dicts of the dense model and of the MoE of the same active size."""
    s = dict(SHAPES[shape])
    dense_intermediate = s.pop("dense_intermediate")
    if dense_intermediate % top_k:
        raise SystemExit(f"--top-k {top_k} does not divide the dense intermediate size {dense_intermediate}")
    common = dict(
        **s,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    dense = dict(common, architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=dense_intermediate)
    moe = dict(
        common,
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=dense_intermediate // top_k,  # each expert's
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )
    return {"dense": dense, "moe": moe}


def random_model(hf: dict, seed: int):
    """A LoadedModel of random float32 weights for the config dict `hf` (nnx's initializers)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.model.config import ModelConfig
    from jaxserve.model.decoder import DecoderLM
    from jaxserve.weights.load import LoadedModel

    cfg = ModelConfig.from_hf_dict(hf)
    model = DecoderLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    return LoadedModel(cfg, model, None, f"random {hf['architectures'][0]}", False, hf)


def param_counts(cfg) -> dict[str, int]:
    """Total parameters, and those one token reads (active: the router and top-k experts, not all E)."""
    d, layers = cfg.hidden_size, cfg.num_layers
    attention = d * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * d  # q, k, v, o; two norms
    embed = cfg.vocab_size * d + d  # tied: the LM head is the embedding table; the final norm
    if cfg.is_moe:
        expert = 3 * d * cfg.moe_intermediate_size
        router = d * cfg.num_experts
        total = embed + layers * (attention + router + cfg.num_experts * expert)
        active = embed + layers * (attention + router + cfg.num_experts_per_tok * expert)
    else:
        total = active = embed + layers * (attention + 3 * d * cfg.intermediate_size)
    return {"total": total, "active": active}


def expected_experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """E * (1 - (1 - k/E)^B): the distinct experts B tokens touch, each routed to k of E uniformly."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def step_bytes(cfg, batch: int, context: int) -> float:
    """Bytes a decode step of `batch` sequences at `context` tokens reads: weights (float32) and K/V."""
    d, layers = cfg.hidden_size, cfg.num_layers
    weights = param_counts(cfg)["active"]
    if cfg.is_moe:  # the experts touched rather than the top k
        touched = expected_experts_touched(cfg.num_experts, cfg.num_experts_per_tok, batch)
        weights += layers * (touched - cfg.num_experts_per_tok) * 3 * d * cfg.moe_intermediate_size
    kv = 2 * layers * cfg.num_kv_heads * cfg.head_dim * batch * context
    return 4.0 * (weights + kv)


def max_model_len(args) -> int:
    """Room for a prompt, the tokens a sequence decodes while the batch's other prompts are
    prefilled (at most one step per sequence), and the timed steps."""
    return args.context + max(args.batches) + args.steps + 4


def make_engine(loaded, args, matmul_backend: str | None):
    from jaxserve.engine import EngineConfig, LLMEngine

    max_len = max_model_len(args)
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    top = max(args.batches)
    # Each step has room for every decode and one whole prompt, so a batch is prefilled within
    # as many steps as it has sequences (hence max_model_len).
    prefill = top + args.context
    return LLMEngine(
        loaded,
        EngineConfig(
            num_blocks=top * blocks_per_seq + 1,
            max_num_seqs=top,
            max_num_batched_tokens=prefill,
            max_model_len=max_len,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=False,
            matmul_backend=matmul_backend,
            token_buckets=tuple(sorted(set(args.batches) | {prefill})),
        ),
    )


def time_decode(engine, batch: int, args, rng, profiler=None) -> dict:
    """`args.steps` decode steps of `batch` sequences with prompts of `args.context` random
    tokens, once every prompt is prefilled: median seconds per step, CPU seconds per token."""
    from scheduler.sampling_params import SamplingParams

    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=max_model_len(args) - args.context, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", rng.integers(3, vocab, args.context).tolist(), params)
    while any(not r.output_token_ids for r in engine.scheduler.requests.values()):
        engine.step()  # the prefills
    running = list(engine.scheduler.requests.values())
    assert len(running) == batch, f"{len(running)} of {batch} sequences running"
    if profiler is not None:
        engine.profiler = profiler
    times, cpu = [], time.process_time()
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    if profiler is not None:
        from jaxserve.engine.profiling import NullProfiler

        engine.profiler = NullProfiler()
    for req in running:
        engine.abort_request(req.request_id)
    engine.generate_all()
    return {"step_s": statistics.median(times), "cpu_s_per_token": cpu / (args.steps * batch)}


def summarize(runs: list[dict], batch: int) -> dict:
    """The median over rounds of the per-round figures, and the spread of the step times."""
    steps = [r["step_s"] for r in runs]
    step = statistics.median(steps)
    return {
        "step_ms": 1e3 * step,
        "step_ms_rounds": [1e3 * s for s in steps],
        "tokens_per_s": batch / step,
        "cpu_ms_per_token": 1e3 * statistics.median(r["cpu_s_per_token"] for r in runs),
    }


def run(args) -> dict:
    import numpy as np

    from jaxserve.model.config import ModelConfig

    configs = hf_configs(args.shape, args.experts, args.top_k)
    start = time.perf_counter()
    if args.moe_path == "grouped":  # every MoE step through the sorted grouped matmul (ragged_dot)
        from jaxserve.model import moe

        moe.EXPERT_LOOP_MAX_TOKENS = 0
    loaded = {name: random_model(configs[name.removesuffix("-xla")], 0) for name in args.models}
    backends = {"moe": None, "dense": None, "dense-xla": "reference"}
    engines = {name: make_engine(m, args, backends[name]) for name, m in loaded.items()}
    print(f"models built and compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    cfgs = {name: ModelConfig.from_hf_dict(hf) for name, hf in configs.items()}
    rng = np.random.default_rng(0)
    raw: dict[tuple[str, int], list[dict]] = {(n, b): [] for n in engines for b in args.batches}
    order = list(engines)
    for r in range(args.rounds):
        for batch in args.batches:
            for name in order if r % 2 == 0 else order[::-1]:
                raw[name, batch].append(time_decode(engines[name], batch, args, rng))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for batch in args.batches:
        row = {"batch": batch, **{name: summarize(raw[name, batch], batch) for name in engines}}
        dense_bytes = step_bytes(cfgs["dense"], batch, args.context)
        for name in ("dense", "dense-xla"):
            if "moe" in row and name in row:
                row[f"moe_over_{name}"] = row["moe"]["step_ms"] / row[name]["step_ms"]
        row["experts_touched"] = expected_experts_touched(args.experts, args.top_k, batch)
        row["bytes_ratio"] = step_bytes(cfgs["moe"], batch, args.context) / dense_bytes
        rows.append(row)
    result = {
        "shape": args.shape,
        "experts": args.experts,
        "top_k": args.top_k,
        "context": args.context,
        "steps": args.steps,
        "rounds": args.rounds,
        "moe_path": args.moe_path,
        "params": {name: param_counts(cfgs[name]) for name in ("moe", "dense")},
        "backends": {name: e.matmul_backend for name, e in engines.items()},
        "rows": rows,
    }
    if args.profile and "moe" in engines:
        result["moe_profile"] = profile(engines["moe"], args, rng)
    return result


def profile(engine, args, rng) -> dict[int, dict[str, float]]:
    """The MoE's decode step by model part (ms per step, jax profiler) at each batch."""
    from jaxserve.engine.profiling import StepProfiler, device_breakdown

    parts = {}
    for batch in args.batches:
        profiler = StepProfiler()
        time_decode(engine, batch, args, rng, profiler)
        (shape, _count), *_ = profiler.shapes.most_common(1)
        parts[batch] = device_breakdown(engine.runner, profiler.examples[shape], repeats=3)
    return parts


def print_result(result: dict) -> None:
    p = result["params"]
    print(
        f"MoE: {result['experts']} experts, top {result['top_k']}, Mixtral layout; dense: Llama; "
        f"{result['shape']} shape, float32, prompts of {result['context']} tokens, "
        f"{result['steps']} decode steps x {result['rounds']} rounds; MoE experts path: {result['moe_path']}"
    )
    for name in ("moe", "dense"):
        print(
            f"  {name:<5} params: total {p[name]['total'] / 1e6:.1f} M, "
            f"active per token {p[name]['active'] / 1e6:.1f} M"
        )
    print(f"  matmul backends: {result['backends']}")
    names = [n for n in ("dense", "dense-xla", "moe") if n in result["rows"][0]]
    print("| batch | model     | ms/step (round spread) | tokens/s | CPU ms/token | MoE / this | bytes justify |")
    print("|------:|-----------|------------------------|---------:|-------------:|-----------:|--------------:|")
    for row in result["rows"]:
        for name in names:
            r = row[name]
            spread = f"{r['step_ms']:.1f} ({min(r['step_ms_rounds']):.1f}-{max(r['step_ms_rounds']):.1f})"
            ratio = row.get(f"moe_over_{name}")
            justify = f"{row['bytes_ratio']:.2f}" if name == "moe" else ""
            print(
                f"| {row['batch']:>5} | {name:<9} | {spread:>22} | {r['tokens_per_s']:>8.1f} | "
                f"{r['cpu_ms_per_token']:>12.2f} | {f'{ratio:.2f}' if ratio else '':>10} | {justify:>13} |"
            )
    print(
        "bytes justify: the MoE's bytes per step over the dense model's (weights and K/V; experts touched "
        + ", ".join(f"B={r['batch']}: {r['experts_touched']:.2f}" for r in result["rows"])
        + ")"
    )
    for batch, parts in result.get("moe_profile", {}).items():
        from jaxserve.engine.profiling import breakdown_table

        print()
        print(breakdown_table(parts, f"MoE decode step, batch {batch}, by model part (jax profiler):"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--batches", default="1,4,16,64", help="decode batch sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all batches and models, alternated")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch, model and round")
    p.add_argument("--context", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--models", default="dense,dense-xla,moe", help="which of dense, dense-xla and moe to run")
    p.add_argument(
        "--moe-path",
        choices=["auto", "grouped"],
        default="auto",
        help="auto: as served (moe.run_touched_experts for few tokens); grouped: always the grouped matmul",
    )
    p.add_argument("--profile", action="store_true", help="the MoE's step by model part at each batch")
    p.add_argument("--smoke", action="store_true", help="tiny models (2 layers), 1 round, 2 steps")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.models = args.models.split(",")
    if unknown := set(args.models) - {"dense", "dense-xla", "moe"}:
        p.error(f"--models: unknown {', '.join(sorted(unknown))}")
    args.shape = "smoke" if args.smoke else "default"
    if args.smoke:
        args.rounds, args.steps, args.context = 1, 2, 8
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_result(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
