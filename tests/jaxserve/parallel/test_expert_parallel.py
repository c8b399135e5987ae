"""Mixtures of experts over several CPU devices (tests/conftest.py asks jax for four): plain
tensor parallelism (each expert split on F) and expert parallelism (--enable-expert-parallel:
whole experts split on E, jaxserve.parallel.experts) compute what one device computes.

Oracles: TP 1 on the same weights (itself checked against Hugging Face in
tests/jaxserve/model/test_model_vs_hf.py). Logits agree to float tolerance (the psum and
the all-reduces reorder sums); greedy tokens agree wherever TP 1's top-2 margin is clear.
What each device holds is read from the parameters' addressable shards and compared with
the slice of the whole array that device should hold.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.engine import LLM, EngineConfig
from jaxserve.engine.builder import node_fingerprint
from jaxserve.engine.config import EXPERT_DISPATCHES
from jaxserve.flags import add_model_flags, model_engine_kwargs
from jaxserve.parallel import multihost
from jaxserve.parallel.experts import check_expert_parallel
from jaxserve.weights import load_model
from scheduler import SamplingParams
from tests.jaxserve.parallel.test_tensor_parallel import (
    PROMPTS,
    assert_same_greedy_where_clear,
    engine,
    greedy_with_margins,
)
from tests.jaxserve.parallel.test_tensor_parallel import mixed_step_logits as tp_mixed_step_logits
from tests.tiny_models import TINY_MODELS, make_tiny_model

MOE_MODELS = ("mixtral", "qwen2-moe", "qwen3-moe")  # 4, 6 and 8 experts
SMALL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, num_blocks=64, block_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    dirs = {}
    for name in MOE_MODELS:
        dirs[name] = tmp_path_factory.mktemp(f"tiny-{name}")
        make_tiny_model(name, dirs[name])
    return dirs


@pytest.fixture(scope="module")
def moe_models(moe_dirs):
    return {name: load_model(str(folder), use_cache=False, progress=False) for name, folder in moe_dirs.items()}


@pytest.fixture(scope="module")
def one_device_logits(moe_models):
    return {name: tp_mixed_step_logits(loaded, 1)[0] for name, loaded in moe_models.items()}


def mixed_step_logits(loaded, tp: int, expert_parallel: bool, **kwargs):
    return tp_mixed_step_logits(loaded, tp, enable_expert_parallel=expert_parallel, **kwargs)


def expert_gathers(hlo: str) -> list[str]:
    """The compiled step's all-gathers inside the experts (jaxserve.model.moe's "moe_experts" scope)."""
    return [line for line in hlo.splitlines() if "all-gather(" in line and "moe_experts" in line]


def expert_params(runner) -> dict[str, jax.Array]:
    """Every stacked expert parameter of the runner's first MoE layer, by projection/name."""
    layer = next(layer for layer in runner.params["layers"].values() if "experts" in layer["mlp"])
    return {f"{proj}/{name}": a for proj, leaves in layer["mlp"]["experts"].items() for name, a in leaves.items()}


@pytest.mark.parametrize(
    "name, tp, expert_parallel",
    [
        ("mixtral", 2, False),
        ("mixtral", 2, True),
        ("mixtral", 4, True),
        ("qwen2-moe", 2, False),  # a shared expert and a dense layer next to the experts
        ("qwen2-moe", 2, True),
        ("qwen3-moe", 2, True),
        ("qwen3-moe", 4, True),
    ],
)
def test_logits_split_over_devices_equal_one_device(moe_models, one_device_logits, name, tp, expert_parallel):
    logits, hlo = mixed_step_logits(moe_models[name], tp, expert_parallel)
    np.testing.assert_allclose(logits, one_device_logits[name], atol=1e-4, rtol=0)
    assert "all-reduce" in hlo  # really split
    # No device gathers expert weights (nor anything else) in the step: each expert's F
    # slices (plain TP) or whole experts (EP) are used where they lie.
    assert "all-gather" not in hlo


@pytest.mark.parametrize("dispatch", EXPERT_DISPATCHES)
def test_an_uneven_load_every_token_to_the_same_experts(moe_dirs, dispatch):
    """A router of zeros ties every expert: each token takes experts 0 and 1 (ties go to the
    lower index), all on device 0 at EP 2 (devices 2 and 3 idle at EP 4). all-to-all: every
    device sends all its pairs to device 0, the worst case its buffers are sized for."""
    loaded = load_model(str(moe_dirs["mixtral"]), use_cache=False, progress=False)
    for layer in loaded.model.layers:
        layer.mlp.gate.kernel[...] = jax.numpy.zeros_like(layer.mlp.gate.kernel[...])
    want, _ = tp_mixed_step_logits(loaded, 1)
    for tp in (2, 4):
        got, _ = mixed_step_logits(loaded, tp, expert_parallel=True, expert_dispatch=dispatch)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name, tp", [("mixtral", 2), ("mixtral", 4), ("qwen2-moe", 2), ("qwen3-moe", 4)])
def test_all_to_all_dispatch_equals_one_device_and_the_all_reduce(moe_models, one_device_logits, name, tp):
    """A ragged step (decode rows and a prefill chunk) with tokens sent to their experts'
    devices and back: the logits of one device and of the psum dispatch, to float tolerance."""
    logits, hlo = mixed_step_logits(moe_models[name], tp, True, expert_dispatch="all-to-all")
    psum_logits, psum_hlo = mixed_step_logits(moe_models[name], tp, True)
    np.testing.assert_allclose(logits, one_device_logits[name], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits, psum_logits, atol=1e-4, rtol=0)
    assert "all-to-all" in hlo and "all-to-all" not in psum_hlo  # each really takes its own way
    # The only gathers are of the token slices ([T', D], replicated again), never of expert weights.
    for line in expert_gathers(hlo):
        assert f"[{hlo_tokens(line)},{moe_models[name].config.hidden_size}]" in line, line


def hlo_tokens(line: str) -> int:
    """The leading dimension of an HLO instruction's result shape, e.g. f32[16,64]{1,0} -> 16."""
    return int(line.split("=", 1)[1].split("[", 1)[1].split(",", 1)[0])


@pytest.mark.parametrize("tp, tokens", [(2, 1), (2, 5), (4, 1), (4, 6), (4, 16)])
def test_all_to_all_runner_pads_tokens_to_a_multiple_of_the_devices(moe_models, tp, tokens):
    """The runner alone on Qwen3-MoE's first layer's experts, at token counts tp does not
    divide: the same output as run_experts on one device, for random and for uneven routing."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.model.moe import route, run_experts
    from jaxserve.parallel.experts import all_to_all_runner
    from jaxserve.parallel.sharding import make_mesh

    cfg = moe_models["qwen3-moe"].config
    experts = moe_models["qwen3-moe"].model.layers[0].mlp.experts
    mesh = make_mesh(tp)
    split = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("model"))), nnx.state(experts))
    ep_experts = nnx.merge(nnx.graphdef(experts), split)
    keys = jax.random.split(jax.random.key(tokens), 2)
    x = jax.random.normal(keys[0], (tokens, cfg.hidden_size), jax.numpy.float32)
    logits = jax.random.normal(keys[1], (tokens, cfg.num_experts), jax.numpy.float32)
    weights, chosen = route(logits, cfg.num_experts_per_tok, norm_topk_prob=True, weights_in_float32=True)
    run = jax.jit(lambda e, x, w, c: all_to_all_runner(mesh)(e, x, w, c, cfg.num_experts))
    for routed in (chosen, jax.numpy.broadcast_to(jax.numpy.arange(chosen.shape[1]), chosen.shape)):
        want = run_experts(experts, x, weights, routed, cfg.num_experts)
        got = run(ep_experts, x, weights, routed)
        assert got.shape == (tokens, cfg.hidden_size)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "name, tp, dispatch", [("mixtral", 2, "all-reduce"), ("qwen3-moe", 4, "all-reduce"), ("qwen3-moe", 4, "all-to-all")]
)
def test_greedy_tokens_equal_one_device_and_nothing_compiles_after_warm_up(moe_models, name, tp, dispatch):
    want, _ = greedy_with_margins(moe_models[name], 1)
    got, compiled_after_warm_up = greedy_with_margins(
        moe_models[name], tp, enable_expert_parallel=True, expert_dispatch=dispatch
    )
    assert_same_greedy_where_clear(got, want)
    assert compiled_after_warm_up == 0


def test_each_device_holds_only_its_experts(moe_models):
    """Qwen3-MoE's 8 experts over 4 devices: device r holds experts 2r and 2r + 1, whole."""
    loaded = moe_models["qwen3-moe"]
    eng = engine(loaded, 4, warm_up=False, enable_expert_parallel=True)
    whole = expert_params(engine(loaded, 1, warm_up=False).runner)
    for path, param in expert_params(eng.runner).items():
        full = np.asarray(whole[path])
        assert len(param.addressable_shards) == 4 and param.shape == full.shape, path
        for r, shard in enumerate(sorted(param.addressable_shards, key=lambda s: s.device.id)):
            assert shard.data.shape == (2, *full.shape[1:]), path
            np.testing.assert_array_equal(np.asarray(shard.data), full[2 * r : 2 * r + 2], err_msg=path)


def test_plain_tensor_parallel_splits_each_expert_on_its_intermediate_axis(moe_models):
    """Without the flag each expert is split like a dense MLP: gate/up [E, D, F] and down
    [E, F, D] on F (Mixtral's F = 48), every device holding a part of all 4 experts."""
    eng = engine(moe_models["mixtral"], 2, warm_up=False)
    params = expert_params(eng.runner)
    assert {s.data.shape for s in params["gate_proj/kernel"].addressable_shards} == {(4, 64, 24)}
    assert {s.data.shape for s in params["up_proj/kernel"].addressable_shards} == {(4, 64, 24)}
    assert {s.data.shape for s in params["down_proj/kernel"].addressable_shards} == {(4, 24, 64)}


@pytest.mark.parametrize("method, expert_parallel", [("int4", True), ("fp8", True), ("int4", False), ("fp8", False)])
def test_quantized_experts_split_with_their_scales(moe_dirs, method, expert_parallel):
    # Qwen3-MoE: its F = 32 and D = 64 suit int4's groups (Mixtral's F = 48 does not)
    loaded = load_model(str(moe_dirs["qwen3-moe"]), use_cache=False, progress=False, quantization=method)
    one, _ = tp_mixed_step_logits(loaded, 1)
    two, hlo = mixed_step_logits(loaded, 2, expert_parallel)
    np.testing.assert_allclose(two, one, atol=1e-4, rtol=0)
    # NOTE: the attention's int4 o_proj ([96, 64]: 3 scale groups, kept whole) is gathered; no expert weight is.
    assert expert_gathers(hlo) == []
    if expert_parallel:  # packed / weight, scales, offsets: 4 of the 8 experts each
        eng = engine(loaded, 2, warm_up=False, enable_expert_parallel=True)
        for path, param in expert_params(eng.runner).items():
            assert {s.data.shape[0] for s in param.addressable_shards} == {4}, path


def test_the_library_loads_experts_straight_into_their_shards_and_generates(moe_dirs, moe_models):
    """LLM(..., enable_expert_parallel=True): the loader places each expert parameter split
    on E, and the engine runs on those very arrays (no second, resharded copy)."""
    llm = LLM(str(moe_dirs["qwen3-moe"]), tensor_parallel_size=4, enable_expert_parallel=True, **SMALL_ENGINE)
    loaded_kernel = llm.engine.loaded.model.layers[0].mlp.experts.down_proj.kernel.get_value()
    assert {s.data.shape for s in loaded_kernel.addressable_shards} == {(2, 32, 64)}  # [E, F, D]: 2 of 8 experts
    assert expert_params(llm.engine.runner)["down_proj/kernel"] is loaded_kernel
    want, _ = greedy_with_margins(moe_models["qwen3-moe"], 1)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    got = {str(i): (out.outputs[0].token_ids, None) for i, out in enumerate(outs)}
    assert_same_greedy_where_clear(got, {rid: want[rid] for rid in got})


def test_the_weight_cache_restores_and_derives_experts_into_their_shards(moe_dirs, tmp_path):
    """A first load (plain TP) fills the cache; an EP load restores it onto whole-expert
    shards, and an int4 EP load derives from it, placed the same way."""
    from jaxserve.engine import builder

    folder, kwargs = str(moe_dirs["qwen3-moe"]), dict(progress=False, cache_dir=tmp_path, tensor_parallel_size=4)
    first, _ = builder.load(folder, **kwargs)
    restored, _ = builder.load(folder, **kwargs, enable_expert_parallel=True)
    derived, _ = builder.load(folder, **kwargs, enable_expert_parallel=True, quantization="int4")
    assert not first.from_cache and restored.from_cache and derived.from_cache
    kernel = restored.model.layers[0].mlp.experts.down_proj.kernel.get_value()
    assert {s.data.shape for s in kernel.addressable_shards} == {(2, 32, 64)}
    want = np.asarray(first.model.layers[0].mlp.experts.down_proj.kernel.get_value())
    np.testing.assert_array_equal(np.asarray(kernel), want)
    down = derived.model.layers[0].mlp.experts.down_proj
    for param in (down.packed, down.scales, down.offsets):  # [E, F // 2, D], [E, F // group, D]
        assert {s.data.shape[0] for s in param.get_value().addressable_shards} == {2}
    assert {s.data.shape for s in down.packed.get_value().addressable_shards} == {(2, 16, 64)}


def test_experts_that_do_not_divide_are_refused_clearly(moe_dirs, moe_models):
    cfg = moe_models["qwen2-moe"].config  # 6 experts
    check_expert_parallel(cfg, 2)
    check_expert_parallel(cfg, 3)
    with pytest.raises(ValueError, match=r"does not divide the model's 6 experts; it can be one of \[1, 2, 3, 6\]"):
        check_expert_parallel(cfg, 4)
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):  # the library, before loading
        LLM(str(moe_dirs["qwen2-moe"]), tensor_parallel_size=4, enable_expert_parallel=True)


def test_the_flag_reaches_the_engine_and_every_node_must_agree_on_it(moe_dirs):
    import argparse

    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    args = parser.parse_args(["-tp", "2", "--enable-expert-parallel"])
    kwargs = model_engine_kwargs(args)
    assert kwargs["enable_expert_parallel"] is True
    assert EngineConfig(**kwargs).enable_expert_parallel
    assert model_engine_kwargs(parser.parse_args([]))["enable_expert_parallel"] is False
    # Several nodes compare fingerprints at connect (jaxserve.parallel.multihost).
    folder = str(moe_dirs["mixtral"])
    on = node_fingerprint(folder, tensor_parallel_size=2, enable_expert_parallel=True)
    off = node_fingerprint(folder, tensor_parallel_size=2)
    assert multihost.differences(on, off, 1) == ["enable_expert_parallel: node 0 has True, node 1 has False"]


def test_the_dispatch_flag_reaches_the_engine_and_every_node_must_agree_on_it(moe_dirs):
    import argparse

    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    flag = parser._option_string_actions["--expert-dispatch"]
    assert tuple(flag.choices) == EXPERT_DISPATCHES and flag.default == EngineConfig().expert_dispatch
    kwargs = model_engine_kwargs(
        parser.parse_args(["-tp", "2", "--enable-expert-parallel", "--expert-dispatch", "all-to-all"])
    )
    assert EngineConfig(**kwargs).expert_dispatch == "all-to-all"
    with pytest.raises(SystemExit):
        parser.parse_args(["--expert-dispatch", "ring"])
    with pytest.raises(ValueError, match=r"expert_dispatch must be one of \('all-reduce', 'all-to-all'\), got 'ring'"):
        EngineConfig(expert_dispatch="ring")
    folder = str(moe_dirs["mixtral"])
    a2a = node_fingerprint(folder, tensor_parallel_size=2, enable_expert_parallel=True, expert_dispatch="all-to-all")
    psum = node_fingerprint(folder, tensor_parallel_size=2, enable_expert_parallel=True)
    assert multihost.differences(a2a, psum, 1) == ["expert_dispatch: node 0 has 'all-to-all', node 1 has 'all-reduce'"]


def test_the_tiny_moe_configs_are_what_these_tests_assume():
    assert TINY_MODELS["mixtral"][1]["num_local_experts"] == 4
    assert TINY_MODELS["qwen2-moe"][1]["num_experts"] == 6
    assert TINY_MODELS["qwen3-moe"][1]["num_experts"] == 8
