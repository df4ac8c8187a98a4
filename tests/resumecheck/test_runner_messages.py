"""What a failed launch's message shows of its log (ddpckpt._resumecheck.runner); single
process, on logs as torchrun writes them."""

from __future__ import annotations

from pathlib import Path

from ddpckpt._resumecheck.runner import _failure

ELASTIC = "W1129 20:35:45.410000 16977 torch/distributed/run.py:874] *****\n"
SUMMARY = "".join(
    f"{line}\n"
    for line in [
        "E1129 20:35:45.613000 16977 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: 2) local_rank: 0 (pid: 16990) of binary: /venv/bin/python",
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", '
        "line 383, in launch_agent",
        "    raise ChildFailedError(",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 60,
        "train.py FAILED",
        "  exitcode  : 2 (pid: 18292) ",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    ]
    * 3
)


def test_a_mistyped_script_shows_pythons_own_words_before_torchruns_summary(
    tmp_path: Path,
) -> None:
    """The message showed the log's last 25 lines: torchrun's traceback of ChildFailedError
    and its summary; "can't open file" was on line 5 of 45."""
    log = tmp_path / "launch-1.log"
    said = (
        "/venv/bin/python: can't open file '/home/me/trian.py': [Errno 2] No such file or directory"
    )
    log.write_text(ELASTIC + f"{said}\n{said}\n" + SUMMARY)
    shown = _failure(str(log))
    assert shown.startswith(f"the script's first errors in the log:\n  {said}\nthe log's end:\n")
    assert shown.count("can't open file") == 1


def test_a_ranks_exception_is_shown_not_the_line_that_raised_it(tmp_path: Path) -> None:
    log = tmp_path / "launch-1.log"
    ranks = "".join(
        f"[rank{r}]: Traceback (most recent call last):\n"
        f'[rank{r}]:   File "/home/me/train.py", line 3, in <module>\n'
        f'[rank{r}]:     raise ValueError("boom")\n'
        f"[rank{r}]: ValueError: boom\n"
        for r in (0, 1)
    )
    log.write_text(ELASTIC + ranks + SUMMARY)
    shown = _failure(str(log))
    assert shown.split("the log's end:\n")[0] == (
        "the script's first errors in the log:\n  [rank0]: ValueError: boom\n"
        "  [rank1]: ValueError: boom\n"
    )


def test_a_log_without_the_scripts_errors_shows_its_end_only(tmp_path: Path) -> None:
    log = tmp_path / "launch-1.log"
    log.write_text(ELASTIC + SUMMARY)
    assert _failure(str(log)) == "".join(log.read_text().splitlines(keepends=True)[-25:])
