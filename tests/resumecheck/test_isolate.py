"""Under ``ddpckpt check-resume`` the script's ddpckpt calls never read the user's run for
resuming nor write anything of the user's (ddpckpt._resumecheck.isolate); single process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grimp
import pytest
import torch
from torch import nn

import ddpckpt
from ddpckpt import _observe
from ddpckpt._resumecheck import record
from ddpckpt._resumecheck.leftovers import remove_created
from ddpckpt.storage import storage_for


def _files(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def user_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's directory, where an earlier run of the script left ckpt/step-4."""
    monkeypatch.chdir(tmp_path)
    model = nn.Linear(2, 2)
    ddpckpt.save("ckpt/step-4", model=model, step=4)
    return tmp_path


def test_a_plain_loop_saves_looks_up_and_loads_only_its_own_copy(user_run, under_check) -> None:
    before = _files(user_run)
    run = user_run / "check" / "runs" / "reference"
    under_check(run)
    model = nn.Linear(2, 2)
    assert ddpckpt.latest("ckpt") is None  # the user's step-4 is not the check's to resume
    saved = ddpckpt.save("ckpt/step-7", model=model, step=7)
    mirror = run / "checkpoints" / str(user_run / "ckpt").lstrip(os.sep)
    assert saved == str(mirror / "step-7")
    assert ddpckpt.latest("ckpt") == saved
    assert ddpckpt.load("ckpt/step-7", model=nn.Linear(2, 2)).step == 7  # the check's copy
    ddpckpt.save_dict("ckpt/extra", {"w": torch.ones(2)})
    assert torch.equal(ddpckpt.load_dict("ckpt/extra")["w"], torch.ones(2))
    ddpckpt.remove_checkpoint("ckpt/extra")
    assert sorted(p.name for p in mirror.iterdir()) == ["step-7"]
    assert {k: v for k, v in _files(user_run).items() if not k.startswith("check")} == before


def test_a_checkpointer_directory_is_mapped_and_made_empty_until_the_check_ends(
    user_run, under_check
) -> None:
    """The script may write its own files next to its checkpoints, as without a check: the
    directory exists (empty) while the runs go on; the check removes it at its end."""
    run = user_run / "check" / "runs" / "reference"
    under_check(run)
    ckpt = ddpckpt.Checkpointer("runs/exp", model=nn.Linear(2, 2))
    assert ckpt.resume() is None
    ckpt.save(1)
    ckpt.close()
    assert Path(ckpt.directory).is_relative_to(run / "checkpoints")
    assert list((user_run / "runs" / "exp").iterdir()) == []
    (user_run / "runs" / "notes.txt").write_text("the script's own file")
    left = remove_created(str(user_run / "check"))
    assert sorted(p.name for p in (user_run / "runs").iterdir()) == ["notes.txt"]
    assert left == {str(user_run / "runs"): ["notes.txt"]}  # said in the report, not silent


def test_the_users_checkpoint_loaded_by_its_path_is_refused_before_a_save_next_to_it(
    user_run, under_check
) -> None:
    """A script that finds its checkpoint itself (glob, os.path.exists) reads the user's run:
    the check cannot start from scratch, so it refuses at the save, which writes nothing."""
    before = _files(user_run)
    under_check(user_run / "check" / "runs" / "reference")
    model = nn.Linear(2, 2)
    assert ddpckpt.load("ckpt/step-4", model=model).step == 4  # an input, as far as is known
    with pytest.raises(ddpckpt.errors.ResumeCheckRefusedError) as refused:
        ddpckpt.save("ckpt/step-8", model=model, step=8)
    message = str(refused.value)
    assert "save('ckpt/step-8')" in message and "step-4 (load)" in message
    assert "ddpckpt.latest(" in message
    assert {k: v for k, v in _files(user_run).items() if not k.startswith("check")} == before


def test_a_load_from_the_directory_the_run_writes_to_that_it_did_not_write_is_refused(
    user_run, under_check
) -> None:
    under_check(user_run / "check" / "runs" / "reference")
    model = nn.Linear(2, 2)
    ddpckpt.save("ckpt/step-1", model=model, step=1)
    with pytest.raises(ddpckpt.errors.ResumeCheckRefusedError, match=r"load\('ckpt/step-4'\)"):
        ddpckpt.load("ckpt/step-4", model=model)


def test_a_reader_of_the_run_being_trained_reads_the_checks_copy(user_run, under_check) -> None:
    """An evaluator opened on the directory the script trains into, before its first save:
    the check's copy (the user's ckpt/ exists, but is not the run being checked)."""
    under_check(user_run / "check" / "runs" / "reference")
    writer = ddpckpt.Checkpointer("ckpt", model=nn.Linear(2, 2))
    reader = ddpckpt.Checkpointer("ckpt", model=nn.Linear(2, 2), read_only=True)
    assert reader.directory == writer.directory and reader.resume() is None
    writer.close()


def test_pretrained_weights_elsewhere_are_read_as_they_are(user_run, under_check) -> None:
    under_check(user_run / "check" / "runs" / "reference")
    weights = ddpckpt.load_state_dict("ckpt/step-4")  # nothing written there: an input
    assert set(weights) == {"weight", "bias"}
    ddpckpt.save("finetune/step-1", model=nn.Linear(2, 2), step=1)  # elsewhere: fine


def test_a_write_that_escaped_the_mapping_is_refused_by_the_storage(user_run, under_check) -> None:
    """Fail closed: a location no ddpckpt call mapped cannot be written during a check."""
    under_check(user_run / "check" / "runs" / "reference")
    store = storage_for(str(user_run / "ckpt" / "stray"))
    with pytest.raises(
        ddpckpt.errors.ResumeCheckRefusedError, match="outside the check's directory"
    ):
        store.write_new(str(user_run / "ckpt" / "stray"), b"x")
    assert not (user_run / "ckpt" / "stray").exists()
    assert store.exists(str(user_run / "ckpt" / "step-4"))  # reads pass
    ddpckpt.save("memory://scratch/step-1", model=nn.Linear(2, 2))  # process-local: as is
    assert ddpckpt.latest("memory://scratch") == "memory://scratch/step-1"


@pytest.mark.processes
def test_the_check_stops_at_a_refused_call_and_says_which_and_why(user_run, capsys) -> None:
    """The whole command on a script that finds its checkpoint by listing the directory:
    exit 2 with the refusal, the user's files untouched."""
    from ddpckpt._cli.main import main

    (user_run / "train.py").write_text(
        "import glob, torch, ddpckpt\n"
        "model = torch.nn.Linear(2, 2)\n"
        "found = sorted(glob.glob('ckpt/step-*'))\n"
        "if found:\n"
        "    ddpckpt.load(found[-1], model=model)\n"
        "model(torch.randn(1, 2)).sum().backward()\n"
        "ddpckpt.save('ckpt/step-5', model=model, step=5)\n"
    )
    before = _files(user_run)
    code = main(["check-resume", "--out", "check", "--", sys.executable, "train.py"])
    assert code == 2
    error = capsys.readouterr().err
    assert "refused save('ckpt/step-5')" in error and "step-4 (load)" in error
    assert {k: v for k, v in _files(user_run).items() if not k.startswith("check")} == before


def test_no_module_outside_check_resume_and_the_cli_imports_it() -> None:
    """The core reaches check-resume only through its seam (ddpckpt._observe), which imports
    the recorder by name when the check's variable is set (the package's own __init__
    included, which import-linter's contract does not cover)."""
    graph = grimp.build_graph("ddpckpt")
    tools = ("ddpckpt._resumecheck", "ddpckpt._cli")
    importers = {
        module
        for module in graph.modules
        if not module.startswith(tools)
        and any(m.startswith(tools[0]) for m in graph.find_modules_directly_imported_by(module))
    }
    assert importers == set()
    assert {record.ENV: record.__name__} == _observe.TOOLS
