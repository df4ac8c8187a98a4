"""ddpckpt.integrations.transformers against the real Trainer: a DDP run SIGKILLed inside an
epoch resumes bit for bit (losses, logged losses, weights), and its checkpoint exports to a
from_pretrained directory; a checkpoint made by someone else is only read (links planted in
it are never followed), and its saved configuration never names the code that runs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

import ddpckpt
import s3server
from killed_run import assert_resumed_exactly, launch_killed_run
from launch import WORKER, torchrun_nodes

pytestmark = pytest.mark.skipif(find_spec("transformers") is None, reason="no transformers extra")

SCRIPT = WORKER.with_name("transformers_worker.py")


@pytest.mark.long
def test_a_run_killed_inside_an_epoch_resumes_bit_for_bit(tmp_path: Path) -> None:
    run = launch_killed_run(SCRIPT, tmp_path)
    assert_resumed_exactly(run, resumed_from=9, steps=7)  # inside the second epoch of 8 steps
    for rank in (0, 1):  # the first logged loss after 9 averages steps 9 and 10
        assert run.result(rank)["logged_losses"] == run.result(rank)["reference"]["logged_losses"]
    events = run.result(0)["checkpoint_events"]
    # 3 and 6 came with checkpoint 9; 9's own was logged after 9 was written, by the killed run
    assert [e["step"] for e in events] == [3, 6, 12, 15, 16]
    assert all(e["checkpoint/size_bytes"] > 0 and e["checkpoint/verified"] == 1 for e in events)
    directory = tmp_path / "checkpoints-ddpckpt"
    assert run.result(0)["checkpoints"] == ["checkpoint-15", "checkpoint-16"]  # save_total_limit=2
    assert run.result(0)["exported"] == run.result(0)["weights"]  # from_pretrained: the same model
    assert sorted(os.listdir(tmp_path / "release")) == ["config.json", "generation_config.json",
                                                        "model.safetensors"]  # fmt: skip
    for name in os.listdir(directory / "checkpoint-16"):  # nothing pickled
        assert name == "trainer_state.json" or name.endswith((".safetensors", "manifest.json"))
    ddpckpt.verify(str(directory / "checkpoint-16"))


# ------------------------------------------------------------------ a checkpoint is only read


def _tiny_args(directory: Path, max_steps: int):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(directory), per_device_train_batch_size=4, max_steps=max_steps,
        save_strategy="steps", save_steps=2, logging_steps=2, report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip


def _tiny_fit(directory: Path, stop_at: int = 6, resume: str | None = None):
    """One process, a tiny GPT-2 on CPU, 6 steps (stopped after ``stop_at``, as a job
    would be); the trainer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback
    from transformers.utils import logging as hf_logging

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= stop_at

    from ddpckpt.integrations.transformers import DdpckptTrainer
    from transformers_worker import Tokens

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1,
                                       n_head=2))  # fmt: skip
    trainer = DdpckptTrainer(model=model, args=_tiny_args(directory, 6), train_dataset=Tokens(),
                             callbacks=[Stop()])  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _tree(directory: Path) -> dict[str, str]:
    """Every entry under ``directory``: a link's target, a file's digest (never followed)."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root, name)
            if path.is_symlink():
                found[str(path.relative_to(directory))] = "-> " + os.readlink(path)
            elif path.is_file():
                found[str(path.relative_to(directory))] = hashlib.sha256(
                    path.read_bytes()
                ).hexdigest()
    return found


@pytest.mark.processes
def test_on_node_local_disks_every_nodes_copy_is_rotated_and_has_its_trainer_state(
    tmp_path: Path,
) -> None:
    """Two simulated nodes of 2 processes, each with a disk of its own (a relative
    output_dir, one working directory per node), save_total_limit=2. Rotation and
    trainer_state.json used to happen on global process 0 only: node 1 kept every
    checkpoint (its disk filled) and none had a trainer_state.json."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    launch = torchrun_nodes(
        "rotate", tmp_path / "out", args=["--output-dir", "out"], cwds=nodes, timeout=240,
        worker=WORKER.with_name("trainer_nodes_worker.py"),
    ).ok()  # fmt: skip
    for node in nodes:
        assert sorted(p.name for p in (node / "out").iterdir()) == [
            "checkpoint-6", "checkpoint-8"
        ], node  # fmt: skip
        for checkpoint in ("checkpoint-6", "checkpoint-8"):
            assert (node / "out" / checkpoint / "trainer_state.json").is_file(), checkpoint
            assert ddpckpt.verify(str(node / "out" / checkpoint)) is not None
    assert {r["node"] for r in launch.results.values()} == {"0", "1"}


@pytest.mark.skipif(bool(s3server.missing()), reason=str(s3server.missing()))
def test_an_s3_output_dir_is_saved_rotated_and_resumed_from(s3_root, tmp_path: Path) -> None:
    """output_dir on an object store: each checkpoint committed there with its
    trainer_state.json, rotated to save_total_limit through the store (the Trainer's own
    rotation globs a local directory), and resume_from_checkpoint=True resumes from it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from ddpckpt.integrations.transformers import DdpckptTrainer
    from ddpckpt.storage import storage_for
    from transformers_worker import Tokens

    run = f"{s3_root}/trainer"

    def trainer(steps: int) -> DdpckptTrainer:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
        args = TrainingArguments(
            output_dir=run, per_device_train_batch_size=4, max_steps=steps, save_steps=2,
            save_strategy="steps", save_total_limit=2, report_to=[], seed=0, use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        return DdpckptTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens())

    first = trainer(6)
    first.train()
    store = storage_for(run)
    assert sorted(store.list(run)) == ["checkpoint-4", "checkpoint-6"]
    for name in ("checkpoint-4", "checkpoint-6"):
        assert json.loads(store.read(f"{run}/{name}/trainer_state.json"))["global_step"] == int(
            name.split("-")[1]
        )
    second = trainer(8)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 8
    assert sorted(store.list(run)) == ["checkpoint-6", "checkpoint-8"]
    assert not Path("s3:").exists()  # Trainer.__init__ made the URL as a local directory


@pytest.mark.long
def test_a_resume_writes_nothing_into_the_checkpoint_and_follows_no_link_planted_there(
    tmp_path: Path,
) -> None:
    """The checkpoint resumed from lost its trainer_state.json and holds links where the
    Trainer would write or read it (``trainer_state.json``, ``trainer_state.json.<pid>.tmp``,
    pointing at a file of the user's outside it): the resume reads the state from the
    manifest, writes nothing there, changes nothing outside, and ends where an uninterrupted
    run ends."""
    import torch

    reference = _tiny_fit(tmp_path / "reference")
    _tiny_fit(tmp_path / "run", stop_at=4)
    ckpt = tmp_path / "run" / "checkpoint-4"
    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps({"global_step": 2}))  # valid JSON, a TrainerState's even
    (ckpt / "trainer_state.json").unlink()
    for pid in {os.getpid(), *range(os.getpid() - 2, os.getpid() + 3)}:
        (ckpt / f"trainer_state.json.{pid}.tmp").symlink_to(victim)
    before, outside = _tree(ckpt), victim.read_bytes()
    resumed = _tiny_fit(tmp_path / "run", resume=str(ckpt))
    assert _tree(ckpt) == before and victim.read_bytes() == outside
    assert resumed.state.global_step == 6
    for (key, value), expected in zip(resumed.model.state_dict().items(),
                                      reference.model.state_dict().values(), strict=True):  # fmt: skip
        assert torch.equal(value, expected), key
    # The same with trainer_state.json itself a link to the user's file.
    (tmp_path / "run" / "checkpoint-6").rename(tmp_path / "checkpoint-6-first")
    (ckpt / "trainer_state.json").symlink_to(victim)
    before = _tree(ckpt)
    again = _tiny_fit(tmp_path / "run", resume=str(ckpt))
    assert _tree(ckpt) == before and victim.read_bytes() == outside
    assert again.state.global_step == 6
    assert torch.equal(again.model.lm_head.weight, reference.model.lm_head.weight)
    state = json.loads((tmp_path / "run" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6  # what it writes in its own output directory: whole


# ------------------------------------------------------------------ export_pretrained


def _tiny_checkpoint(path: Path, edit=None, text: str | None = None):
    """A checkpoint laid out as DdpckptTrainer's (model ``model``, extra ``config``) of a
    tiny GPT-2, its saved configuration changed by ``edit`` or replaced by ``text``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1,
                                       n_head=2))  # fmt: skip
    doc = json.loads(model.config.to_json_string())
    doc["architectures"] = ["GPT2LMHeadModel"]
    if edit is not None:
        edit(doc)
    config = json.dumps(doc) if text is None else text
    ddpckpt.save(path, ddpckpt.TrainingState({"model": model, "config": config}, rng=False))
    return model


def _set(key, value):
    return lambda doc: doc.__setitem__(key, value)


def test_export_pretrained_rebuilds_a_class_of_transformers_from_its_saved_config(
    tmp_path: Path,
) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    from ddpckpt.integrations.transformers import export_pretrained

    model = _tiny_checkpoint(tmp_path / "ckpt")
    out = export_pretrained(tmp_path / "ckpt", tmp_path / "release")
    loaded = GPT2LMHeadModel.from_pretrained(out)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_an_architecture_naming_another_callable_of_transformers_calls_nothing(
    tmp_path: Path, monkeypatch
) -> None:
    import transformers

    from ddpckpt.integrations.transformers import export_pretrained

    called = []
    monkeypatch.setattr(transformers, "set_seed", lambda *a, **k: called.append(a))
    for name in ("set_seed", "AutoModel", "GPT2Model.from_pretrained", "BertModel", "Trainer"):
        ckpt = tmp_path / name
        _tiny_checkpoint(ckpt, _set("architectures", [name]))
        with pytest.raises(ddpckpt.CorruptCheckpointError, match=r"'architectures'"):
            export_pretrained(ckpt, tmp_path / "out")
    assert called == [] and not (tmp_path / "out").exists()


_HUGE = """
import resource, sys, time
import ddpckpt
from ddpckpt.integrations.transformers import export_pretrained

with open("/proc/self/status") as status:
    size = next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
for ckpt in sys.argv[1:]:
    started = time.monotonic()
    try:
        export_pretrained(ckpt, ckpt + "-out")
        print("exported")
    except ddpckpt.CorruptCheckpointError as exc:
        print("refused", time.monotonic() - started, str(exc).replace(chr(10), " "))
"""


@pytest.mark.long
def test_a_config_claiming_billions_of_parameters_is_refused_before_any_allocation(
    tmp_path: Path,
) -> None:
    """In a process that may map only 1 GiB more than it holds after its imports: the
    model is built on the meta device (its shapes found unlike the checkpoint's tensors),
    or stopped as it registers its millionth layer's modules."""
    edits = {
        "10B-parameters": {"vocab_size": 100_000, "n_embd": 100_000},  # in its embedding
        "a-million-layers": {"n_layer": 1_000_000},
    }
    for name, edit in edits.items():
        _tiny_checkpoint(tmp_path / name, lambda doc, edit=edit: doc.update(edit))
    run = subprocess.run([sys.executable, "-c", _HUGE, *(str(tmp_path / n) for n in edits)],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == len(edits), run.stdout
    for name, line in zip(edits, lines, strict=True):
        verdict, seconds, message = line.split(" ", 2)
        assert verdict == "refused" and float(seconds) < 30, line
        assert name in message and not (tmp_path / f"{name}-out").exists()


def test_a_config_whose_unsaved_buffers_are_huge_is_refused_before_building(
    tmp_path: Path,
) -> None:
    """GPT-Neo keeps a causal mask of max_position_embeddings squared bytes outside its
    state: a checkpoint of a few hundred kB (a 60,000-position table one wide) whose
    config asks for it would make the export allocate 3.6 GB."""
    import torch
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from ddpckpt.integrations.transformers import export_pretrained

    positions = 60_000
    config = GPTNeoConfig(vocab_size=16, hidden_size=2, num_layers=1, num_heads=1,
                          max_position_embeddings=8, attention_types=[[["global"], 1]])  # fmt: skip
    model = GPTNeoForCausalLM(config)
    model.transformer.wpe = torch.nn.Embedding(positions, 2)  # the table the config names
    doc = json.loads(model.config.to_json_string())
    doc.update(architectures=["GPTNeoForCausalLM"], max_position_embeddings=positions)
    state = ddpckpt.TrainingState({"model": model, "config": json.dumps(doc)}, rng=False)
    ddpckpt.save(tmp_path / "ckpt", state)
    with pytest.raises(ddpckpt.CorruptCheckpointError, match="bytes of parameters and buffers"):
        export_pretrained(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda doc: doc.pop("model_type"), "'model_type' is missing"),
        (_set("model_type", 3), "'model_type'"),
        (_set("model_type", "no-such-type"), "no model type of transformers"),
        (lambda doc: doc.pop("architectures"), "'architectures' is missing"),
        (_set("architectures", "GPT2LMHeadModel"), "'architectures'"),
        (_set("architectures", []), "'architectures'"),
        (_set("architectures", ["GPT2LMHeadModel", "GPT2Model"]), "'architectures'"),
        (_set("n_embd", "8"), "'n_embd'"),
        (_set("n_layer", 1.5), "'n_layer'"),
        (_set("n_layer", True), "'n_layer'"),
        (_set("vocab_size", -1), "cannot be built"),
        (_set("n_head", 0), "cannot be built"),
        (_set("n_embd", 10**30), "'n_embd'"),
        (_set("n_embd", 16), "shape"),  # well-formed, but not the checkpoint's model
        (_set("id2label", {"x": "y"}), "refuses"),
        (_set("dtype", "set_default_device"), "'dtype'"),
        (_set("activation_function", {"a": [1]}), "'activation_function'"),
        (_set("problem_type", "x" * 100_000), "'problem_type'"),
    ],
)
def test_a_malformed_saved_config_is_a_corrupt_checkpoint_naming_the_field(
    tmp_path: Path, edit, says: str
) -> None:
    from ddpckpt.integrations.transformers import export_pretrained

    _tiny_checkpoint(tmp_path / "ckpt", edit)
    with pytest.raises(ddpckpt.CorruptCheckpointError, match=says) as caught:
        export_pretrained(tmp_path / "ckpt", tmp_path / "out")
    assert str(tmp_path / "ckpt") in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["{not json", "[]", "null", '{"model_type": NaN}', "1" * 5000])
def test_a_saved_config_that_is_no_json_object_is_a_corrupt_checkpoint(
    tmp_path: Path, text: str
) -> None:
    from ddpckpt.integrations.transformers import export_pretrained

    _tiny_checkpoint(tmp_path / "ckpt", text=text)
    started = time.monotonic()
    with pytest.raises(ddpckpt.CorruptCheckpointError, match="saved model config"):
        export_pretrained(tmp_path / "ckpt", tmp_path / "out")
    assert time.monotonic() - started < 10
