"""``python run_script.py SCRIPT [ARGS...]``: run SCRIPT as ``__main__``, as ``python SCRIPT``
would, and end through :func:`exiting.exit_now` (see there why). Documentation snippets run
this way, so a snippet is run exactly as written without torch's teardown abort."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from typing import NoReturn

from exiting import exit_now


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)
    run_as_main(script)


def run_as_main(script: str) -> NoReturn:
    """Run ``script`` as ``__main__`` (``sys.argv`` and ``sys.path`` already set) and end as
    its exit says: its ``SystemExit`` code, 1 for an exception (its traceback printed)."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            exit_now(exc.code or 0)
        print(exc.code, file=sys.stderr)
        exit_now(1)
    except BaseException:
        traceback.print_exc()
        exit_now(1)
    exit_now(0)


if __name__ == "__main__":
    main()
