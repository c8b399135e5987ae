"""`jaxserve serve [MODEL]` (also `python -m api`, `jaxserve-serve`): serve a model over the OpenAI API.

    jaxserve serve                                  # the embedded default model on 127.0.0.1:8000
    jaxserve serve ./Qwen3-0.6B --port 9000 --api-key secret --max-num-seqs 64 --kv-cache-memory-bytes 4GiB
    jaxserve serve Qwen/Qwen3-0.6B --revision main --config serve.yaml   # a hub id; flags from a YAML file
    python -m api --data-parallel-size 2 --tensor-parallel-size 2   # 2 replicas, on devices 0-1 and 2-3
    python -m api -tp 16 --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:29500  # node 1: --node-rank 1

With --port 0 the system picks a free port; the line `jaxserve: serving MODEL on URL` on
stdout says which (tests read it). Before anything loads, the port is tried, the model
path checked and the flags checked together: a mistake fails in a second, not after the
model has loaded and compiled.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys

from api.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_REQUEST_SEQUENCES, DEFAULT_TOKENIZER_POOL_SIZE
from api.replica_processes import REPLICA_ENV, die_with_parent
from api.router import add_router_flags
from jaxserve.config_file import add_config_flag, parse_with_config
from jaxserve.flags import (
    HelpFormatter,
    add_lora_flags,
    add_model_flags,
    lora_engine_kwargs,
    lora_requests,
    model_engine_kwargs,
    parse_bytes,
    start_devices,
)
from jaxserve.logs import configure_logging, say_loading
from scheduler import SamplingParams


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m api", usage="%(prog)s [MODEL] [flags]", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the same as --model (vLLM's `serve MODEL`)")
    p.add_argument("--model", help="Hugging Face folder, .gguf file or hub id (default: the embedded model)")
    add_config_flag(p)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the name(s) clients pass as `model`; responses report the first (default: from the model file)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="FOLDER",
        help="a folder with tokenizer.json to use instead of the model's (e.g. for weights without one)",
    )
    p.add_argument(
        "--chat-template", help="a chat template file, or the template text itself, used instead of the tokenizer's"
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a request's own chat_template (else such a request is a 400)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=SamplingParams.MAX_LOGPROBS,
        help=f"most logprobs/top_logprobs a request may ask for, at most {SamplingParams.MAX_LOGPROBS}",
    )
    p.add_argument("--host", default="127.0.0.1", help="the interface to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="vLLM's: requests without a seed draw theirs from a stream this seed starts, so the same requests "
        "sent to a fresh server in the same order sample the same text (default: seeds from the OS)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("JAXSERVE_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 (default: $JAXSERVE_API_KEY)",
    )
    p.add_argument("--max-num-seqs", type=int, default=32, help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of a step")
    p.add_argument(
        "--max-model-len",
        type=int,
        help="context length (default: the model's; one past the model's is refused; capped by the KV cache)",
    )
    p.add_argument(
        "--allow-long-max-model-len",
        action="store_true",
        help="accept a --max-model-len past the model's own (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): positions "
        "the model never saw give unreliable output (also: $JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN=1)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        "--kv-cache-memory",
        dest="kv_cache_memory",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="bytes for the KV cache per device, e.g. 1073741824, 512MiB, 4GiB (overrides "
        "--gpu-memory-utilization; default: 1GiB on the CPU, what --gpu-memory-utilization leaves on a GPU)",
    )
    p.add_argument(
        "--num-gpu-blocks-override",
        "--num-blocks",
        dest="num_blocks",
        type=int,
        metavar="N",
        help="KV-cache blocks (overrides --kv-cache-memory-bytes)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="vLLM's: the fraction of each GPU's memory (XLA's bytes_limit) the engine may use; the KV "
        "cache gets what the weights and the largest step leave, measured after a warm-up; with tensor "
        "parallelism every device is measured and the smallest budget wins (default 0.9 on a GPU; "
        "not on the CPU, which reports no memory: --kv-cache-memory sizes it there)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of a prompt prefix seen before",
    )
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS)
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="answer 503 when this many sequences wait beyond the free batch slots (default: no limit)",
    )
    p.add_argument(
        "--max-request-sequences",
        type=int,
        default=DEFAULT_MAX_REQUEST_SEQUENCES,
        help="most sequences (prompts x n) one request may ask for; more is a 400",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=f"{DEFAULT_MAX_REQUEST_BODY_BYTES >> 20}MiB",
        help="largest request body, e.g. 1MiB; larger is a 413",
    )
    add_model_flags(p)
    add_lora_flags(p)
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key when set); "
        "on by default where VLLM_ALLOW_RUNTIME_LORA_UPDATING is true, as in vLLM",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        metavar="M",
        help="M engine processes behind a router on this port, replica i on devices i*tp .. (i+1)*tp-1 (tp: "
        "--tensor-parallel-size); each call goes to one, by load and by the prompt's cached prefix; one that "
        "dies is restarted",
    )
    p.add_argument(
        "--engine-step-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="/health answers 503 while one engine step has run longer than this (a hung engine; a router "
        "in front then takes the server out of rotation)",
    )
    add_router_flags(p)  # with replicas: the router in front of them (api.router)
    g = p.add_argument_group(
        "prefill/decode disaggregation",
        "a prefill server hands each prompt's KV to a decode "
        "server (vLLM's kv_transfer_params; python -m api.router sends calls through both)",
    )
    g.add_argument(
        "--role",
        choices=["prefill", "decode"],
        default=None,
        help="this server's part (default: neither; it serves both phases itself)",
    )
    g.add_argument(
        "--kv-transfer-host",
        default="127.0.0.1",
        help="the interface the KV transfer server listens on",
    )
    g.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a prefill server keeps an offer this long; a decode server waits this long for a pull "
        "before computing the prompt itself",
    )
    g.add_argument(
        "--kv-transfer-secret",
        default=os.environ.get("JAXSERVE_KV_TRANSFER_SECRET"),
        help="a key shared by the prefill and decode servers: offers are signed and only signed ones "
        "are pulled (default $JAXSERVE_KV_TRANSFER_SECRET; without it a decode server trusts the "
        "kv_transfer_params it is sent)",
    )
    g.add_argument(
        "--kv-offer-memory",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="a prefill server's offers not yet pulled hold at most this much KV, e.g. 64MiB, on top of the "
        "KV cache; past it a prefill call is a 503 (default a quarter of the KV cache's bytes)",
    )
    g.add_argument(
        "--kv-transfer-url",
        default=None,
        metavar="URL",
        help="the base URL decode servers reach this prefill server at to claim its offers (default the "
        "address it binds; give one when that is not reachable from them, e.g. with --host 0.0.0.0)",
    )
    p.add_argument(
        "--cache-dir", help="converted weights and compiled programs (default $JAXSERVE_CACHE or ~/.cache/jaxserve)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="jaxserve's logs")
    p.add_argument("--no-access-log", action="store_true", help="do not log each HTTP request")
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no log line per generation request (its id, prompt size and sampling parameters)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens, the prompt tokens found in the prefix cache "
        "(off by default, as in vLLM: the count tells a caller whether others sent the same prefix)",
    )
    p.add_argument(
        "--tokenizer-pool-size",
        type=int,
        default=DEFAULT_TOKENIZER_POOL_SIZE,
        help="threads that tokenize prompts, so a huge one does not hold up small ones",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default when a request has tools): the model decides whether to call '
        "a tool, and --tool-call-parser reads the calls out of its text",
    )
    p.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), llama3_json, mistral, pythonic, "
        "or one a --tool-parser-plugin registers (default with --enable-auto-tool-choice: the one the chat "
        "template shows)",
    )
    p.add_argument(
        "--tool-parser-plugin",
        metavar="FILE",
        help="a Python file that registers tool-call parsers (api.tool_parsers.register_tool_parser)",
    )
    p.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help="split the model's thinking into reasoning_content: deepseek_r1 or qwen3",
    )
    p.add_argument(
        "--uvicorn-log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own log level (default: --log-level)",
    )
    p.add_argument(
        "--root-path", default="", help="the path prefix a proxy in front of the server strips (FastAPI's root_path)"
    )
    p.add_argument("--allowed-origins", type=json.loads, default='["*"]', help="CORS: a JSON list")
    p.add_argument("--allowed-methods", type=json.loads, default='["*"]', help="CORS: a JSON list")
    p.add_argument("--allowed-headers", type=json.loads, default='["*"]', help="CORS: a JSON list")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument(
        "--stats-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="log a stats line this often while serving (throughput, running, waiting, KV-cache usage, "
        "prefix-cache hit rate), when something happened since the last; 0: never (default 10)",
    )
    p.add_argument("--disable-log-stats", action="store_true", help="vLLM's: no stats line (--stats-interval 0)")
    args = parse_with_config(p, argv)
    if args.model_tag is not None:  # `serve MODEL`: the command line's --model may not say otherwise
        given = sys.argv[1:] if argv is None else argv
        if args.model not in (None, args.model_tag) and any(a.split("=")[0] == "--model" for a in given):
            p.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    return args


def main(argv=None) -> int:
    die_with_parent()  # a data-parallel replica's child process (api.replica_processes)
    args = parse_args(argv)
    if args.data_parallel_size < 1:
        print(f"error: --data-parallel-size must be at least 1, got {args.data_parallel_size}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)  # jaxserve's loggers at --log-level; jax's, orbax's at WARNING
    from jaxserve.weights.hub import check_model_reference

    try:
        if args.nnodes > 1 and args.data_parallel_size > 1:
            raise ValueError(
                "--data-parallel-size does not combine with --nnodes: one model spans the nodes. For "
                "replicas of a multi-node model, start each replica's nodes on their own and put "
                "python -m api.router --replica URL... (or vllm-router) in front of their node-0 servers"
            )
        if args.role and args.nnodes > 1:
            raise ValueError("--role does not combine with --nnodes yet")
        if args.role and not args.enable_prefix_caching:
            raise ValueError("--role hands KV over through the prefix cache: drop --no-enable-prefix-caching")
        check_reply_parsers(args)  # before the model loads: a misspelt name fails at once
        lora_requests(args)
        if args.allow_runtime_lora_updating and not args.enable_lora:
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
        if args.enable_lora and (args.data_parallel_size > 1 or args.nnodes > 1):
            raise ValueError("--enable-lora does not run with --data-parallel-size or --nnodes > 1 yet")
        check_model_reference(args.model, args.revision)
        if args.node_rank == 0 and args.port != 0:  # a busy port fails now, not after loading and compiling
            check_port_free(args.host, args.port)
        if args.data_parallel_size > 1:
            from api.replica_processes import serve_replicas

            return serve_replicas(args, list(sys.argv[1:] if argv is None else argv))
        node = start_devices(args, args.tensor_parallel_size)  # before jax starts
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from api.disagg import DisaggRole
    from api.server import create_app
    from jaxserve.engine import LLMEngine
    from jaxserve.engine.builder import node_fingerprint
    from jaxserve.engine.tokenization import read_chat_template
    from jaxserve.parallel import multihost
    from jaxserve.parallel.kv_transfer import KVTransfer
    from jaxserve.runner.model_runner import PLAN_TYPES
    from jaxserve.weights.default_model import DefaultModelMissing
    from jaxserve.weights.hub import parse_hub_reference, resolve_model

    engine_kwargs = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        allow_long_max_model_len=args.allow_long_max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        **model_engine_kwargs(args),
        **lora_engine_kwargs(args),
    )
    try:
        loras = lora_requests(args)
        hub_model = args.model and not os.path.exists(args.model) and parse_hub_reference(args.model)
        if args.served_model_name is None and hub_model:
            args.served_model_name = [args.model]  # as vLLM names it, not its download folder's name
        args.model = resolve_model(args.model, args.revision)
        chat_template = read_chat_template(args.chat_template) if args.chat_template else None
        engine_kwargs["device_ids"] = tuple(range(args.tensor_parallel_size))
        if node is not None:  # before the weights load: nodes that do not match stop at once
            fingerprint = node_fingerprint(
                args.model, dtype=args.dtype, quantization=args.quantization, **engine_kwargs
            )
            node = multihost.connect(node, fingerprint)
        say_loading(args.model, args.cache_dir)
        engine = LLMEngine.from_model(
            args.model,
            dtype=args.dtype,
            cache_dir=args.cache_dir,
            progress=sys.stderr.isatty(),
            quantization=args.quantization,
            tokenizer=args.tokenizer,
            **engine_kwargs,
        )
        if isinstance(node, multihost.Follower):
            print(f"jaxserve: node {args.node_rank} follows node 0 ({args.dist_init_addr})", flush=True)
            node.follow(engine.runner, PLAN_TYPES)
            return 0
        if node is not None:
            node.lead(engine.runner, PLAN_TYPES)
        disagg = None
        if args.role:
            transfer = KVTransfer(
                engine.mesh.devices.flat[0],
                host=args.kv_transfer_host,
                offer_timeout=args.kv_transfer_timeout,
                pull_timeout=args.kv_transfer_timeout,
                secret=args.kv_transfer_secret,
                max_offer_bytes=args.kv_offer_memory
                if args.kv_offer_memory is not None
                else engine.runner.kv.nbytes // 4,
            )
            disagg = DisaggRole(args.role, transfer, engine.config.block_size)
        cors = dict(
            allow_origins=args.allowed_origins,
            allow_methods=args.allowed_methods,
            allow_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
        )
        app = create_app(
            engine,
            model_name=args.served_model_name,
            lora_modules=loras,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            api_key=args.api_key,
            max_waiting=args.max_waiting,
            max_request_sequences=args.max_request_sequences,
            max_request_body_bytes=args.max_request_body_bytes,
            chat_template=chat_template,
            trust_request_chat_template=args.trust_request_chat_template,
            max_logprobs=args.max_logprobs,
            log_requests=not args.disable_log_requests,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            tokenizer_pool_size=args.tokenizer_pool_size,
            cors=cors,
            disagg=disagg,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            engine_step_timeout=args.engine_step_timeout,
            stats_interval=0.0 if args.disable_log_stats else args.stats_interval,
        )
    except (DefaultModelMissing, FileNotFoundError, ValueError, multihost.DistError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if node is not None:  # a lost node fails the requests in flight and turns /health to 503
        node.on_failure = app.state.server.engine_loop.fail
        app.state.server.engine_loop.explain_failure = lambda: node.wait_failure(multihost.FAILURE_WAIT)

    # Bind first, so --port 0 can report the port it got before serving.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    replica = os.environ.get(REPLICA_ENV)  # a child of --data-parallel-size: its parent says where it serves
    print(
        f"jaxserve: {f'replica {replica} ' if replica else ''}serving {app.state.server.model_name} on {url}",
        flush=True,
    )
    if disagg is not None:  # where decode servers claim this server's offers
        disagg.url = (args.kv_transfer_url or url).rstrip("/")
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level or args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=5,
        root_path=args.root_path,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        if node is not None:
            node.stop()
    if disagg is not None and disagg.transfer.live_pulls:
        # A pull that never returned would make Python abort on the way out (jaxserve.parallel.kv_transfer).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def check_port_free(host: str, port: int) -> None:
    """Bind the port as the server will, and let it go: an OSError naming the port when
    another process holds it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's bind: TIME_WAIT is no obstacle
    try:
        sock.bind((host, port))
    except OSError as e:
        raise OSError(
            f"cannot listen on {host}:{port}: {e.strerror} (another server on port {port}?); pick another "
            "--port, or --port 0 for any free one"
        ) from None
    finally:
        sock.close()


def check_reply_parsers(args: argparse.Namespace) -> None:
    """Load --tool-parser-plugin and check the parser names (a ValueError names the known ones)."""
    from api.reasoning import get_reasoning_parser
    from api.tool_parsers import get_tool_parser, load_tool_parser_plugin

    if args.tool_parser_plugin:
        load_tool_parser_plugin(args.tool_parser_plugin)
    if args.tool_call_parser:
        get_tool_parser(args.tool_call_parser)
    if args.reasoning_parser:
        get_reasoning_parser(args.reasoning_parser)


if __name__ == "__main__":
    sys.exit(main())
