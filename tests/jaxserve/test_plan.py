"""`python -m jaxserve.plan` and `jaxserve.model.sizing` against numbers we did not compute with them:
the lesson's worked KV-cache figures, the bytes the engine's arrays really hold, and the
ridge point of a data sheet."""

import json
import logging

import pytest

from jaxserve import plan as plan_cli
from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.model.sizing import DEVICES, GiB, Setup
from jaxserve.weights import load_model
from tests.tiny_models import make_tiny_model

LLAMA_70B = [
    "--layers",
    "80",
    "--hidden",
    "8192",
    "--heads",
    "64",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--intermediate",
    "28672",
    "--vocab",
    "128256",
    "--dtype",
    "float16",
    "--device",
    "h100",
]


def make(argv):
    return plan_cli.make_plan(plan_cli.parse_args(argv))


def test_the_lessons_kv_numbers():
    """80 layers, 8 KV heads of 128, fp16: 327,680 bytes per token, 2.5 GiB per 8k
    sequence, 80 GiB for 32 of them, 8x that without GQA."""
    kv = make([*LLAMA_70B, "--context", "8192", "--max-num-seqs", "32"])["kv"]
    assert kv["bytes_per_token"] == 327_680
    assert kv["bytes_per_sequence"] == 2.5 * GiB
    assert kv["target_bytes"] == 80 * GiB
    mha = make([*LLAMA_70B[:6], "--kv-heads", "64", *LLAMA_70B[8:], "--context", "8192"])["kv"]
    assert mha["bytes_per_token"] == 8 * 327_680 and mha["bytes_per_sequence"] == 20 * GiB


def test_the_lessons_sequences_that_fit():
    """16 GiB of KV, 4k-token sequences of 1.25 GiB each: 12 whole ones (12.8)."""
    kv = make([*LLAMA_70B, "--context", "4096", "--kv-cache-memory", "16GiB"])["kv"]
    assert kv["bytes_per_sequence"] == 1.25 * GiB
    assert kv["max_sequences"] == 12


def test_units_are_explicit(capsys):
    plan_cli.print_plan(make([*LLAMA_70B, "--context", "8192"]))
    out = capsys.readouterr().out
    assert "2.68 GB (2.50 GiB)" in out  # one 8k sequence, both ways
    assert "327,680 bytes" in out


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8"])
@pytest.mark.parametrize("memory", ["1234567", "3MiB"])
def test_predicted_kv_bytes_are_what_the_engine_allocates(tiny_llama_dir, tiny_llama, kv_dtype, memory):
    """The plan's cache for --kv-cache-memory against the nbytes of the arrays the engine
    allocates for the same flag (null block and whole blocks included)."""
    p = make(
        [
            "--model",
            str(tiny_llama_dir),
            "--device",
            "h100",
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            kv_dtype,
            "--kv-cache-memory",
            memory,
            "--block-size",
            "8",
            "--context",
            "100",
        ]
    )
    eng = LLMEngine(
        tiny_llama,
        EngineConfig(
            kv_cache_memory=plan_cli.parse_bytes(memory),
            block_size=8,
            kv_cache_dtype=kv_dtype,
            max_model_len=100,
            warm_up=False,
        ),
    )
    assert p["kv"]["memory_bytes"] == eng.runner.kv.nbytes
    assert p["kv"]["num_blocks"] == eng.runner.kv.num_blocks
    assert p["kv"]["max_sequences"] == (eng.runner.kv.num_blocks - 1) // 13  # 100 tokens: 13 blocks of 8


@pytest.mark.parametrize(
    ("name", "quantization"),
    [
        *(
            (name, q)
            for name in ("llama", "qwen3-tied", "llama-bias-mha", "qwen3-moe")
            for q in ("none", "int4", "fp8")
        ),
        *((name, "int8") for name in ("llama", "qwen3-tied", "llama-bias-mha")),  # experts take no int8
        # these two's experts (F = 48) have no int4 group size: the plan says so (test_moe_plan_...)
        *((name, q) for name in ("mixtral", "qwen2-moe") for q in ("none", "fp8")),
    ],
)
def test_predicted_weight_bytes_are_what_loading_holds(tmp_path, name, quantization):
    make_tiny_model(name, tmp_path)
    p = make(["--model", str(tmp_path), "--device", "h100", "--dtype", "float32", "--quantization", quantization])
    loaded = load_model(
        str(tmp_path), use_cache=False, progress=False, quantization=None if quantization == "none" else quantization
    )
    assert p["weights_bytes"] == loaded.weight_bytes


@pytest.mark.parametrize(
    "qtype, layout", [("Q4_0", "int4, group 32"), ("Q8_0", "int8, group 32"), ("Q6_K", "int8, group 16")]
)
def test_a_gguf_files_own_blocks_are_planned_as_loading_keeps_them(tmp_path, qtype, layout):
    from tests.jaxserve.weights.test_gguf_weights import write_tiny_gguf

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(path, "llama", qtype)
    p = make(["--model", str(path), "--device", "h100", "--dtype", "float32", "--quantization", "gguf"])
    loaded = load_model(str(path), use_cache=False, progress=False, quantization="gguf")
    assert loaded.quantization.label == f"gguf ({layout})"
    assert p["weights_bytes"] == loaded.weight_bytes


def test_a_gguf_file_that_mixes_block_types_is_planned_projection_by_projection(tmp_path):
    from tests.jaxserve.weights.test_gguf_weights import MIXED, write_tiny_gguf

    path = tmp_path / "tiny-Q4_K_M.gguf"
    write_tiny_gguf(path, "llama", "Q4_K", types=MIXED)
    p = make(["--model", str(path), "--device", "h100", "--dtype", "float32", "--quantization", "gguf"])
    loaded = load_model(str(path), use_cache=False, progress=False, quantization="gguf")
    assert len(loaded.quantization.exceptions) == len(MIXED)
    assert p["weights_bytes"] == loaded.weight_bytes


def test_int8_experts_are_refused_by_the_plan_as_by_loading(tmp_path):
    make_tiny_model("qwen3-moe", tmp_path)
    with pytest.raises(ValueError, match="int8 is for dense projections; a mixture of experts takes int4 or fp8"):
        load_model(str(tmp_path), use_cache=False, progress=False, quantization="int8")
    with pytest.raises(ValueError, match="int8 is for dense projections"):
        make(["--model", str(tmp_path), "--device", "h100", "--dtype", "float32", "--quantization", "int8"])


def test_a_gguf_file_is_read_for_its_config():
    from jaxserve.weights.default_model import default_model_path

    p = make(["--model", str(default_model_path()), "--device", "h100", "--dtype", "float32"])
    assert (p["model"]["layers"], p["model"]["kv_heads"], p["model"]["head_dim"]) == (30, 3, 64)
    assert p["kv"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4


def test_decode_turns_compute_bound_at_the_data_sheets_ridge():
    """bf16 weights: 2 bytes read and 2 FLOPs per weight per token, so a decode step with
    one token of context turns compute-bound near peak / bandwidth (H100: 989.4 / 3.35 = 295)."""
    p = make(
        [
            "--layers",
            "32",
            "--hidden",
            "4096",
            "--heads",
            "32",
            "--kv-heads",
            "8",
            "--intermediate",
            "14336",
            "--vocab",
            "128256",
            "--dtype",
            "bfloat16",
            "--device",
            "h100",
            "--context",
            "1",
        ]
    )
    ridge = 989.4 / 3.35
    assert 0.98 * ridge < p["compute_bound_batch"] < 1.02 * ridge
    rows = {r["batch"]: r for r in p["decode"]}
    assert rows[1]["bound_by"] == "memory" and rows[256]["bound_by"] == "memory"


def test_int4_helps_at_batch_1_more_than_at_batch_64():
    """The lesson's claim: 4-bit weights cut the bytes a small batch reads; a large batch
    with long contexts reads mostly KV (and computes), which int4 does not shrink."""
    schemes = {
        (r["quantization"], r["kv_cache_dtype"]): r
        for r in make([*LLAMA_70B, "--context", "4096", "--tp", "4"])["schemes"]
    }
    gain = {b: schemes["int4", "auto"]["tokens_per_s"][b] / schemes["none", "auto"]["tokens_per_s"][b] for b in (1, 64)}
    assert gain[1] > 3 and gain[64] < 0.6 * gain[1]


def test_speculative_bound():
    s = Setup(make_plan_cfg(), "bfloat16", kv_dtype="bfloat16")
    speedup = [
        s.speculative_speedup(
            DEVICES["h100"], batch=1, context=512, acceptance_length=a, num_speculative_tokens=4, draft_cost=0.0
        )
        for a in (1, 2, 3)
    ]
    assert speedup[0] <= 1.0 and speedup[0] < speedup[1] < speedup[2] <= 3.0
    # batch 1 is memory-bound: verifying 5 tokens costs about what 1 does
    assert speedup[2] > 0.95 * 3


def make_plan_cfg():
    return plan_cli.model_config(plan_cli.parse_args(LLAMA_70B))[0]


def test_cli_writes_json_and_plot(tmp_path, tiny_llama_dir, capsys):
    plan_cli.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--device",
            "h200",
            "--json",
            str(tmp_path / "p.json"),
            "--plot",
            str(tmp_path / "p.png"),
            "--batches",
            "1,4,16",
        ]
    )
    assert (tmp_path / "p.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "p.json").read_text())
    assert [r["batch"] for r in data["decode"]] == [1, 4, 16]
    assert "flags" in capsys.readouterr().out


def test_measure_sweep_on_this_machine(tmp_path, tiny_llama_dir, capsys):
    """--measure: the engine's decode steps timed beside the bound (on the CPU, its roofs measured)."""
    plan_cli.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--measure",
            "--batches",
            "1,4",
            "--measure-context",
            "12",
            "--measure-steps",
            "2",
            "--context",
            "64",
            "--plot",
            str(tmp_path / "m.png"),
            "--json",
            str(tmp_path / "m.json"),
        ]
    )
    measured = json.loads((tmp_path / "m.json").read_text())["measured"]
    assert [r["batch"] for r in measured] == [1, 4]
    assert all(r["tokens_per_s"] > 0 and 0 < r["ratio"] for r in measured)
    assert "measured / bound" in capsys.readouterr().out
    assert (tmp_path / "m.png").is_file()


def test_bad_flags_are_refused(capsys):
    for argv, message in [
        (["--model", "x", "--layers", "2"], "not both"),
        (["--layers", "2", "--hidden", "8"], "need"),
        (["--batches", "0,2"], "positive"),
        (["--measure", "--device", "h100"], "this machine"),
    ]:
        with pytest.raises(SystemExit):
            plan_cli.parse_args(argv)
        assert message in capsys.readouterr().err


def test_engine_logs_the_plan_and_warns_when_one_sequence_cannot_fit(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.builder"):
        LLMEngine(tiny_llama, EngineConfig(num_blocks=33, block_size=4, max_model_len=30, warm_up=False))
    assert "4 sequences of max_model_len 30 fit" in caplog.text  # 8 blocks each, 32 usable
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.builder"):
        eng = LLMEngine(tiny_llama, EngineConfig(num_blocks=5, block_size=4, max_model_len=30, warm_up=False))
    assert "cannot hold one sequence of max_model_len 30" in caplog.text
    assert eng.max_model_len == 16


def test_the_flag_line_serves_as_planned(capsys):
    """-tp and --dtype are on the line, and the server's own parser reads it as planned."""
    from api.__main__ import parse_args as serve_args

    argv = [*LLAMA_70B, "--context", "8192"]
    plan = make([*argv, "-tp", "4"])
    assert make([*argv, "--tensor-parallel-size", "4"]) == plan == make([*argv, "--tp", "4"])
    plan_cli.print_plan(plan)
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("flags"))
    flags = serve_args(line.split()[1:])
    assert (flags.tensor_parallel_size, flags.dtype, flags.max_model_len) == (4, "float16", 8192)
    assert flags.max_num_seqs == plan["kv"]["max_sequences"] > 0
    assert flags.kv_cache_memory >= plan["kv"]["max_sequences"] * plan["kv"]["bytes_per_sequence"]
    plan_cli.print_plan(make([*argv, "--quantization", "int4"]))
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("flags"))
    assert "--dtype float16" in line and "-tp" not in line  # one device


def test_no_flags_when_not_one_sequence_fits(capsys):
    plan = make([*LLAMA_70B, "--context", "8192"])  # 140 GB of fp16 weights on one 80 GB H100
    assert plan["kv"]["max_sequences"] == 0 and plan["flags"]["flags"] == {} and not plan["flags"]["fits"]
    plan_cli.print_plan(plan)
    out = capsys.readouterr().out
    assert "flags   none: not one sequence of 8,192 tokens fits: the weights and activations alone" in out
    assert "--max-num-seqs" not in out
    small = make([*LLAMA_70B, "--context", "8192", "--kv-cache-memory-bytes", "1GiB"])
    assert (
        "--kv-cache-memory-bytes 1.07 GB (1.00 GiB) is less than one sequence's KV (2.68 GB (2.50 GiB))"
        in (small["flags"]["reason"])
    )


MIXTRAL_8X7B = [
    *("--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --vocab 32000 --dtype bfloat16 --device h100".split()),
    *("--experts 8 --experts-per-token 2 --moe-intermediate 14336".split()),
]


def test_moe_plan_prints_total_and_active_parameters(tmp_path, capsys):
    """A tiny Qwen2-MoE folder (shared expert, a dense layer): the counts are the torch
    model's own, the decode sweep reads k experts at batch 1 and all E by batch 64, and an
    int4 scheme the experts' shapes cannot take is reported, not raised."""
    model = make_tiny_model("qwen2-moe", tmp_path)
    cfg = model.config
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    total = sum(p.numel() for p in model.parameters())
    idle = sum(p.numel() * (e - k) // e for name, p in model.named_parameters() if ".experts." in name)
    plan_cli.main(
        ["--model", str(tmp_path), "--device", "h100", "--batches", "1,64", "--json", str(tmp_path / "p.json")]
    )
    out = capsys.readouterr().out
    assert f"params  {total:,} in all, {total - idle:,} active per token" in out
    assert f"E * (1 - (1 - k/E)^B) = {e} * (1 - (1 - {k}/{e})^B)" in out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert (plan["model"]["params_total"], plan["model"]["params_active"]) == (total, total - idle)
    assert plan["model"]["moe_layers"] == cfg.num_hidden_layers - len(cfg.mlp_only_layers)
    read = {r["batch"]: r["experts_read"] for r in plan["decode"]}
    assert read[1] == pytest.approx(k) and read[64] == pytest.approx(e)
    assert "| int4 | auto | not possible: int4 quantization: K=48" in out


def test_inline_mixtral(capsys):
    """Mixtral-8x7B from flags: 46.7B parameters, 12.9B active (Mistral's figures)."""
    plan = make(MIXTRAL_8X7B)
    assert plan["model"]["params_total"] == pytest.approx(46.7e9, rel=0.005)
    assert plan["model"]["params_active"] == pytest.approx(12.9e9, rel=0.005)
    assert plan["model"]["intermediate"] == 14336  # the experts' size stands in for the dense one
    plan_cli.print_plan(plan)
    assert "params  46.70 B in all, 12.88 B active per token" in capsys.readouterr().out
    for argv, message in [
        ([*MIXTRAL_8X7B, "--experts-per-token", "9"], "must be in 1..--experts 8"),
        ([*MIXTRAL_8X7B[:-2]], "need --moe-intermediate"),
        ([*MIXTRAL_8X7B[:-6]], "need --intermediate"),  # dense again: the dense MLP's size is needed
    ]:
        with pytest.raises(SystemExit):
            plan_cli.parse_args(argv)
        assert message in capsys.readouterr().err


def test_expert_parallel_flag_line_and_device_bytes(capsys):
    """-tp 2 with --enable-expert-parallel: 4 whole experts per device, the same bytes as
    halving each; the flag line asks the server for it."""
    tp = make([*MIXTRAL_8X7B, "-tp", "2", "--context", "4096"])
    ep = make([*MIXTRAL_8X7B, "-tp", "2", "--context", "4096", "--enable-expert-parallel"])
    assert ep["setup"]["expert_parallel"] and not tp["setup"]["expert_parallel"]
    assert ep["weights_bytes_per_device"] == tp["weights_bytes_per_device"] == tp["weights_bytes"] // 2
    assert ep["flags"]["flags"]["--enable-expert-parallel"] is True
    plan_cli.print_plan(ep)
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("flags"))
    assert line.endswith("-tp 2 --enable-expert-parallel")
    assert "expert parallelism's token dispatch (all-reduce or all-to-all)" in ep["not_modelled"]
