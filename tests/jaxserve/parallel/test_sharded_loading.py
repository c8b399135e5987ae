"""Weights go straight into their tensor-parallel shards (on forced CPU devices, see
tests/conftest.py): no device ever holds a whole split parameter, not even for a moment
while loading, and the engine keeps no unsplit copy.

On the CPU `device.memory_stats()` is None, so what a device holds is read from
`jax.live_arrays()`: each live array's addressable shards, by device. Arrays alive before
a test (other tests' session fixtures) are left out. The oracle for tokens is TP 1 on the
same weights (itself checked against Hugging Face in tests/jaxserve/model).
"""

import jax
import numpy as np
import pytest

from jaxserve.engine import EngineConfig, LLMEngine, builder
from jaxserve.parallel.sharding import resident_bytes
from jaxserve.weights import load_model, params, safetensors_reader
from tests.jaxserve.parallel.test_tensor_parallel import assert_same_greedy_where_clear, engine, greedy_with_margins
from tests.tiny_models import make_tiny_model

# What a device may hold past its shard of the weights while they load: nothing. The
# loader creates no other device array (measured: 0 bytes over).
LOAD_SLACK = 0
# ... and past its shards of the weights and the KV cache once the engine is built (without
# warm-up): the runner's last-token and seed rows and such, a few KiB at these sizes.
ENGINE_SLACK = 64 << 10


@pytest.fixture(scope="module")
def twelve_heads_dir(tmp_path_factory):
    """12 query and 12 KV heads, a vocabulary of 96 and hidden sizes of 96: every split
    axis divides by 2, 3 and 4, so only the norms stay whole on each device."""
    folder = tmp_path_factory.mktemp("tiny-llama-12-heads")
    make_tiny_model(
        "llama",
        folder,
        vocab_size=96,
        hidden_size=96,
        intermediate_size=192,
        num_attention_heads=12,
        num_key_value_heads=12,
        head_dim=8,
    )
    return folder


@pytest.fixture(scope="module")
def six_heads_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-6-heads-refused")
    make_tiny_model("llama", folder, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    return folder


def buffers() -> dict[tuple[int, int], int]:
    """Every live device buffer: (device id, address) -> bytes. By address, because a
    shard's `data` (and `jax.live_arrays()` lists those too) aliases its array's buffer."""
    held = {}
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            held[shard.device.id, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return held


def new_resident(before: set) -> dict[int, int]:
    """Bytes per device of the live buffers made since `before` (their keys)."""
    held: dict[int, int] = {}
    for (device, address), nbytes in buffers().items():
        if (device, address) not in before:
            held[device] = held.get(device, 0) + nbytes
    return dict(sorted(held.items()))


def load_tracked(monkeypatch, folder, tp: int, **kwargs):
    """builder.load at TP `tp`, noting each device's new resident bytes after every parameter
    placement, and whether device 0 ever held a new buffer of a split parameter's whole size."""
    before = set(buffers())
    peaks: dict[int, int] = {}
    whole_on_device_0 = []
    place = params.place_from_host

    def tracked(host, sharding):
        held = set(buffers())
        placed = place(host, sharding)
        made = {k: n for k, n in buffers().items() if k not in held}  # by this placement
        if not sharding.is_fully_replicated and any(d == 0 and n >= host.nbytes for (d, _), n in made.items()):
            whole_on_device_0.append(host.shape)
        for device, nbytes in new_resident(before).items():
            peaks[device] = max(peaks.get(device, 0), nbytes)
        return placed

    monkeypatch.setattr(params, "place_from_host", tracked)
    loaded, config = builder.load(str(folder), progress=False, tensor_parallel_size=tp, **kwargs)
    monkeypatch.undo()
    return loaded, before, peaks, whole_on_device_0


def expected_shard_bytes(loaded_tp1, tp: int) -> int:
    """One device's share of the twelve-heads model: every 2-D weight split tp ways (its
    heads, features and vocabulary all divide), the 1-D norms whole."""
    leaves = jax.tree.leaves(params.model_params(loaded_tp1.model))
    return sum(x.nbytes // tp if x.ndim == 2 else x.nbytes for x in leaves)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_each_device_holds_only_its_shard_while_loading_and_serving(monkeypatch, tmp_path, twelve_heads_dir, tp):
    one = load_model(str(twelve_heads_dir), use_cache=False, progress=False)
    loaded, before, peaks, whole = load_tracked(monkeypatch, twelve_heads_dir, tp, cache_dir=tmp_path)
    share = expected_shard_bytes(one, tp)
    weights = resident_bytes(params.model_params(loaded.model))
    assert weights == {d: share for d in range(tp)}  # the same on every device, device 0 included
    assert whole == []
    assert set(peaks) == set(range(tp)) and all(p <= share + LOAD_SLACK for p in peaks.values())

    eng = engine(loaded, tp, warm_up=False)
    runner_leaves = jax.tree.leaves(eng.runner.params)
    model_leaves = jax.tree.leaves(params.model_params(loaded.model))
    assert all(a is b for a, b in zip(runner_leaves, model_leaves))  # placed once, not copied again
    kv = resident_bytes(eng.runner.kv)
    assert eng.device_bytes() == {"weights": weights, "kv_cache": kv}
    held = new_resident(before)
    for d in range(tp):
        assert held[d] <= share + kv[d] + ENGINE_SLACK, d
    assert set(held) == set(range(tp))

    want, _ = greedy_with_margins(one, 1)
    got, _ = greedy_with_margins(loaded, tp)
    assert_same_greedy_where_clear(got, want)


def test_kv_heads_repeated_on_the_host_before_placing(monkeypatch, tmp_path, tiny_llama_dir, tiny_llama):
    """4 heads and 2 KV heads at TP 4: each K/V head is repeated twice, on the host, and each
    device gets one repeated head; nothing whole lands on device 0."""
    loaded, _, peaks, whole = load_tracked(monkeypatch, tiny_llama_dir, 4, cache_dir=tmp_path)
    assert whole == []
    k = params.model_params(loaded.model)["layers"][0]["self_attn"]["k_proj"]["kernel"]
    assert k.shape == (64, 4 * 16) and {s.data.shape for s in k.addressable_shards} == {(64, 16)}
    weights = resident_bytes(params.model_params(loaded.model))
    assert all(peaks[d] <= weights[d] + LOAD_SLACK for d in range(4))
    want, _ = greedy_with_margins(tiny_llama, 1)
    got, _ = greedy_with_margins(loaded, 4)
    assert_same_greedy_where_clear(got, want)


def test_tensor_parallel_size_that_does_not_fit_is_refused_before_loading(monkeypatch, tmp_path, six_heads_dir):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(safetensors_reader, "read_tensors", no_weights)
    monkeypatch.setattr(builder, "load_model", no_weights)
    with pytest.raises(ValueError, match=r"6 attention heads; it can be one of \[1, 2, 3, 6\]"):
        LLMEngine.from_model(str(six_heads_dir), progress=False, cache_dir=tmp_path, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="KV heads"):
        LLMEngine.from_model(str(six_heads_dir), progress=False, cache_dir=tmp_path, tensor_parallel_size=2)


def column_ranges(array, axis: int, unit: int = 1) -> dict:
    """Each device's [start, stop) along `axis`, in units of `unit` elements (int4: 2 per byte row)."""
    out = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        s = index[axis]
        start, stop, _ = s.indices(array.shape[axis])
        out[device.id] = (start * unit, stop * unit)
    return out


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_quantized_weights_load_into_shards_with_their_scales(monkeypatch, tmp_path, tiny_llama_dir, method):
    one = load_model(str(tiny_llama_dir), use_cache=False, progress=False, quantization=method)
    loaded, _, _, whole = load_tracked(monkeypatch, tiny_llama_dir, 2, cache_dir=tmp_path, quantization=method)
    assert whole == []
    layer = params.model_params(loaded.model)["layers"][1]
    q, o = layer["self_attn"]["q_proj"], layer["self_attn"]["o_proj"]
    weight = "packed" if method == "int4" else "weight"  # int8 and fp8: "weight"
    # Column-parallel: the scales' output columns on each device are its weight's columns.
    assert column_ranges(q[weight], -1) == column_ranges(q["scales"], -1)
    assert len({s.device for s in q[weight].addressable_shards}) == 2
    assert {s.data.shape[-1] for s in q[weight].addressable_shards} == {q[weight].shape[-1] // 2}
    if method in ("int4", "int8"):
        # Row-parallel: the inputs of a device's rows (int4: 2 per byte) lie in its scale groups
        # (int4 at these sizes: K is one group, which cannot split, so every device holds it whole).
        unit = 2 if method == "int4" else 1
        for proj in (o, layer["mlp"]["down_proj"]):
            group = unit * proj[weight].shape[0] // proj["scales"].shape[0]
            rows, groups = column_ranges(proj[weight], 0, unit=unit), column_ranges(proj["scales"], 0, unit=group)
            assert all(groups[d][0] <= rows[d][0] and rows[d][1] <= groups[d][1] for d in rows)
            assert len(set(rows.values())) == 2  # the rows themselves are split
            if method == "int4":
                assert column_ranges(proj["offsets"], 0) == column_ranges(proj["scales"], 0)
    else:
        assert o["scales"].sharding.is_fully_replicated  # per output channel: every device needs all
    want, _ = greedy_with_margins(one, 1)
    got, _ = greedy_with_margins(loaded, 2)
    assert_same_greedy_where_clear(got, want)


@pytest.mark.parametrize("tp", [2, 4])
def test_cache_restore_lands_in_shards(monkeypatch, tmp_path, tiny_llama_dir, tiny_llama, tp):
    """The second load restores the orbax cache straight into the shards (at TP 4 the K/V
    projections come to the host to be repeated); the first load saved the model's own heads."""
    first, _, _, _ = load_tracked(monkeypatch, tiny_llama_dir, tp, cache_dir=tmp_path)
    assert not first.from_cache
    monkeypatch.setattr(safetensors_reader, "read_tensors", lambda *a, **k: pytest.fail("weights read again"))
    before = set(buffers())
    loaded, _ = builder.load(str(tiny_llama_dir), progress=False, cache_dir=tmp_path, tensor_parallel_size=tp)
    assert loaded.from_cache
    tree = params.model_params(loaded.model)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(params.model_params(first.model))):
        assert a.sharding == b.sharding and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q = tree["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert {s.data.shape for s in q.addressable_shards} == {(64, 64 // tp)}
    assert new_resident(before) == resident_bytes(tree)  # nothing more than the shards, device 0 included
    # The cache holds the model's own two KV heads, whichever mesh wrote it.
    one = load_model(str(tiny_llama_dir), progress=False, cache_dir=tmp_path)
    k = params.model_params(one.model)["layers"][0]["self_attn"]["k_proj"]["kernel"]
    assert one.from_cache and k.shape == (64, 2 * 16)
    want, _ = greedy_with_margins(tiny_llama, 1)
    got, _ = greedy_with_margins(loaded, tp)
    assert_same_greedy_where_clear(got, want)


def test_replica_reshards_onto_its_own_devices(tmp_path, tiny_llama_dir):
    """A data-parallel replica (other devices) copies the shards device to device; the first
    engine's devices hold nothing more."""
    eng = LLMEngine.from_model(
        str(tiny_llama_dir), progress=False, cache_dir=tmp_path, tensor_parallel_size=2, warm_up=False, num_blocks=16
    )
    first = eng.device_bytes()
    twin = eng.replica((2, 3))
    assert set(twin.device_bytes()["weights"]) == {2, 3}
    assert list(twin.device_bytes()["weights"].values()) == list(first["weights"].values())
    assert eng.device_bytes() == first
    assert isinstance(twin.config, EngineConfig) and twin.config.device_ids == (2, 3)
