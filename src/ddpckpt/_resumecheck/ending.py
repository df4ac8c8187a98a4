"""How a check run's launch ended: a failure, or a death in the interpreter's teardown after
every rank's script had run to its end.

torch 2.13's gloo threads abort processes whose script has ended, in the interpreter's
teardown, at random (pytorch/pytorch#190489): the process is killed by SIGABRT although
its records are complete. Only that is tolerated, so the evidence is how each process
ended, not which exit function the script called (``raise SystemExit(3)``, the builtin
``exit(3)``, a ``sys.exit`` bound before ddpckpt was imported and ``os._exit(3)`` all end
the process with an exit code, and none of them is a teardown death):

* every rank's last process recorded that its script's code ended without a failure it
  could see (the ``exit`` event, written from atexit before the teardown; an unhandled
  exception, or ``sys.exit`` called with an error, is recorded as failed, ``os._exit`` writes
  none); and
* every one of those processes that failed ended by a signal: the launcher's own status
  when it is the process (``python train.py``: a negative return code), or the worker's
  status its launcher reports (torchrun's ``exitcode: -6 (pid: 1234)``,
  ``torch.multiprocessing.spawn``'s ``process 1 terminated with signal SIGABRT``). A
  launcher whose report names no such process proves nothing: the run counts as failed.

The checker calls :func:`judge` once per launch that exited non-zero.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field

from ddpckpt._resumecheck.records import Events

# torchrun: its error line and its ChildFailedError report, for each failed worker
_TORCHRUN = re.compile(
    r"exitcode\s*:\s*(-?\d{1,4})\)?(?:\s+local_rank:\s*\d+)?\s*\(pid:\s*(\d{1,10})\)"
)
# torch.multiprocessing.spawn's ProcessExitedException (the index is the process's rank)
_SPAWN = re.compile(
    r"process (\d{1,7}) terminated with (?:signal (SIG[A-Z0-9]+)|exit code (\d{1,4}))"
)


@dataclass(frozen=True)
class WorkerEnd:
    """How one process ended, as its launcher saw it: ``status`` is its exit code, or
    minus the signal that killed it; ``pid`` or ``index`` (a spawn's rank) names it."""

    status: int
    pid: int | None = None
    index: int | None = None

    @property
    def signal_name(self) -> str:
        try:
            return signal.Signals(-self.status).name
        except ValueError:
            return f"signal {-self.status}"


def reported_ends(output: str) -> list[WorkerEnd]:
    """The failed workers a launcher's output reports (torchrun, torch.multiprocessing.spawn);
    each process once, in the order first reported."""
    found: dict[tuple[str, int], WorkerEnd] = {}
    for match in _TORCHRUN.finditer(output):
        pid = int(match.group(2))
        found.setdefault(("pid", pid), WorkerEnd(int(match.group(1)), pid=pid))
    for match in _SPAWN.finditer(output):
        index, name, code = int(match.group(1)), match.group(2), match.group(3)
        if name is not None:
            number = signal.Signals.__members__.get(name)
            if number is None:
                continue  # a signal this platform does not know: proves nothing
            status = -int(number)
        else:
            status = int(code)
        found.setdefault(("index", index), WorkerEnd(status, index=index))
    return list(found.values())


@dataclass(frozen=True)
class Ending:
    """A launch that exited non-zero, judged: ``failed`` with ``why``, or a teardown death
    of ``teardown`` (rank -> the signal's name) after every rank's script ended."""

    failed: bool
    why: str = ""
    teardown: dict[int, str] = field(default_factory=dict)


def ended_cleanly(events: Events) -> bool:
    """Whether a process recorded that its script's code ended without a failure it saw."""
    return bool(events) and events[-1]["event"] == "exit" and not events[-1]["failed"]


def reached_end_everywhere(last: Mapping[int, Events]) -> bool:
    """Whether every rank of the world, in its last process, recorded a clean end (so a
    launcher that exited non-zero needs no restart: nothing is left to run)."""
    world = max((e["world"] for events in last.values() for e in events[:1]), default=0)
    return (
        bool(last)
        and set(last) == set(range(world))
        and all(ended_cleanly(events) for events in last.values())
    )


def _pid(events: Events) -> int:
    return events[0]["pid"]


def judge(last: Mapping[int, Events], launcher_pid: int, status: int, output: str) -> Ending:
    """Judge a launch that exited with ``status`` (non-zero; negative: killed by that
    signal), ``last`` each rank's last process's events, ``output`` the launcher's output
    (its end suffices)."""
    if not reached_end_everywhere(last):
        return Ending(True)  # a process failed, was killed, or never ran to its end
    by_pid = {_pid(events): rank for rank, events in last.items()}
    ends: dict[int, WorkerEnd] = {}
    if launcher_pid in by_pid:  # `python train.py`: the launcher is the process
        ends[by_pid[launcher_pid]] = WorkerEnd(status, pid=launcher_pid)
    else:
        for end in reported_ends(output):
            rank = by_pid.get(end.pid) if end.pid is not None else end.index
            if rank is not None and rank in last and rank not in ends:
                ends[rank] = end
    if not ends:
        return Ending(
            True,
            f"every rank's script ran to its end, but the launcher exited with {status} and "
            "its output names no process of this run that ended by a signal, so check-resume "
            "cannot tell an exit with an error code (sys.exit, SystemExit, exit(), os._exit) "
            "from a death in the interpreter's teardown",
        )
    exits = {rank: end.status for rank, end in ends.items() if end.status > 0}
    if exits:
        said = ", ".join(
            f"rank {rank} exited with code {code}" for rank, code in sorted(exits.items())
        )
        return Ending(
            True,
            f"every rank's script ran to its end, but then {said}: an exit with an error "
            "code (sys.exit, SystemExit, exit(), os._exit) is a failure, not a death in the "
            "interpreter's teardown",
        )
    killed = {rank: end.signal_name for rank, end in sorted(ends.items()) if end.status < 0}
    if not killed:
        return Ending(
            True, f"the launcher exited with {status}, although its processes did not fail"
        )
    return Ending(False, teardown=killed)
