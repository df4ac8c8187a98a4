"""Progress bars for long saves and loads: on rank 0, on a terminal, with tqdm.

A bar appears only when ``tqdm`` is installed (``pip install 'ddpckpt[progress]'``),
standard error is a terminal, this is rank 0, ``$DDPCKPT_PROGRESS`` is not ``0``, and the
operation has already taken a second, so short saves stay silent.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any

from ddpckpt._log import current_rank


def _wanted() -> bool:
    if os.environ.get("DDPCKPT_PROGRESS", "1").lower() in ("0", "false", "no", "off"):
        return False
    return current_rank() == 0 and sys.stderr.isatty()


class Progress:
    """Counts bytes; shows a bar when :func:`_wanted` and tqdm is available."""

    def __init__(self, description: str, total: int) -> None:
        self._bar: Any = None
        if total <= 0 or not _wanted():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=total,
            desc=description,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            delay=1.0,
            leave=False,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()
