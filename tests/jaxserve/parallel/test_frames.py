"""Frames between nodes (jaxserve.parallel.frames): a step plan makes the trip whole, and
anything but data is refused without running it: a pickle, an unregistered type, an
object dtype, sizes that do not add up."""

import dataclasses
import pickle
import struct

import numpy as np
import pytest

from jaxserve.parallel.frames import MAGIC, Codec, FrameError


@dataclasses.dataclass
class Inner:
    ids: np.ndarray
    flag: np.ndarray  # 0-d


@dataclasses.dataclass
class Outer:
    inner: Inner
    extra: np.ndarray | None
    rows: list


def frame(header: dict, payload: bytes = b"") -> bytes:
    import json

    raw = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + payload


CODEC = Codec([Outer, Inner])


def test_a_tree_of_arrays_makes_the_trip_whole():
    tree = Outer(Inner(np.arange(6, dtype=np.int32).reshape(2, 3), np.bool_(True)), None, [np.float32(0.5), 3])
    got = CODEC.decode(CODEC.encode("step", {"n": 1}, tree))
    assert got.kind == "step" and got.body == {"n": 1}
    assert isinstance(got.tree, Outer) and isinstance(got.tree.inner, Inner) and got.tree.extra is None
    np.testing.assert_array_equal(got.tree.inner.ids, tree.inner.ids)
    assert got.tree.inner.ids.dtype == np.int32
    assert got.tree.inner.flag.shape == () and got.tree.inner.flag.dtype == np.bool_
    assert got.tree.rows[0].dtype == np.float32 and got.tree.rows[1] == 3


def test_the_header_is_the_shapes_not_the_values():
    a = CODEC.encode("step", tree=Inner(np.zeros(4, np.int32), np.bool_(False)))
    b = CODEC.encode("step", tree=Inner(np.ones(4, np.int32), np.bool_(True)))
    c = CODEC.encode("step", tree=Inner(np.ones(8, np.int32), np.bool_(True)))
    assert Codec.header(a) == Codec.header(b) != Codec.header(c)


def test_a_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(FrameError, match="not a jaxserve frame"):
        CODEC.decode(pickle.dumps(Exploit()))
    assert not marker.exists()


@pytest.mark.parametrize(
    "header, payload, message",
    [
        ({"kind": "step", "body": {}, "tree": {"@type": "Popen", "fields": {}}, "arrays": []}, b"", "does not read"),
        ({"kind": "step", "body": {}, "tree": {"@array": 0}, "arrays": [["object", [1]]]}, b"x" * 8, "plain numeric"),
        ({"kind": "step", "body": {}, "tree": {"@array": 0}, "arrays": [["int32", [4]]]}, b"\0" * 8, "shorter"),
        ({"kind": "step", "body": {}, "tree": {"@array": 0}, "arrays": [["int32", [1]]]}, b"\0" * 8, "past its arrays"),
        ({"kind": "step", "body": {}, "tree": {"@array": 3}, "arrays": []}, b"", "refers to array 3"),
        ({"kind": "step", "body": {}, "tree": {"@type": "Inner", "fields": {"ids": 1}}, "arrays": []}, b"", "fields"),
        ({"kind": "step", "body": {}, "tree": {"__reduce__": "os.system"}, "arrays": []}, b"", "does not read"),
        ({"kind": "step", "body": {}}, b"", "unreadable"),
    ],
)
def test_a_frame_that_is_not_plain_data_is_refused(header, payload, message):
    with pytest.raises(FrameError, match=message):
        CODEC.decode(frame(header, payload))


def test_an_unregistered_object_is_not_sent():
    with pytest.raises(TypeError, match="register"):
        Codec([Inner]).encode("step", tree=Outer(Inner(np.zeros(1), np.bool_(False)), None, []))
