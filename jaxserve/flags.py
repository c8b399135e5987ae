"""Command-line flags shared by `python -m jaxserve.generate` and `python -m api` (how the
model is loaded and run). Imports nothing heavy: `--help` stays quick."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from jaxserve.lora.request import LoRARequest
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.weights.sizes import parse_bytes  # noqa: F401 (the flags' size parser, kept here for callers)

BACKENDS = ["auto", "pallas", "cpu", "reference"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every jaxserve command's --help: the description as written, and each flag's default
    after its help. None shown where there is nothing to read (None, an off switch, "") or
    where the help says the default itself (one from the environment: a key stays unprinted)."""

    def _get_help_string(self, action):
        nothing = action.default is None or action.default is False or action.default == ""
        if nothing or re.search(r"\bdefault\b", action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--revision, --generation-config, --no-async-scheduling, --dtype, --quantization,
    --kv-cache-dtype, --attention-backend, --matmul-backend, --batch-invariant, --enforce-eager,
    --speculative-config, --tensor-parallel-size, --enable-expert-parallel, --expert-dispatch, --cpu-compute-cores,
    and the several-hosts flags (--nnodes, --node-rank, --dist-init-addr, --dist-timeout, ...)."""
    p.add_argument(
        "--revision",
        metavar="REV",
        help="a hub model's branch, tag or commit (default: main); the model may also name one GGUF file of a "
        "hub repository, as vLLM does: owner/name-GGUF:Q4_K_M (its quantization type) or owner/name-GGUF:FILE.gguf",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="'auto': the model's generation_config.json sets the defaults of sampling fields a request "
        "(or a flag) leaves unset; 'vllm': ignore them; or a folder holding a generation_config.json",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="the serial step loop: wait for each step's tokens before scheduling the next (debugging)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the weights' and activations' dtype; auto: the checkpoint's (config.json's "
        "torch_dtype; a GGUF file's 16-bit floats, else float16) on a GPU, float32 on the CPU",
    )
    p.add_argument(
        "--quantization",
        choices=["int4", "int8", "fp8", "gguf"],
        default=None,
        help="store the attention and MLP projections quantized: int4 or int8 (group-wise, from float "
        "weights), fp8 (W8A8 e4m3) or gguf (a GGUF file's own blocks: 4-bit ones as int4, Q8_0 as int8); "
        "default: as the checkpoint is",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "int8"],
        default="auto",
        help="store K and V in 8 bits (fp8 e4m3 or int8) with a scale per token and KV head: about "
        "1.9x the tokens of a bf16 cache (3.8x float32) in the same memory; auto: the model's dtype",
    )
    p.add_argument(
        "--attention-backend",
        choices=BACKENDS,
        default=None,
        help="the Mosaic GPU kernel (Hopper, bf16/f16 models), the C++ CPU kernel (float32/bf16 KV, "
        "built once with the system compiler) or the pure-JAX reference; default "
        "$JAXSERVE_ATTENTION_BACKEND or auto (the first of those that can run)",
    )
    p.add_argument(
        "--matmul-backend",
        choices=BACKENDS,
        default=None,
        help="quantized matmuls: the Mosaic GPU kernels (Hopper, bf16/f16 models) or the pure-JAX "
        "references; float models: the C++ CPU kernel for a tied LM head's decode products (cpu) "
        "or XLA's dot (reference); default $JAXSERVE_MATMUL_BACKEND or auto",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's logits and logprobs bit-identical whatever its batch mates, its place in the batch, "
        "chunked prefill, prefix hits or preemption: every product and attention sum through kernels in a "
        "fixed order (CPU: float models, float experts; Hopper GPU: bf16/f16 dense models, float, int4 or fp8; "
        "see docs/batch-invariance.md)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM's flag, here: compile no step programs at start-up (the warm-up over every token and row "
        "bucket); each compiles when a step first needs it. A quicker start, and a first request of each new "
        "shape that waits for the compiler (seconds; the persistent compilation cache keeps what was compiled)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        type=_speculative_config,
        help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}\' (draft_num_layers N: only its first N layers; no model: '
        'the target itself) or \'{"method": "medusa", "model": HEADS}\' (python -m jaxserve.train_draft; '
        'with "speculative_token_tree" a tree of candidates)',
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N devices (heads, MLP and vocabulary; the KV cache on its heads); "
        "--kv-cache-memory is then per device. On the CPU, jax is asked for N devices",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="vLLM's flag: a mixture of experts' experts are split whole over the --tensor-parallel-size "
        "devices (each holds E/N experts; N must divide E), each device runs its own experts' tokens; "
        "without it each expert is split like a dense MLP. Attention is split on heads either way",
    )
    p.add_argument(
        "--expert-dispatch",
        choices=("all-reduce", "all-to-all"),  # EngineConfig's EXPERT_DISPATCHES (not imported: jax would start)
        default="all-reduce",
        help="with --enable-expert-parallel, how tokens reach their experts: all-reduce (each device runs its "
        "experts on the whole batch's rows for them, one all-reduce combines; the faster as measured) or "
        "all-to-all (each device sends its share of the tokens to their experts' devices and back)",
    )
    p.add_argument(
        "--cpu-compute-cores",
        type=int,
        default=None,
        metavar="N",
        help="on the CPU, vLLM's split of the machine: jax's threads (the model's steps) on N cores of this "
        "process's, the host (scheduler, tokenizers, HTTP server) on the others. On a busy machine it spends "
        "less CPU per token; on an idle one the steps get fewer cores. Default: every thread on every core",
    )
    g = p.add_argument_group(
        "several hosts",
        "one model over N nodes (jaxserve.parallel.multihost): the same command on "
        "every node, each with its own --node-rank; --tensor-parallel-size counts every node's "
        "devices. Node 0 serves; the others follow it",
    )
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="how many nodes (hosts) hold the model")
    g.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank, 0 to N-1")
    g.add_argument("--dist-init-addr", metavar="HOST:PORT", help="node 0's address for jax.distributed's coordinator")
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="node 0 stops the group, saying which node, when a node misses its heartbeats this long",
    )
    g.add_argument(
        "--dist-step-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="node 0 stops the group, saying which node and step, when a node takes longer than this to finish "
        "a step (ten times as long for a step of a new shape, which compiles)",
    )
    g.add_argument(
        "--dist-key-file",
        metavar="PATH",
        help="a file holding the control channel's shared key, the same on every node (or set $JAXSERVE_DIST_KEY)",
    )


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags: --enable-lora, --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras."""
    g = p.add_argument_group("LoRA adapters", "PEFT adapters over the base model, many in one batch (docs/lora.md)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters: a request's `model` names one")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve, each a name (the `model` a request passes) and a PEFT folder "
        "(adapter_config.json + adapter_model.safetensors)",
    )
    g.add_argument("--max-loras", type=int, default=1, metavar="N", help="adapters on the device at once")
    g.add_argument("--max-lora-rank", type=int, default=16, metavar="R", help="the largest adapter rank served")
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        metavar="N",
        help="adapters kept read in host memory (default: --max-loras); others are read again when needed",
    )


def lora_engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the LoRA flags set."""
    return {
        "enable_lora": args.enable_lora,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
    }


def lora_requests(args: argparse.Namespace) -> list[LoRARequest]:
    """--lora-modules as LoRARequests, ids 1, 2, ... in the order given; a ValueError without --enable-lora."""
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = [name for name, _ in args.lora_modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: each adapter needs its own name, got {names}")
    return [LoRARequest(name, i, path) for i, (name, path) in enumerate(args.lora_modules, start=1)]


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def start_devices(args: argparse.Namespace, host_devices: int):
    """Before jax starts: with --nnodes > 1, join the other nodes in jax's runtime and return
    this node's jaxserve.parallel.multihost.DistConfig (connect to the others with
    `multihost.connect` once the engine's settings are known); else ask jax for `host_devices`
    CPU devices (see ensure_host_devices) and return None. A ValueError says what is wrong
    with the flags."""
    from jaxserve.parallel import multihost
    from jaxserve.parallel.devices import ensure_host_devices, pin_cpu_compute

    if args.nnodes <= 1:
        ensure_host_devices(host_devices)
        pin_cpu_compute(args.cpu_compute_cores)  # starts jax
        return None
    if args.cpu_compute_cores is not None:  # multihost.start starts jax before it could pin its threads
        raise ValueError("--cpu-compute-cores is for one node; with --nnodes leave it out")
    spec = args.speculative_config
    if spec is not None and spec.method != "ngram":
        raise ValueError(
            f"speculative decoding with {spec.method!r} runs its own programs, which do not go over "
            "several nodes yet; 'ngram' does"
        )
    config = multihost.DistConfig(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        init_addr=args.dist_init_addr,
        heartbeat_timeout=args.dist_timeout,
        step_timeout=args.dist_step_timeout,
        key=read_dist_key(args.dist_key_file),
    )
    multihost.start(config, args.tensor_parallel_size)
    return config


def read_dist_key(path: str | None) -> bytes:
    """The control channel's key: the file's contents, else $JAXSERVE_DIST_KEY (empty: none)."""
    from jaxserve.parallel.multihost import KEY_ENV

    if path is None:
        return os.environ.get(KEY_ENV, "").strip().encode()
    try:
        return Path(path).expanduser().read_bytes().strip()
    except OSError as e:
        raise ValueError(f"--dist-key-file: cannot read {path}: {e.strerror}") from None


def model_engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields those flags set."""
    return {
        "generation_config": args.generation_config,
        "async_scheduling": not args.no_async_scheduling,
        "kv_cache_dtype": args.kv_cache_dtype,
        "attention_backend": args.attention_backend,
        "matmul_backend": args.matmul_backend,
        "batch_invariant": args.batch_invariant,
        "warm_up": not args.enforce_eager,
        "speculative_config": args.speculative_config,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "expert_dispatch": args.expert_dispatch,
        "cpu_compute_cores": args.cpu_compute_cores,
    }


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
