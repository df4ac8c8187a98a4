"""Names kept for a while after they moved or were replaced: each use warns once per name.

A :class:`DeprecationWarning` names the new spelling and the date after which the old one
may be removed; Python shows it for code run as a script (``__main__``) and under pytest.
"""

from __future__ import annotations

import warnings
from typing import TypeVar

T = TypeVar("T")

REMOVAL = "2027-06-01"  # old spellings may go in the first release after this date


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``."""
    warnings.warn(
        f"{old} is deprecated: use {new} (the old name may be removed after {REMOVAL})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_argument(
    call: str, old: str, old_value: T | None, new: str, new_value: T | None
) -> T | None:
    """The value of argument ``new`` of ``call``, taking a deprecated ``old`` spelling
    (with a warning); both given is a ``TypeError``."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{call}: pass {new}= only ({old}= is its deprecated spelling)")
    warn_renamed(f"{call}({old}=...)", f"{call}({new}=...)", stacklevel=4)
    return old_value
