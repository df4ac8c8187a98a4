"""`ddpckpt ls` and `inspect` on the directories the docs teach users to make, not only a
Checkpointer's run directory: the quickstart's `ckpt/step-{step}` (unpadded), Lightning's
`checkpoints/`, a Trainer's `output_dir`. Each is listed by saved step (numbers as
numbers), with the checkpoint `ddpckpt.load_latest` would load, and no message says that
a checkpoint load_latest loads is never loaded."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

import ddpckpt
from conftest import make_mlp
from ddpckpt._cli.main import main
from ddpckpt._run.catalog import latest
from ddpckpt.storage._location import locate

FALSE_CLAIM = "never loaded"


def quickstart_dir(tmp_path: Path, steps=(9, 19, 79)) -> str:
    """What docs/quickstart.md's script leaves: `ckpt/step-{step}`, saved with step=."""
    model = make_mlp()
    for step in steps:
        ddpckpt.save(tmp_path / "ckpt" / f"step-{step}", model=model, step=step,
                     metrics={"loss": 1.0 / step}, overwrite=True)  # fmt: skip
    return os.fspath(tmp_path / "ckpt")


def lightning_dir(tmp_path: Path) -> str:
    """A `ModelCheckpoint(dirpath="checkpoints", save_last=True)` directory as
    DdpckptCheckpointIO.save_checkpoint writes it: save_dict of Lightning's dict, with its
    global_step and epoch (importing Lightning itself takes longer than the whole test)."""
    directory = tmp_path / "checkpoints"
    model = make_mlp()
    for epoch, step in ((0, 8), (1, 16), (9, 80)):
        for name in (f"epoch={epoch}-step={step}.ckpt", "last.ckpt"):
            checkpoint = {"state_dict": model.state_dict(), "global_step": step, "epoch": epoch}
            ddpckpt.save_dict(directory / name, checkpoint, step=step, epoch=epoch, overwrite=True)
    return os.fspath(directory)


def trainer_dir(tmp_path: Path) -> str:
    """A DdpckptTrainer's output_dir: `checkpoint-<step>` saved with step=, each with the
    trainer_state.json it writes next to ddpckpt's files, and the Trainer's `runs/`."""
    directory = tmp_path / "out"
    model = make_mlp()
    for step in (8, 64, 512):
        path = directory / f"checkpoint-{step}"
        ddpckpt.save(path, model=model, step=step, overwrite=True)
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (directory / "runs").mkdir()
    return os.fspath(directory)


@pytest.mark.parametrize(
    ("build", "names", "newest"),
    [
        (quickstart_dir, ["step-9", "step-19", "step-79"], "step-79"),
        (trainer_dir, ["checkpoint-8", "checkpoint-64", "checkpoint-512"], "checkpoint-512"),
    ],
    ids=["quickstart", "trainer"],
)
def test_ls_lists_a_directory_of_saves_by_step_and_names_what_load_latest_loads(
    tmp_path, capsys, caplog, build, names, newest
) -> None:
    directory = build(tmp_path)
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert main(["ls", directory]) == 0
    captured = capsys.readouterr()
    out, said = captured.out, captured.out + captured.err + caplog.text
    assert FALSE_CLAIM not in said and "not a run directory" not in said
    assert "WARNING" not in said  # nothing is wrong here
    rows = [
        line.split()[0]
        for line in out.splitlines()
        if line.split()[:1] and line.split()[0] in names
    ]
    assert rows == names  # numbers as numbers
    picked = os.path.join(directory, newest)
    assert latest(directory) == picked  # the library's own choice ...
    assert f"ddpckpt.load_latest({directory!r}) loads {picked} (step " in out  # ... is named
    newest_line = next(line for line in out.splitlines() if line.startswith(newest + " "))
    assert newest_line.split()[1] == newest.rpartition("-")[2] and "verified" in newest_line
    assert newest_line.rstrip().endswith("load_latest")

    assert main(["ls", "--json", directory]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in doc["checkpoints"]] == names
    assert [c["step"] for c in doc["checkpoints"]] == [int(n.rpartition("-")[2]) for n in names]
    assert doc["load_latest"] == picked and doc["kind"] == "checkpoints"
    assert all(c["status"] == "verified" and c["bytes"] > 0 for c in doc["checkpoints"])
    if build is quickstart_dir:
        assert doc["checkpoints"][-1]["metrics"] == {"loss": 1.0 / 79}
    else:
        assert doc["others"] == ["runs"]


def test_ls_lists_lightnings_checkpoints_directory(tmp_path, capsys, caplog) -> None:
    directory = lightning_dir(tmp_path)
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert main(["ls", "--json", directory]) == 0
    captured = capsys.readouterr()
    assert "WARNING" not in captured.err + caplog.text
    doc = json.loads(captured.out)
    rows = [(c["name"], c["step"]) for c in doc["checkpoints"]]
    assert rows[:2] == [("epoch=0-step=8.ckpt", 8), ("epoch=1-step=16.ckpt", 16)]
    assert {rows[2], rows[3]} == {("epoch=9-step=80.ckpt", 80), ("last.ckpt", 80)}
    assert doc["load_latest"] == latest(directory)  # step 80, the newer of the two
    assert main(["ls", directory]) == 0
    out = capsys.readouterr().out
    assert f"loads {latest(directory)} (step 80)" in out


def test_ls_says_what_load_latest_loads_when_the_newest_is_damaged(tmp_path, capsys) -> None:
    directory = quickstart_dir(tmp_path)
    data = os.path.join(directory, "step-79", "model-00000.safetensors")
    with open(data, "r+b") as f:  # a flipped bit: only reading the data finds it
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    capsys.readouterr()
    assert main(["ls", directory]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in next(line for line in out.splitlines() if line.startswith("step-79 "))
    picked = os.path.join(directory, "step-19")
    assert (
        f"loads {picked} (step 19): the newest by saved step that verifies, after "
        "skipping the damaged step-79" in out
    )
    model = make_mlp(1)
    assert ddpckpt.load_latest(directory, model=model).path == picked  # what ls said


def test_inspect_of_a_directory_of_saves_suggests_the_newest_and_ls(tmp_path, capsys) -> None:
    directory = quickstart_dir(tmp_path)
    capsys.readouterr()
    assert main(["inspect", directory]) == 2
    err = capsys.readouterr().err
    assert "a directory holding checkpoints (step-9, step-19, step-79)" in err
    assert f"e.g. {os.path.join(directory, 'step-79')}" in err
    assert f"`ddpckpt ls {directory}`" in err


def test_a_stray_name_in_a_checkpointers_run_directory_is_still_reported(
    tmp_path, capsys, caplog
) -> None:
    run = tmp_path / "run"
    model = make_mlp()
    with ddpckpt.Checkpointer(run, model=model) as ckpt:
        ckpt.save(4)
    ddpckpt.save(run / "step-5", model=model, step=5)  # not the run's spelling
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert main(["ls", os.fspath(run)]) == 0
    assert (
        "step-5: skipped: not a checkpoint name ddpckpt writes (ddpckpt writes "
        "step-00000005); it is never loaded, kept or deleted by the run" in caplog.text
    )
    out = capsys.readouterr().out
    assert "step-00000004" not in out and out.splitlines()[2].startswith("4 ")


def test_ls_of_an_unrelated_directory_still_says_it_holds_no_checkpoints(tmp_path, capsys) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("nothing here\n")
    (tmp_path / "notes" / "sub").mkdir()
    assert main(["ls", os.fspath(tmp_path / "notes")]) == 2
    err = capsys.readouterr().err
    assert "not a run directory" in err and "no checkpoint saved with ddpckpt.save" in err


def test_a_run_directorys_suggestion_orders_steps_as_numbers(tmp_path) -> None:
    from ddpckpt._format.runfiles import describe_path

    run = tmp_path / "run"
    for step in (99_999_999, 100_000_000):  # 8 digits and 9: text order puts 9 digits first
        (run / f"step-{step:08d}").mkdir(parents=True)
    message = describe_path(locate(os.fspath(run)))
    assert message is not None and message.endswith(os.path.join(run, "step-100000000"))
    from ddpckpt._format.runfiles import natural_key

    assert sorted(["step-19", "step-9", "b", "a10", "a9"], key=natural_key) == [
        "a9", "a10", "b", "step-9", "step-19"
    ]  # fmt: skip
