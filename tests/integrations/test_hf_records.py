"""The parsers of what a DdpckptTrainer checkpoint says about the Trainer and the model, fuzzed:
any JSON gives a typed record or CorruptCheckpointError, nothing else, and nothing the
document names is called."""

from __future__ import annotations

import dataclasses
import json
from importlib.util import find_spec

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpckpt.errors import CorruptCheckpointError

pytestmark = [
    pytest.mark.skipif(find_spec("transformers") is None, reason="no transformers extra"),
    pytest.mark.long,  # transformers' import, then a few hundred documents
]

WHERE = "ckpt/checkpoint-7"

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _state_documents():
    from transformers import TrainerState

    names = [f.name for f in dataclasses.fields(TrainerState)]
    callback = st.fixed_dictionaries(
        {}, optional={"args": json_values, "attributes": json_values, "other": json_values}
    )
    special = {
        "log_history": st.lists(
            st.dictionaries(st.text(max_size=8), json_values, max_size=3), max_size=3
        )
        | json_values,
        "stateful_callbacks": st.dictionaries(
            st.text(max_size=20),
            callback | st.lists(callback, max_size=2) | json_values,
            max_size=2,
        ),
        "trial_params": st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    }
    optional = {name: special.get(name, json_values) for name in names}
    return st.fixed_dictionaries({}, optional=optional) | json_values


def _config_documents():
    types = st.sampled_from(["gpt2", "bert", "llama", "t5", "no-such", ""]) | json_values
    classes = st.sampled_from(
        ["GPT2LMHeadModel", "GPT2Model", "BertModel", "LlamaForCausalLM", "set_seed",
         "AutoModel", "Trainer", "PreTrainedModel", "__class__", "os.system"]
    )  # fmt: skip
    architectures = st.lists(classes, min_size=0, max_size=2) | json_values
    fields = st.sampled_from(["n_embd", "n_layer", "vocab_size", "dtype", "id2label",
                              "hidden_size", "activation_function", "tie_word_embeddings"])  # fmt: skip
    return (
        st.fixed_dictionaries(
            {}, optional={"model_type": types, "architectures": architectures}
        ).flatmap(
            lambda doc: st.dictionaries(fields, json_values, max_size=3).map(
                lambda extra: {**extra, **doc}
            )
        )
        | json_values
    )


def _text(doc, raw: str | None) -> str:
    return raw if raw is not None else json.dumps(doc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.deferred(_state_documents), raw=st.none() | st.text(max_size=30))
def test_any_saved_trainer_state_is_a_trainer_state_or_a_corrupt_checkpoint(doc, raw) -> None:
    from transformers import TrainerState

    from ddpckpt.integrations._hf_records import trainer_state_from_json

    try:
        state = trainer_state_from_json(_text(doc, raw), WHERE)
    except CorruptCheckpointError as exc:
        refused = str(exc)
        assert WHERE in refused
        return
    assert isinstance(state, TrainerState)
    assert type(state.global_step) is int and state.global_step >= 0
    assert isinstance(state.log_history, list) and isinstance(state.stateful_callbacks, dict)
    for saved in state.stateful_callbacks.values():
        for one in saved if isinstance(saved, list) else [saved]:
            assert set(one) == {"args", "attributes"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.deferred(_config_documents), raw=st.none() | st.text(max_size=30))
def test_any_saved_model_config_is_a_known_class_or_a_corrupt_checkpoint(
    doc, raw, monkeypatch_module
) -> None:
    from transformers import PreTrainedModel

    from ddpckpt.integrations._hf_records import (
        SavedModelConfig,
        model_class,
        model_config_from_json,
    )

    try:
        saved = model_config_from_json(_text(doc, raw), WHERE)
        assert isinstance(saved, SavedModelConfig)
        cls = model_class(saved, WHERE)
    except CorruptCheckpointError as exc:
        refused = str(exc)
        assert WHERE in refused
        return
    finally:
        assert monkeypatch_module == []  # nothing of transformers' top level was called
    assert issubclass(cls, PreTrainedModel) and cls.__name__ == saved.architecture
    assert cls.config_class.model_type == saved.model_type


@pytest.fixture(scope="module")
def monkeypatch_module():
    """Record any call of transformers' top-level functions a document could name."""
    import transformers

    called: list[str] = []
    saved = {}
    for name in ("set_seed", "enable_full_determinism", "is_torch_available"):
        saved[name] = getattr(transformers, name)
        setattr(transformers, name, lambda *a, _name=name, **k: called.append(_name))
    yield called
    for name, value in saved.items():
        setattr(transformers, name, value)
