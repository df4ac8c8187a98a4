"""The ddpckpt command line, as a user runs it."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt._cli.main import main
from ddpckpt.storage._location import locate


def saved(path: str, seed: int = 0, step: int = 5) -> str:
    model = make_mlp(seed)
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    return ddpckpt.save(path, model=model, optimizer=opt, step=step, metrics={"loss": 1.5})


def test_inspect_prints_metadata_and_table(ckpt_dir, capsys) -> None:
    saved(ckpt_dir)
    assert main(["inspect", ckpt_dir]) == 0
    out = capsys.readouterr().out
    assert "step        5" in out and "loss=1.5" in out
    assert "optimizer: Adam" in out
    assert "model/0.weight" in out and "[8, 4]" in out and "F32" in out


def flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def test_verify_exit_codes_name_bad_files(ckpt_dir, tmp_path, capsys) -> None:
    saved(ckpt_dir)
    assert main(["verify", ckpt_dir]) == 0
    flip_last_byte(os.path.join(ckpt_dir, "model-00000.safetensors"))
    capsys.readouterr()
    assert main(["verify", ckpt_dir]) == 1  # found a problem
    out = capsys.readouterr().out
    assert "BAD   " + ckpt_dir in out and "model-00000.safetensors" in out
    assert main(["verify", ckpt_dir, os.fspath(tmp_path / "missing")]) == 2  # cannot verify it
    out = capsys.readouterr().out
    assert "BAD   " + ckpt_dir in out and "no checkpoint at this path" in out


def test_diff_export_import_commands(tmp_path, capsys) -> None:
    a = saved(os.fspath(tmp_path / "a"), seed=0)
    b = saved(os.fspath(tmp_path / "b"), seed=1, step=6)
    assert main(["diff", a, a]) == 0
    assert main(["diff", "--quick", a, a]) == 0  # a corrupt copy would compare the same
    assert "damage since the save is not detected" in capsys.readouterr().out
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "step: 5 -> 6" in out and "model/0.weight" in out
    assert main(["export", a, os.fspath(tmp_path / "w.safetensors")]) == 0
    gan = os.fspath(tmp_path / "gan")
    ddpckpt.save(gan, ddpckpt.TrainingState(G=make_mlp(), D=make_mlp()))
    assert main(["export", gan, os.fspath(tmp_path / "g.pt")]) == 2
    assert "--model NAME" in capsys.readouterr().err
    assert main(["export", gan, os.fspath(tmp_path / "g.pt"), "--model", "G"]) == 0
    torch.save({"model": make_mlp().state_dict(), "epoch": 2}, tmp_path / "old.pth")
    assert main(["import", os.fspath(tmp_path / "old.pth"), os.fspath(tmp_path / "imported")]) == 0
    assert ddpckpt.verify(tmp_path / "imported").epoch == 2
    assert main(["inspect", os.fspath(tmp_path / "nothing")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


@pytest.mark.processes
def test_console_script_runs(ckpt_dir) -> None:
    saved(ckpt_dir)
    result = subprocess.run(
        [sys.executable, "-m", "ddpckpt", "inspect", "--json", ckpt_dir],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert '"step": 5' in result.stdout


# --------------------------------------------------------------------------- wrong inputs


def run_dir_with_checkpoints(tmp_path, steps=(10, 20)) -> str:
    run = tmp_path / "run"
    model = make_mlp()
    with ddpckpt.Checkpointer(run, model=model, keep_last=5) as ckpt:
        for step in steps:
            ckpt.save(step, metrics={"loss": 1.0 / step})
    return os.fspath(run)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["inspect", "{empty}"], "an empty directory, not a checkpoint"),
        (["inspect", "{unrelated}"], "not a ddpckpt checkpoint"),
        (["inspect", "{run}"], "a run directory, not a checkpoint: try `ddpckpt ls {run}`"),
        (["export", "{run}", "{tmp}/w.safetensors"], "a run directory, not a checkpoint"),
        (["diff", "{run}", "{run}/step-00000020"], "a run directory, not a checkpoint"),
        (["diff", "{run}/step-00000020", "{empty}"], "an empty directory, not a checkpoint"),
        (["ls", "{run}/step-00000020"], "a checkpoint, not a run directory: try `ddpckpt inspect"),
        (["ls", "{unrelated}"], "not a run directory"),
        (["ls", "{tmp}/nonexistent"], "no such directory"),
        (["verify", "{tmp}/nonexistent"], "no checkpoint at this path"),
        (["verify", "{run}"], "a run directory, not a checkpoint"),
        (["import", "{unrelated}/plain.txt", "{tmp}/out"], "not a torch.save file"),
        (["demo", "--nproc", "0"], "--nproc 0: the demo needs at least 1 rank"),
        (["demo", "--steps", "20", "--every", "20"], "need 0 < every < steps"),
        (["bench", "--nproc", "one"], "--nproc one: give world sizes like 1,2"),
    ],
)
def test_each_wrong_input_says_what_it_is_and_exits_2(tmp_path, capsys, command, expected) -> None:
    paths = {"run": run_dir_with_checkpoints(tmp_path), "tmp": os.fspath(tmp_path)}
    for name in ("empty", "unrelated"):
        paths[name] = os.fspath(tmp_path / name)
        os.makedirs(paths[name])
    (tmp_path / "unrelated" / "plain.txt").write_text("hello, not a checkpoint\n")
    capsys.readouterr()
    assert main([part.format(**paths) for part in command]) == 2
    captured = capsys.readouterr()
    message = captured.err + captured.out
    assert expected.format(**paths) in message
    assert "did not finish" not in message and "Traceback" not in message
    assert len(captured.err.strip().splitlines()) <= 1  # one line, no traceback


def test_an_interrupted_save_is_still_called_one(tmp_path, capsys) -> None:
    broken = tmp_path / "step-00000030"
    broken.mkdir()
    (broken / "model-00000.safetensors").write_bytes(b"\0" * 64)
    assert main(["inspect", os.fspath(broken)]) == 2
    assert "did not finish" in capsys.readouterr().err
    assert main(["verify", os.fspath(broken)]) == 1  # a bad checkpoint, found


def test_messages_name_command_line_flags(tmp_path, ckpt_dir, capsys) -> None:
    saved(ckpt_dir)
    out = os.fspath(tmp_path / "w.pt")
    assert main(["export", ckpt_dir, out]) == 0
    assert main(["export", ckpt_dir, out]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    torch.save({"model": make_mlp().state_dict()}, tmp_path / "old.pth")
    args = ["import", os.fspath(tmp_path / "old.pth"), os.fspath(tmp_path / "imported")]
    assert main(args) == 0
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    assert main([*args, "--overwrite"]) == 0


@pytest.mark.processes
def test_a_closed_pipe_ends_quietly(ckpt_dir) -> None:
    saved(ckpt_dir)
    process = subprocess.Popen(
        [sys.executable, "-m", "ddpckpt", "inspect", ckpt_dir],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    process.stdout.close()  # the reader is gone before anything is written, as after `| head`
    _, err = process.communicate(timeout=120)
    assert b"Broken pipe" not in err and b"Traceback" not in err, err.decode()
    assert process.returncode == 141


def test_help_documents_the_exit_status(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "0  done, nothing wrong found" in out and "2  cannot do its job" in out


# --------------------------------------------------------------------------- ls and clean


def test_ls_json_gives_numbers(tmp_path, capsys) -> None:
    run = run_dir_with_checkpoints(tmp_path)
    capsys.readouterr()
    assert main(["ls", "--json", run]) == 0
    doc = json.loads(capsys.readouterr().out)
    first, last = doc["checkpoints"]
    assert (first["step"], last["step"]) == (10, 20)
    assert isinstance(last["bytes"], int) and last["bytes"] > 0
    assert isinstance(last["created"], float)
    assert last["metrics"] == {"loss": 0.05} and last["status"] == "verified"
    assert last["notes"] == ["latest"] and doc["leftovers"] == []


def test_ls_tells_a_run_with_a_fast_tier_and_a_fast_tier_what_they_are(tmp_path, capsys) -> None:
    """A run whose job has saved only to its fast tier holds just `fast-tier-owner`: ls used
    to call it "not a run directory" (exit 2). It lists it, says the newer steps may be in
    the nodes' fast tier, and ls of a fast tier names the run it belongs to."""
    run, fast = tmp_path / "run", tmp_path / "fast"
    with ddpckpt.Checkpointer(run, model=make_mlp(), every_steps=100, fast_tier=fast) as ckpt:
        for step in (1, 2):
            assert ckpt.should_save(step)
            ckpt.save(step)
    assert sorted(os.listdir(run)) == ["fast-tier-owner"]
    capsys.readouterr()
    assert main(["ls", os.fspath(run)]) == 0
    out = capsys.readouterr().out
    assert f"no checkpoints in {run}" in out and "this run also has a fast tier" in out
    from ddpckpt._format.runfiles import read_run_identity
    from ddpckpt._run.options import auto_directory

    where = auto_directory(read_run_identity(locate(os.fspath(run))))  # what fast_tier="auto" uses
    assert f"(with fast_tier='auto', {where}, this user's)" in out
    assert main(["ls", "--json", os.fspath(run)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["checkpoints"], doc["has_fast_tier"], doc["fast_tier_of"]) == ([], True, None)
    assert main(["verify", os.fspath(run)]) == 2
    assert "a run directory, not a checkpoint" in capsys.readouterr().out

    assert main(["ls", os.fspath(fast)]) == 0
    out = capsys.readouterr().out
    assert "step-00000002" not in out and out.splitlines()[2].startswith("2 ")
    assert f"is a fast tier (one node's copy, in memory) of the run directory {run}:" in out
    (fast / "owner.json").write_text("\x1b[2J#forged")  # hostile: no terminal escape printed
    assert main(["ls", "--json", os.fspath(fast)]) == 0
    assert json.loads(capsys.readouterr().out)["fast_tier_of"] == "'\\x1b[2J'"


def test_ls_quick_says_not_verified_and_catches_a_truncated_file(tmp_path, capsys) -> None:
    run = run_dir_with_checkpoints(tmp_path)
    capsys.readouterr()
    assert main(["ls", "--quick", run]) == 0
    out = capsys.readouterr().out
    assert "not verified" in out and "committed" not in out
    target = os.path.join(run, "step-00000020", "model-00000.safetensors")
    os.truncate(target, os.path.getsize(target) // 2)
    assert main(["ls", "--quick", run]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "model-00000.safetensors: file is" in out


def test_ls_shows_leftovers_with_their_size_and_clean_removes_them(tmp_path, capsys) -> None:
    run = run_dir_with_checkpoints(tmp_path)
    temporary = os.path.join(run, ".step-00000030.tmp-0a1b2c3d4e5f")
    shutil.copytree(os.path.join(run, "step-00000020"), temporary)  # a crash mid-save
    aside = os.path.join(run, "step-00000025.corrupt-0a1b2c3d4e5f")
    shutil.copytree(os.path.join(run, "step-00000010"), aside)
    capsys.readouterr()
    assert main(["ls", run]) == 0
    out = capsys.readouterr().out
    assert ".step-00000030.tmp-0a1b2c3d4e5f" in out and "step-00000025.corrupt-" in out
    assert "KiB" in out.split(".step-00000030.tmp-0a1b2c3d4e5f")[1].splitlines()[0]
    assert main(["ls", "--json", run]) == 0
    leftovers = json.loads(capsys.readouterr().out)["leftovers"]
    assert {x["kind"] for x in leftovers} == {"temporary", "corrupt"}
    assert all(x["bytes"] > 1000 for x in leftovers)

    assert main(["clean", "--dry-run", run]) == 0
    assert os.path.exists(temporary)
    assert main(["clean", run]) == 0
    assert not os.path.exists(temporary) and os.path.exists(aside)
    assert main(["clean", "--corrupt", run]) == 0
    assert not os.path.exists(aside)
    assert sorted(os.listdir(run)) == ["latest", "run.json", "step-00000010", "step-00000020"]
    assert ddpckpt.verify(os.path.join(run, "step-00000020")).step == 20


@pytest.mark.processes
@pytest.mark.parametrize("same_job", [False, True], ids=["other job", "shell in the same job"])
def test_clean_refuses_while_a_live_job_holds_the_lock(
    tmp_path, capsys, monkeypatch, same_job
) -> None:
    run = run_dir_with_checkpoints(tmp_path)
    temporary = os.path.join(run, ".step-00000030.tmp-0a1b2c3d4e5f")
    os.makedirs(temporary)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # the trainer's job
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from ddpckpt._run.runlock import RunLock; "
         "from ddpckpt.storage._location import locate; "
         f"lock = RunLock(locate({run!r})); lock.acquire(); print('held', flush=True); "
         "sys.stdin.read(); lock.release()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    if not same_job:
        monkeypatch.setenv("SLURM_JOB_ID", "777")
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["clean", run]) == 2
        err = capsys.readouterr().err
        assert "in use by another job" in err and "after that job has ended" in err
        assert os.path.exists(temporary)
    finally:
        holder.communicate("", timeout=120)
    assert main(["clean", run]) == 0
    assert not os.path.exists(temporary)


# --------------------------------------------------------------------------- diff


def test_diff_reports_a_bit_flipped_copy_as_corrupt(tmp_path, capsys) -> None:
    a = saved(os.fspath(tmp_path / "a"))
    b = os.fspath(tmp_path / "b")
    shutil.copytree(a, b)
    flip_last_byte(os.path.join(b, "model-00000.safetensors"))
    capsys.readouterr()
    assert main(["diff", a, b]) == 2
    err = capsys.readouterr().err
    assert f"{b} is corrupt" in err and "model-00000.safetensors" in err
    assert "identical" not in err


def test_diff_ignore_rng_compares_runs_that_differ_only_in_unseeded_generators(
    tmp_path, capsys
) -> None:
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    a, b = os.fspath(tmp_path / "a"), os.fspath(tmp_path / "b")
    ddpckpt.save(a, model=model, optimizer=opt, step=5)
    random.random()  # an unseeded generator drawn once more in the other run
    ddpckpt.save(b, model=model, optimizer=opt, step=5)
    capsys.readouterr()
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "differences by section: rng" in out and "--ignore rng" in out
    assert "seeded their generators differently or not at all" in out
    assert main(["diff", "--ignore", "rng", a, b]) == 0
    out = capsys.readouterr().out
    assert "0 differ, 0 other differences" in out and "ignored: rng" in out
    assert main(["diff", "--ignore", "rgn", a, b]) == 2
    assert "nothing called rgn to ignore" in capsys.readouterr().err


def test_diff_of_two_steps_of_one_run_blames_the_steps_for_the_rng(tmp_path, capsys) -> None:
    # Training 20 more steps moves every generator: not a seeding problem.
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    a, b = os.fspath(tmp_path / "a"), os.fspath(tmp_path / "b")
    ddpckpt.save(a, model=model, optimizer=opt, step=19)
    train_steps(model, opt)
    ddpckpt.save(b, model=model, optimizer=opt, step=39)
    capsys.readouterr()
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "the checkpoints are at steps 19 and 39, and training draws from them" in out
    assert "seeded" not in out


def test_a_run_directorys_own_files_are_named_for_what_they_are(tmp_path, capsys) -> None:
    """`ddpckpt inspect run/latest` names the checkpoint `latest` points at, not "a file: run
    ddpckpt import" (the message for a torch.save file)."""
    run = tmp_path / "run"
    with ddpckpt.Checkpointer(run, model=make_mlp()) as ckpt:
        ckpt.save(3)
    newest = os.fspath(run / "step-00000003")
    for command in ("inspect", "export"):
        args = [command, os.fspath(run / "latest")] + (
            [os.fspath(tmp_path / "w.pt")] if command == "export" else []
        )
        assert main(args) == 2
        err = capsys.readouterr().err
        assert (
            f"pointer to its newest checkpoint, not a checkpoint: name that checkpoint, {newest}"
            in err
        )
        assert "ddpckpt import" not in err
    assert main(["verify", os.fspath(run / "run.json")]) == 2
    assert f"a file of the run directory {run}, not a checkpoint" in capsys.readouterr().out


def test_a_bare_command_prints_the_help(capsys) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ddpckpt") and "check-resume" in out and "exit status" in out


def test_every_subcommand_explains_itself_and_each_of_its_arguments() -> None:
    import argparse

    from ddpckpt._cli.main import COMMANDS, _parser

    subparsers = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {c.name for c in COMMANDS}
    for name, sub in subparsers.choices.items():
        assert sub.description and len(sub.description) > 60, f"{name} has no description"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"ddpckpt {name}: {action.dest} has no help text"


def test_inspect_names_a_safetensors_file_for_what_it_is(tmp_path, capsys) -> None:
    from safetensors.torch import save_file

    path = os.fspath(tmp_path / "model.safetensors")
    save_file({"w": torch.zeros(3)}, path)
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}: a safetensors file (tensors only), not a ddpckpt checkpoint" in err
    assert "safetensors.torch.load_file" in err and "torch.save file run" not in err


def test_a_long_tensor_name_gets_a_line_of_its_own_in_a_table() -> None:
    from ddpckpt._cli._format import table

    long = "optimizer/state/" + "layer." * 20 + "weight/exp_avg"
    lines = table(("tensor", "dtype"), [(long, "float32"), ("model/w", "float16")]).splitlines()
    assert lines == [
        "tensor   dtype",
        "-------  -------",
        long,
        "         float32",
        "model/w  float16",
    ]
