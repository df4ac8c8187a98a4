"""``python fast_guide.py OUT SCRIPT``: the fast-tier guide's script (SCRIPT) run as written,
as run_script.py runs it, with what each rank resumed from recorded
(OUT/resumed-rank<r>.jsonl: path, step and fast-tier directory, one line per launch).

With ``FAST_GUIDE_STOP_AT=S`` the ranks stop after ``save(S)``, once the fast tier holds
step S on every rank: each writes its pid to OUT/stopped-rank<r> and sleeps, for the test
to kill the whole job (torchrun and workers) as a crash torchrun does not restart.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

import ddpckpt
import run_script


def main() -> None:
    out = Path(sys.argv.pop(1))
    stop, rank = int(os.environ.get("FAST_GUIDE_STOP_AT", "-1")), os.environ["RANK"]
    resume, save = ddpckpt.Checkpointer.resume, ddpckpt.Checkpointer.save

    def resumed(self: ddpckpt.Checkpointer, *args: Any, **kwargs: Any) -> Any:
        info = resume(self, *args, **kwargs)
        seen = {"path": info and info.path, "step": info and info.step}
        with open(out / f"resumed-rank{rank}.jsonl", "a") as every:
            every.write(json.dumps({**seen, "fast": self.fast_tier_directory}) + "\n")
        return info

    def saved(self: ddpckpt.Checkpointer, step: int, *args: Any, **kwargs: Any) -> Any:
        path = save(self, step, *args, **kwargs)
        if step == stop:
            self.wait()  # the fast tier holds step S on this rank
            dist.barrier()
            written = out / f".stopped-rank{rank}"
            written.write_text(str(os.getpid()))
            os.replace(written, out / f"stopped-rank{rank}")  # the test reads a whole pid
            time.sleep(600)
        return path

    ddpckpt.Checkpointer.resume = resumed  # type: ignore[method-assign]
    ddpckpt.Checkpointer.save = saved  # type: ignore[method-assign]
    run_script.main()


if __name__ == "__main__":
    main()
