"""The pickle-free codec for nested state: exact round trips and clear refusals."""

from __future__ import annotations

import copy
import enum
import json
import math
import os
from collections import Counter, OrderedDict, defaultdict, deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ddpckpt
from ddpckpt._format.codec import decode, encode
from ddpckpt._format.manifest import read_manifest
from ddpckpt.errors import CorruptCheckpointError, UnsupportedValueError
from ddpckpt.storage._location import locate
from stored import assert_loaded_as_stored, assert_near_optimizer

V1_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "format-v1")


class Phase(enum.Enum):
    WARMUP = "warmup"
    DECAY = "decay"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


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
        st.dictionaries(keys, st.integers(-3, 3), max_size=4).map(Counter),
        st.lists(children, max_size=4).map(lambda items: deque(items, maxlen=6)),
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
    elif isinstance(a, (list, tuple, deque)):
        assert len(a) == len(b) and getattr(a, "maxlen", None) == getattr(b, "maxlen", None)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b) and getattr(a, "default_factory", 0) == getattr(
            b, "default_factory", 0
        )
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


def test_collections_and_enums_keep_their_type() -> None:
    by_phase: defaultdict[Phase, list[int]] = defaultdict(list, {Phase.DECAY: [3]})
    value = {
        "milestones": Counter({30: 1, 60: 2}),  # what MultiStepLR.state_dict() holds
        "by_phase": by_phase,
        "no_factory": defaultdict(None, {"a": 1}),
        "window": deque([1.5, 2.5], maxlen=3),
        "phase": Phase.WARMUP,
        "level": Level.HIGH,
        Level.LOW: "enum key",
    }
    back = roundtrip(value)
    assert_same(back, value)
    assert type(back["milestones"]) is Counter and back["milestones"][60] == 2
    assert back["by_phase"].default_factory is list and back["by_phase"]["new"] == []
    assert back["no_factory"].default_factory is None
    assert back["window"].maxlen == 3
    assert back["phase"] is Phase.WARMUP and back["level"] is Level.HIGH
    assert back[Level.LOW] == "enum key"


def test_defaultdict_with_a_lambda_factory_is_refused_with_its_key() -> None:
    with pytest.raises(UnsupportedValueError, match=r"extra/counts: .*default_factory"):
        encode(defaultdict(lambda: 0), "extra/counts", {})


def test_enum_defined_in_a_function_is_refused_with_its_key() -> None:
    class Local(enum.Enum):
        A = 1

    with pytest.raises(UnsupportedValueError, match=r"extra/mode: .*member.value"):
        encode(Local.A, "extra/mode", {})


def test_enum_of_a_module_not_imported_is_not_imported_on_load() -> None:
    tree = {"$enum": ["a_module_nobody_imported", "Phase", "WARMUP"]}
    with pytest.raises(UnsupportedValueError, match=r"import a_module_nobody_imported"):
        decode(tree, {}.__getitem__, where="ckpt")
    assert "a_module_nobody_imported" not in __import__("sys").modules


def test_tag_from_a_newer_version_says_to_upgrade() -> None:
    with pytest.raises(CorruptCheckpointError, match="upgrade"):
        decode({"$future": 1}, {}.__getitem__, where="ckpt")


def test_checkpoint_of_format_version_1_still_loads() -> None:
    """A checkpoint written before version 2 (Counter, defaultdict, deque, enum) loads as is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for _ in range(3):  # how the stored checkpoint was made
        opt.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
        sched.step()
    expected = (copy.deepcopy(model.state_dict()),)
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1, betas=(0.8, 0.9))
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 2, gamma=0.5)
    extra = {"values": None}
    info = ddpckpt.load(
        V1_CHECKPOINT, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, extra=extra
    )
    assert read_manifest(locate(V1_CHECKPOINT)).format_version == 1 and info.step == 3
    assert_loaded_as_stored(fresh, fresh_opt, V1_CHECKPOINT)
    torch.testing.assert_close(dict(fresh.state_dict()), dict(expected[0]))
    assert_near_optimizer(fresh_opt, opt)
    assert fresh_sched.state_dict() == sched.state_dict()
    assert_same(
        extra["values"],
        {"pair": (1, 2.5), "tags": {"a", "b"}, 3: float("inf"), "dtype": torch.float16},
    )
