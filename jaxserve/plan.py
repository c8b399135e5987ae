"""`jaxserve plan` (also `python -m jaxserve.plan`): size the KV cache and find the roofline for a model on a device.

    jaxserve plan                                              # the default model on this CPU
    jaxserve plan --model ./Llama-3-8B --device h100 --dtype bfloat16 --context 8192
    jaxserve plan --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --head-dim 128 \\
        --intermediate 28672 --vocab 128256 --dtype float16 --device h200 -tp 4
    jaxserve plan --model ./Qwen3-30B-A3B --device h100 -tp 2 --enable-expert-parallel
    jaxserve plan --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --experts 8 --experts-per-token 2 \\
        --moe-intermediate 14336 --vocab 32000 --dtype bfloat16 --device h100   # a Mixtral-8x7B
    jaxserve plan --measure --plot roofline.png                # and check it on this machine

Prints the parameters (for a mixture of experts, in all and active per token), what the
weights and a token's K/V occupy, how many sequences of `--context`
tokens fit beside the weights, the decode step's time bound per batch size (bytes over
bandwidth against FLOPs over peak: see jaxserve.model.sizing), prefill times, what each
quantization and KV dtype changes, the bound on speculative decoding's speed-up, and
the engine flags for the chosen target (or, when not one sequence fits, why not). Known
devices' figures come from a table (`jaxserve.model.sizing.DEVICES`); the CPU's are
measured. `--measure` runs the engine's decode step over a batch sweep here and prints
measured tokens/s beside the bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from jaxserve.extras import require_extra
from jaxserve.flags import HelpFormatter, parse_bytes
from jaxserve.logs import configure_logging
from jaxserve.model.sizing import (
    DEVICES,
    GB,
    Device,
    KVPlan,
    Setup,
    activation_workspace,
    both_units,
    compute_dtype,
    plan_kv,
)
from jaxserve.model.weight_sizes import expected_distinct_experts, num_moe_layers, parameter_counts

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
INLINE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")
INLINE_MOE_FLAGS = ("experts", "experts_per_token", "moe_intermediate", "shared_expert_intermediate")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxserve.plan", description=__doc__, formatter_class=HelpFormatter)
    m = p.add_argument_group("the model: a folder, a .gguf file, a hub id, or inline dimensions")
    m.add_argument("--model", help="Hugging Face folder, .gguf file or hub id (default: the embedded model)")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--kv-heads", type=int)
    m.add_argument("--head-dim", type=int, help="default: hidden / heads")
    m.add_argument(
        "--intermediate", type=int, help="the dense MLP's (a mixture of experts: default --moe-intermediate)"
    )
    m.add_argument("--vocab", type=int)
    m.add_argument("--tied", action="store_true", help="inline: the LM head is the embedding table")
    m.add_argument("--experts", type=int, help="inline mixture of experts: experts per layer (E)")
    m.add_argument("--experts-per-token", type=int, help="inline: experts each token is routed to (top k)")
    m.add_argument("--moe-intermediate", type=int, help="inline: each expert's intermediate size")
    m.add_argument("--shared-expert-intermediate", type=int, help="inline: a shared expert's (Qwen2-MoE), 0: none")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weights and activations (default: float32 on the CPU, as the engine; bfloat16 elsewhere)",
    )
    p.add_argument("--quantization", choices=["none", "int4", "int8", "fp8", "gguf"], default="none")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "int8"], default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        "--tp",
        dest="tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel devices (figures are per device)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with -tp, each device holds E / tp experts whole instead of 1/tp of every expert",
    )
    d = p.add_argument_group("the device")
    d.add_argument(
        "--device", choices=["cpu", *DEVICES], help="figures from the table; cpu: measured here (default: this machine)"
    )
    d.add_argument("--memory", type=parse_bytes, help="override the device's memory (e.g. 80GB, 24GiB)")
    d.add_argument("--bandwidth", type=float, help="override the memory bandwidth, GB/s")
    d.add_argument("--peak-tflops", type=float, help="override the peak TFLOP/s of the compute dtype")
    t = p.add_argument_group("the target")
    t.add_argument("--context", type=int, default=4096, help="tokens per sequence (prompt + output)")
    t.add_argument(
        "--memory-budget",
        type=parse_bytes,
        help="memory for weights, activations and KV together (default: the device's memory)",
    )
    t.add_argument(
        "--kv-cache-memory-bytes",
        "--kv-cache-memory",
        dest="kv_cache_memory",
        type=parse_bytes,
        metavar="SIZE",
        help="memory for the KV cache alone, per device (the engine's flag)",
    )
    t.add_argument("--max-num-seqs", type=int, help="sequences to serve at once: the KV memory they need")
    t.add_argument("--max-num-batched-tokens", type=int, default=512, help="the largest step (activation workspace)")
    t.add_argument("--batches", type=_int_list, default=DEFAULT_BATCHES, help="decode batch sizes, e.g. 1,8,64")
    t.add_argument("--prompt-lens", type=_int_list, help="prefill prompt lengths (default: 128, 512, 2048, context)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--num-speculative-tokens", type=int, default=4)
    s.add_argument("--draft-cost", type=float, default=0.05, help="a draft step's time over a target decode step's")
    s.add_argument(
        "--acceptance-lengths",
        type=_float_list,
        default=(1.5, 2.0, 3.0, 4.0),
        help="mean tokens per verify step (accepted drafts + 1)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write everything printed as JSON")
    o.add_argument("--plot", metavar="PATH", help="write a roofline PNG of the batch sweep")
    o.add_argument(
        "--measure",
        action="store_true",
        help="run the engine's decode step over the batch sweep here and compare with the bound",
    )
    o.add_argument("--measure-context", type=int, default=128, help="prompt tokens per sequence in --measure")
    o.add_argument("--measure-steps", type=int, default=6, help="decode steps timed per batch size")
    args = p.parse_args(argv)
    inline = [f for f in (*INLINE_FLAGS, *INLINE_MOE_FLAGS) if getattr(args, f) is not None]
    if inline and args.model:
        p.error("give --model or inline dimensions, not both")
    optional = {"head_dim", "intermediate"} if args.experts else {"head_dim"}
    needed = INLINE_FLAGS + (INLINE_MOE_FLAGS[:3] if any(getattr(args, f) for f in INLINE_MOE_FLAGS) else ())
    missing = [f"--{f.replace('_', '-')}" for f in needed if f not in optional and getattr(args, f) is None]
    if inline and missing:
        p.error(f"inline dimensions need {', '.join(missing)} too")
    if args.experts and not 0 < args.experts_per_token <= args.experts:
        p.error(f"--experts-per-token {args.experts_per_token} must be in 1..--experts {args.experts}")
    if inline and args.measure:
        p.error("--measure runs a model: give --model (or nothing, for the default model)")
    if args.measure and args.device and args.device != default_device_name():
        p.error(f"--measure runs on this machine, which is not --device {args.device}")
    return args


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"give positive integers: {text!r}")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None


# -- inputs ----------------------------------------------------------------------------


def model_config(args):
    """(ModelConfig, a name for it) from the flags."""
    from jaxserve.model.config import ModelConfig

    if args.layers is not None:
        head_dim = args.head_dim or args.hidden // args.heads
        shared = args.shared_expert_intermediate or 0
        moe = (
            dict(
                num_experts=args.experts,
                num_experts_per_tok=args.experts_per_token,
                moe_intermediate_size=args.moe_intermediate,
                shared_expert_intermediate_size=shared,
            )
            if args.experts
            else {}
        )
        arch = "LlamaForCausalLM" if not moe else "Qwen2MoeForCausalLM" if shared else "MixtralForCausalLM"
        cfg = ModelConfig(
            arch,
            args.vocab,
            args.hidden,
            args.intermediate or args.moe_intermediate,
            args.layers,
            args.heads,
            args.kv_heads,
            head_dim,
            args.context,
            tie_word_embeddings=args.tied,
            **moe,
        )
        return cfg, f"inline ({args.layers} layers, {args.kv_heads} KV heads of {head_dim})"
    from jaxserve.weights.load import read_hf_config

    hf, source = read_hf_config(args.model)
    return ModelConfig.from_hf_dict(hf), source


def device_figures(args, dtype: str) -> Device:
    """The table's figures for --device (this machine's, measured, for cpu), then the overrides."""
    if args.device in DEVICES:
        device = DEVICES[args.device]
    else:
        device = measured_device([dtype])
    overrides = {}
    if args.memory:
        overrides["memory_bytes"] = args.memory
    if args.bandwidth:
        overrides["bandwidth"] = args.bandwidth * 1e9
    if args.peak_tflops:
        overrides["peak_flops"] = {**device.peak_flops, dtype: args.peak_tflops * 1e12}
    return dataclasses.replace(device, **overrides, source="flags") if overrides else device


def measured_device(dtypes) -> Device:
    """This machine: its memory, and its read bandwidth and matmul peaks measured now."""
    import os

    import jax

    from jaxserve.tools import roofs

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        memory = (dev.memory_stats() or {}).get("bytes_limit", 0)
    peaks = {}
    for dtype in dict.fromkeys(["float32", *dtypes]):
        try:
            peaks[dtype] = roofs.matmul_peak(dtype)
        except Exception:  # e.g. no fp8 matmul on this device: the 16-bit peak stands in (Device.peak_for)
            pass
    return Device(f"{dev.device_kind} (this machine)", memory, roofs.read_bandwidth(), peaks, "measured")


def default_device_name() -> str:
    """A known device if jax runs on one, else cpu (measured)."""
    import jax

    kind = jax.devices()[0].device_kind.lower()
    for name in DEVICES:
        if name.split("-")[0] in kind.replace(" ", ""):
            return name
    return "cpu"


# -- the plan --------------------------------------------------------------------------


def make_plan(args) -> dict:
    """Everything the tool prints, as plain data."""
    from jaxserve.model.kv_cache import resolve_kv_cache_dtype
    from jaxserve.model.quantization import QuantConfig

    cfg, source = model_config(args)
    args.device = args.device or default_device_name()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    quant = QuantConfig.for_method(args.quantization)
    if args.quantization == "gguf" and str(source).endswith(".gguf") and Path(source).is_file():
        from jaxserve.weights.gguf_reader import GGUFFile

        quant = GGUFFile(source).quant_config()  # each projection as loading keeps it
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype).name
    setup = Setup(cfg, dtype, quant, kv_dtype, args.tp, args.enable_expert_parallel and cfg.is_moe)
    device = device_figures(args, compute_dtype(dtype, quant))
    context = args.context
    budget = args.memory_budget or device.memory_bytes
    workspace = activation_workspace(
        cfg, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs or 256
    )
    weights_per_device = setup.device_weight_bytes
    params = parameter_counts(cfg)
    kv_memory = args.kv_cache_memory or max(0, budget - weights_per_device - workspace)
    kv = plan_kv(cfg, kv_dtype, context=context, block_size=args.block_size, memory_bytes=kv_memory, tp=args.tp)
    plan = {
        "model": {
            "source": source,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate": cfg.intermediate_size,
            "vocab": cfg.vocab_size,
            "tied_embeddings": cfg.tie_word_embeddings,
            "params_total": params.total,
            "params_active": params.active,
            **moe_summary(cfg),
        },
        "setup": {
            "dtype": dtype,
            "quantization": quant.label if quant else "none",
            "kv_cache_dtype": kv_dtype,
            "block_size": args.block_size,
            "tp": args.tp,
            "expert_parallel": setup.expert_parallel,
            "context": context,
        },
        "device": {
            "name": device.name,
            "source": device.source,
            "memory_bytes": device.memory_bytes,
            "bandwidth_bytes_s": device.bandwidth,
            "peak_flops": device.peak_flops,
        },
        "weights_bytes": setup.weight_bytes,
        "weights_bytes_per_device": weights_per_device,
        "kv": kv_summary(
            kv,
            budget=budget,
            workspace=workspace,
            from_budget=args.kv_cache_memory is None,
            sequences=args.max_num_seqs,
        ),
        "decode": [
            bound_row(setup.decode_bound(device, b, context), batch=b, **experts_read(cfg, b)) for b in args.batches
        ],
        "compute_bound_batch": setup.compute_bound_batch(device, context),
        "prefill": [
            bound_row(setup.prefill_bound(device, n), prompt_len=n)
            for n in args.prompt_lens or sorted({128, 512, 2048, context})
        ],
        "schemes": scheme_table(cfg, dtype, args, device, kv_memory if args.kv_cache_memory else budget - workspace),
        "speculative": [
            {
                "acceptance_length": a,
                "speedup": {
                    b: setup.speculative_speedup(
                        device,
                        batch=b,
                        context=context,
                        acceptance_length=a,
                        num_speculative_tokens=args.num_speculative_tokens,
                        draft_cost=args.draft_cost,
                    )
                    for b in (1, 8, 64)
                },
            }
            for a in args.acceptance_lengths
        ],
        "flags": engine_flags(args, setup, kv, workspace, budget),
        "not_modelled": [
            "tensor-parallel communication (all-reduces per layer)" if args.tp > 1 else "tensor-parallel communication",
            *(["expert parallelism's token dispatch (all-reduce or all-to-all)"] if setup.expert_parallel else []),
            *(["routing imbalance (experts read assume uniform routing)"] if cfg.is_moe else []),
            "kernel efficiency (the bound assumes the roofs)",
            "the host's time between steps",
            "activations' memory traffic",
        ],
    }
    return plan


def moe_summary(cfg) -> dict:
    """The mixture of experts' shape (nothing for a dense model)."""
    if not cfg.is_moe:
        return {}
    return {
        "experts": cfg.num_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "moe_intermediate": cfg.moe_intermediate_size,
        "shared_expert_intermediate": cfg.shared_expert_intermediate_size,
        "moe_layers": num_moe_layers(cfg),
    }


def experts_read(cfg, batch: int) -> dict:
    """A decode step's expected distinct experts per MoE layer, E * (1 - (1 - k/E) ** B)."""
    if not cfg.is_moe:
        return {}
    return {"experts_read": expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)}


def kv_summary(kv: KVPlan, *, budget: int, workspace: int, from_budget: bool, sequences: int | None) -> dict:
    return {
        "target_sequences": sequences,
        "target_bytes": sequences and sequences * kv.bytes_per_sequence,
        "bytes_per_token": kv.bytes_per_token,
        "bytes_per_sequence": kv.bytes_per_sequence,
        "memory_bytes": kv.nbytes,
        "num_blocks": kv.num_blocks,
        "tokens": kv.usable_tokens,
        "max_sequences": kv.max_sequences,
        "budget_bytes": budget if from_budget else None,
        "workspace_bytes": workspace if from_budget else None,
    }


def bound_row(bound, **key) -> dict:
    return {
        **key,
        "bytes": bound.bytes,
        "flops": bound.flops,
        "memory_ms": bound.memory_s * 1e3,
        "compute_ms": bound.compute_s * 1e3,
        "bound_ms": bound.seconds * 1e3,
        "tokens_per_s": bound.tokens_per_s,
        "bound_by": bound.bound_by,
    }


def scheme_table(cfg, dtype: str, args, device: Device, kv_memory: int) -> list[dict]:
    """Each weight scheme and KV dtype: what the weights, a token and the batch sweep cost
    (a scheme the model's shapes refuse, e.g. int4 with no group size dividing K, says why)."""
    from jaxserve.model.kv_cache import resolve_kv_cache_dtype
    from jaxserve.model.quantization import QuantConfig

    rows = []
    for method in ("none", "int4", "int8", "fp8"):
        quant = QuantConfig.for_method(method)
        for kv_name in ("auto", "fp8"):
            kv_dtype = resolve_kv_cache_dtype(kv_name, dtype).name
            setup = Setup(cfg, dtype, quant, kv_dtype, args.tp, args.enable_expert_parallel and cfg.is_moe)
            try:
                weights = setup.weight_bytes
            except ValueError as e:
                rows.append({"quantization": method, "kv_cache_dtype": kv_name, "unsupported": str(e)})
                continue
            left = kv_memory - (0 if args.kv_cache_memory else setup.device_weight_bytes)
            kv = plan_kv(
                cfg, kv_dtype, context=args.context, block_size=args.block_size, memory_bytes=max(0, left), tp=args.tp
            )
            rows.append(
                {
                    "quantization": method,
                    "kv_cache_dtype": kv_name,
                    "weights_bytes": weights,
                    "kv_bytes_per_token": setup.kv_bytes_per_token,
                    "max_sequences": kv.max_sequences,
                    "tokens_per_s": {b: setup.decode_bound(device, b, args.context).tokens_per_s for b in (1, 64)},
                }
            )
    return rows


def engine_flags(args, setup: Setup, kv: KVPlan, workspace: int, budget: int) -> dict:
    """The engine flags for the target: the KV memory for --max-num-seqs sequences of
    --context tokens, or what the budget leaves after weights and activations. No flags
    when that leaves no room for one sequence: `reason` says why."""
    seqs = args.max_num_seqs or kv.max_sequences
    if not seqs:
        return {"flags": {}, "memory_needed_bytes": None, "fits": False, "reason": no_fit_reason(args, setup, kv)}
    blocks = seqs * kv.blocks_per_sequence + 1  # and the null block
    kv_memory = blocks * kv.block_size * kv.bytes_per_token
    flags = {
        "--kv-cache-memory-bytes": f"{-(-kv_memory // 2**20)}MiB",  # rounded up, so the blocks fit
        "--max-num-seqs": seqs,
        "--max-model-len": args.context,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
        "--block-size": args.block_size,
        "--dtype": setup.dtype,
    }
    if args.tp > 1:
        flags["-tp"] = args.tp
    if setup.expert_parallel:
        flags["--enable-expert-parallel"] = True  # a switch: printed alone
    if args.kv_cache_dtype != "auto":
        flags["--kv-cache-dtype"] = args.kv_cache_dtype
    if args.quantization != "none":
        flags["--quantization"] = args.quantization
    needed = setup.device_weight_bytes + workspace + kv_memory
    return {"flags": flags, "memory_needed_bytes": needed, "fits": needed <= budget, "reason": None}


def no_fit_reason(args, setup: Setup, kv: KVPlan) -> str:
    """Why not one sequence of --context tokens fits, and what would change that."""
    one = both_units(kv.bytes_per_sequence)
    if args.kv_cache_memory is not None:
        why = f"--kv-cache-memory-bytes {both_units(args.kv_cache_memory)} is less than one sequence's KV ({one})"
    elif kv.nbytes == 0:
        why = "the weights and activations alone fill the memory: nothing is left for the KV cache"
    else:
        why = f"the memory left for the KV cache ({both_units(kv.nbytes)}) is less than one sequence's KV ({one})"
    return (
        f"not one sequence of {args.context:,} tokens fits: {why}; "
        "try -tp, --quantization, --kv-cache-dtype fp8 or a shorter --context"
    )


# -- printing --------------------------------------------------------------------------


def print_plan(plan: dict) -> None:
    m, st, dev, kv = plan["model"], plan["setup"], plan["device"], plan["kv"]
    print(
        f"model   {m['source']}: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads / "
        f"{m['kv_heads']} KV heads of {m['head_dim']}, vocab {m['vocab']}"
    )
    if "experts" in m:
        shared = f" + a shared expert of {m['shared_expert_intermediate']}" if m["shared_expert_intermediate"] else ""
        print(
            f"experts {m['experts']} of {m['moe_intermediate']} per MoE layer ({m['moe_layers']} of {m['layers']} "
            f"layers), top {m['experts_per_token']}{shared}"
        )
        print(f"params  {billions(m['params_total'])} in all, {billions(m['params_active'])} active per token")
    else:
        print(f"params  {billions(m['params_total'])}")
    print(
        f"setup   {st['dtype']}, weights {st['quantization']}, KV {st['kv_cache_dtype']}, blocks of "
        f"{st['block_size']}, tp {st['tp']}{', expert-parallel' if st['expert_parallel'] else ''}, "
        f"context {st['context']:,}"
    )
    peaks = ", ".join(f"{k} {v / 1e12:,.2f}" for k, v in dev["peak_flops"].items())
    print(
        f"device  {dev['name']} ({dev['source']}): {both_units(dev['memory_bytes'])}, "
        f"{dev['bandwidth_bytes_s'] / GB:,.1f} GB/s, peak TFLOP/s {peaks}"
    )
    print(
        f"\nweights        {both_units(plan['weights_bytes'])}"
        + (f", {both_units(plan['weights_bytes_per_device'])} per device" if st["tp"] > 1 else "")
    )
    per_device = " per device" if st["tp"] > 1 else ""
    print(f"KV per token   {kv['bytes_per_token']:,} bytes{per_device}")
    print(f"KV per seq     {both_units(kv['bytes_per_sequence'])} for {st['context']:,} tokens (whole blocks)")
    if kv["target_sequences"]:
        print(f"KV for {kv['target_sequences']:,} seqs {both_units(kv['target_bytes'])} (and one null block)")
    if kv["budget_bytes"] is not None and plan["weights_bytes_per_device"] >= kv["budget_bytes"]:
        print(
            f"KV memory      none: the weights alone exceed the budget {both_units(kv['budget_bytes'])} "
            "(try --tp or --quantization)"
        )
    elif kv["budget_bytes"] is not None:
        print(
            f"KV memory      {both_units(kv['memory_bytes'])}: the budget {both_units(kv['budget_bytes'])} "
            f"less weights and ~{both_units(kv['workspace_bytes'])} of activations"
        )
    else:
        print(f"KV memory      {both_units(kv['memory_bytes'])} ({kv['num_blocks']:,} blocks, the null block included)")
    print(
        f"fits           {kv['max_sequences']:,} sequences of {st['context']:,} tokens at once "
        f"({kv['tokens']:,} tokens in {max(0, kv['num_blocks'] - 1):,} usable blocks)"
    )

    print(f"\ndecode step bound at context {st['context']:,}: max(bytes / bandwidth, FLOPs / peak)")
    moe = "experts" in m
    if moe:
        e, k = m["experts"], m["experts_per_token"]
        print(
            f"experts read per MoE layer at batch B (uniform routing): E * (1 - (1 - k/E)^B) = "
            f"{e} * (1 - (1 - {k}/{e})^B); FLOPs use the active parameters"
        )
    columns = "bytes/step | GFLOP/step | memory ms | compute ms | tok/s bound | bound by |"
    print(f"| batch |{' experts read |' if moe else ''} {columns}")
    print(f"|---:|{'---:|' if moe else ''}---:|---:|---:|---:|---:|---|")
    for r in plan["decode"]:
        read = f" {r['experts_read']:,.1f} |" if moe else ""
        print(
            f"| {r['batch']} |{read} {both_units(r['bytes'])} | {r['flops'] / 1e9:,.1f} | {r['memory_ms']:,.3f} | "
            f"{r['compute_ms']:,.3f} | {r['tokens_per_s']:,.0f} | {r['bound_by']} |"
        )
    turn = plan["compute_bound_batch"]
    print(f"decode turns compute-bound at batch {turn:,}" if turn else "decode stays memory-bound")

    print("\nprefill of one prompt")
    print("| prompt tokens | ms bound | tok/s bound | bound by |\n|---:|---:|---:|---|")
    for r in plan["prefill"]:
        print(f"| {r['prompt_len']:,} | {r['bound_ms']:,.2f} | {r['tokens_per_s']:,.0f} | {r['bound_by']} |")

    print(f"\nweights and KV dtypes (context {st['context']:,})")
    print("| weights | KV | weights size | KV bytes/token | sequences fit | tok/s bound, batch 1 | batch 64 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in plan["schemes"]:
        if "unsupported" in r:
            print(f"| {r['quantization']} | {r['kv_cache_dtype']} | not possible: {r['unsupported']} | | | | |")
            continue
        print(
            f"| {r['quantization']} | {r['kv_cache_dtype']} | {both_units(r['weights_bytes'])} | "
            f"{r['kv_bytes_per_token']:,} | {r['max_sequences']:,} | {r['tokens_per_s'][1]:,.0f} | "
            f"{r['tokens_per_s'][64]:,.0f} |"
        )

    print("\nspeculative decoding: speed-up bound (acceptance length = accepted drafts + 1 per verify step)")
    print("| acceptance length | batch 1 | batch 8 | batch 64 |\n|---:|---:|---:|---:|")
    for r in plan["speculative"]:
        s = r["speedup"]
        print(f"| {r['acceptance_length']:g} | {s[1]:.2f}x | {s[8]:.2f}x | {s[64]:.2f}x |")

    f = plan["flags"]
    if f["reason"]:
        print(f"\nflags   none: {f['reason']}")
    else:
        flags = " ".join(k if v is True else f"{k} {v}" for k, v in f["flags"].items())
        verdict = "fits" if f["fits"] else "does NOT fit"
        print(
            f"\nflags   {flags}\n        needs {both_units(f['memory_needed_bytes'])} with weights and activations: "
            f"{verdict} in {both_units(plan['kv']['budget_bytes'] or plan['device']['memory_bytes'])}"
        )
    print(f"not modelled: {'; '.join(plan['not_modelled'])}")


def billions(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 10**8 else f"{n:,}"


def print_measured(rows: list[dict]) -> None:
    print(
        f"\nmeasured here: the engine's decode step (random prompts of {rows[0]['prompt']} tokens, the median of "
        f"{rows[0]['steps']} steps per batch; context: the sequences' mean while timed)"
    )
    print("| batch | context | step ms | measured tok/s | bound tok/s | measured / bound |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['context']} | {r['step_ms']:,.1f} | {r['tokens_per_s']:,.1f} | "
            f"{r['bound_tokens_per_s']:,.1f} | {r['ratio']:.2f} |"
        )


def plot(plan: dict, measured: list[dict] | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if measured:  # the roofs at the measured contexts, so the points and lines compare
        batches = [r["batch"] for r in measured]
        memory = [r["memory_roof_tokens_per_s"] for r in measured]
        compute = [r["compute_roof_tokens_per_s"] for r in measured]
        bound = [r["bound_tokens_per_s"] for r in measured]
        context = f"the measured contexts ({measured[0]['context']}-{measured[-1]['context']})"
    else:
        rows = plan["decode"]
        batches = [r["batch"] for r in rows]
        memory = [r["batch"] / r["memory_ms"] * 1e3 for r in rows]
        compute = [r["batch"] / r["compute_ms"] * 1e3 for r in rows]
        bound = [r["tokens_per_s"] for r in rows]
        context = f"context {plan['setup']['context']}"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(batches, memory, "--", color="tab:blue", label="memory roof (bytes / bandwidth)")
    ax.plot(batches, compute, "--", color="tab:red", label="compute roof (FLOPs / peak)")
    ax.plot(batches, bound, "-", color="k", lw=2, label="bound")
    if measured:
        ax.plot(
            batches,
            [r["tokens_per_s"] for r in measured],
            "o-",
            color="tab:green",
            label=f"measured (prompts of {measured[0]['prompt']})",
        )
        for r in measured:
            ax.annotate(
                f"{r['ratio']:.2f}",
                (r["batch"], r["tokens_per_s"]),
                textcoords="offset points",
                xytext=(0, -12),
                ha="center",
                fontsize=7,
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("tokens/s")
    ax.set_title(
        f"{Path(plan['model']['source']).name}, {plan['setup']['dtype']}, {context} on {plan['device']['name']}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_logging("warning")  # the plan is the output; --measure's model load stays quiet
    if args.plot:
        require_extra("matplotlib", "plot", "--plot")
    try:
        plan = make_plan(args)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print_plan(plan)
    measured = None
    if args.measure:
        from jaxserve.tools.plan_measure import measure_decode_sweep

        if plan["device"]["source"] != "measured":  # the table's roofs, checked here
            here = measured_device([compute_dtype(plan["setup"]["dtype"], None)])
            plan["measured_roofs"] = {"bandwidth_bytes_s": here.bandwidth, "peak_flops": here.peak_flops}
            peaks = ", ".join(f"{k} {v / 1e12:,.1f}" for k, v in here.peak_flops.items())
            print(f"\nmeasured roofs here: read {here.bandwidth / GB:,.0f} GB/s, peak TFLOP/s {peaks}")
        measured = measure_decode_sweep(args, plan)
        plan["measured"] = measured
        print_measured(measured)
    if args.plot:
        plot(plan, measured, args.plot)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(plan, indent=1, default=_jsonable))
        print(f"plan written to {args.json}")


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
