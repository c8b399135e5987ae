"""The weight cache on mixtures of experts: stacked expert parameters (float, int4, fp8 and a
compressed-tensors checkpoint's) restored equal to a fresh conversion, and int4 / fp8
derived from the float32 copy expert by expert, as loading quantizes them."""

import pytest

from jaxserve.model.moe import QuantizedExpertLinear, SparseMoE
from jaxserve.weights import cache
from jaxserve.weights.load import load_model
from tests.jaxserve.weights.test_cache import assert_bit_equal, forbid_reading_weights, load, variants
from tests.jaxserve.weights.test_compressed_tensors import SCHEMES
from tests.jaxserve.weights.test_moe_compressed_tensors import MODELS, write_moe_checkpoint
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module", params=list(MODELS))
def moe_dir(request, tmp_path_factory):
    """(float checkpoint folder, the ignore list of its compressed-tensors form)."""
    folder = tmp_path_factory.mktemp(request.param) / "float"
    make_tiny_model(request.param, folder, **MODELS[request.param][0])
    return folder, MODELS[request.param][1]


def fresh(folder, **kw):
    return load_model(str(folder), use_cache=False, progress=False, **kw)


def test_float_moe_is_restored_and_int4_fp8_are_derived_from_it(moe_dir, tmp_path, monkeypatch):
    moe_dir, _ = moe_dir
    first = load(moe_dir, tmp_path)
    again = load(moe_dir, tmp_path)
    assert (first.from_cache, again.from_cache) == (False, True)
    assert_bit_equal(again, first)
    assert cache.list_entries(tmp_path)[0].meta["lossless"] is True
    forbid_reading_weights(monkeypatch)
    asks = [{"quantization": "int4"}, {"quantization": "fp8"}, {"dtype": "bfloat16", "quantization": "int4"}]
    derived = [load(moe_dir, tmp_path, **kw) for kw in asks]
    monkeypatch.undo()
    for kw, loaded in zip(asks, derived):
        assert loaded.from_cache
        moe = next(layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE))
        assert isinstance(moe.experts.down_proj, QuantizedExpertLinear)
        assert_bit_equal(loaded, fresh(moe_dir, **kw))
    assert variants(tmp_path) == ["float32"]


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_quantized_moe_converted_without_a_base_is_cached(moe_dir, tmp_path, method):
    moe_dir, _ = moe_dir
    first = load(moe_dir, tmp_path, quantization=method)
    again = load(moe_dir, tmp_path, quantization=method)
    assert (first.from_cache, again.from_cache) == (False, True)
    assert_bit_equal(again, fresh(moe_dir, quantization=method))
    assert variants(tmp_path) == [f"float32-{method}"]


def test_compressed_tensors_moe_is_cached(moe_dir, tmp_path):
    float_dir, ignore = moe_dir  # ignore: the router (and shared expert gate) stay float
    folder = write_moe_checkpoint(tmp_path / "quantized", float_dir, *SCHEMES["int4-g32-asym"], ignore)
    first = load(folder, tmp_path / "c")
    again = load(folder, tmp_path / "c")
    assert (first.from_cache, again.from_cache) == (False, True)
    assert_bit_equal(again, first)
