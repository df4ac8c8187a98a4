"""killed_run.py's three phases around a plain gloo job (the harness's own test): four steps
of one all-reduce each, the step reached kept in a file, rank 1 killed after step 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from killed_run import kill_if_due, main


def fit(mode: str, directory: Path, kill_at: int | None, resume: bool) -> dict[str, Any]:
    dist.init_process_group("gloo")  # env://: MASTER_PORT is the phase's own port
    try:
        reached = directory / "reached"
        start = int(reached.read_text()) if resume else 0
        losses = {}
        for step in range(start + 1, 5):
            total = torch.tensor([float(step)])
            dist.all_reduce(total)
            losses[str(step)] = total.item()
            if dist.get_rank() == 0:
                directory.mkdir(parents=True, exist_ok=True)
                reached.write_text(str(step))
            dist.barrier()
            kill_if_due(step, kill_at)
        return {"losses": losses, "batches": {}, "weights": mode}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(fit, ["plain"], kill_at=2)
