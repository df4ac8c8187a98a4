"""The pickle-free codec for nested state: exact round trips and clear refusals."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpckpt.errors import UnsupportedValueError
from ddpckpt.tree import decode, encode

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.complex_numbers(allow_nan=False),
)
keys = st.one_of(
    st.text(max_size=6), st.integers(-5, 5), st.tuples(st.integers(0, 3), st.text(max_size=3))
)
tensors = st.builds(
    lambda shape, dtype: torch.arange(math.prod(shape)).reshape(shape).to(dtype),
    st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.uint8]),
)
trees = st.recursive(
    st.one_of(scalars, tensors),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(st.text(max_size=5), children, max_size=4).map(OrderedDict),
    ),
    max_leaves=25,
)


def assert_same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    elif isinstance(a, complex):
        assert a == b or (math.isnan(a.real) and math.isnan(b.real))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def roundtrip(value):
    table: dict[str, torch.Tensor] = {}
    tree = encode(value, "root", table)
    tree = json.loads(json.dumps(tree, allow_nan=False))  # what really reaches the manifest
    return decode(tree, table.__getitem__)


@settings(max_examples=300, deadline=None)
@given(trees)
def test_encode_decode_roundtrip_preserves_types_and_values(value) -> None:
    assert_same(roundtrip(value), value)


def test_types_that_json_would_lose_survive() -> None:
    value = {
        "betas": (0.9, 0.999),
        1: "int key",
        "$tensor": "a user key that looks like a tag",
        "nan": float("nan"),
        "inf": -math.inf,
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "set": {1, 2},
        "np_scalar": np.float32(0.1),
        "np_array": np.arange(6, dtype=np.uint32).reshape(2, 3),
    }
    back = roundtrip(value)
    assert back["betas"] == (0.9, 0.999) and type(back["betas"]) is tuple
    assert back[1] == "int key" and back["$tensor"] == value["$tensor"]
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert back["dtype"] is torch.bfloat16 and back["size"] == torch.Size([2, 3])
    assert back["set"] == {1, 2}
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == np.float32(0.1)
    assert back["np_array"].dtype == np.uint32 and (back["np_array"] == value["np_array"]).all()


def test_tensors_are_named_by_path() -> None:
    table: dict[str, torch.Tensor] = {}
    encode({"state": {"w": {"exp_avg": torch.zeros(1)}}, "l": [torch.ones(1)]}, "optimizer", table)
    assert sorted(table) == ["optimizer/l/0", "optimizer/state/w/exp_avg"]


@pytest.mark.parametrize(
    "value",
    [lambda x: x, object(), np.array([object()]), type("Custom", (), {})()],
    ids=["function", "object", "object-array", "custom-class"],
)
def test_unstorable_values_name_their_key(value) -> None:
    with pytest.raises(UnsupportedValueError, match=r"sched/lr_lambdas/0"):
        encode({"lr_lambdas": [value]}, "sched", {})
