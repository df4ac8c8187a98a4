"""The one check every integration module makes on import: its framework is installed."""

from __future__ import annotations

import importlib.util


def require(module: str, framework: str, extra: str) -> None:
    """Raise a one-line ``ImportError`` naming ``extra`` if ``module`` is not installed.

    Only a missing package is reported this way: a framework that is installed but fails
    to import raises its own error when the integration imports it.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken __spec__
        found = False
    if not found:
        raise ImportError(
            f"ddpckpt.integrations.{extra} needs {framework}, which is not installed: "
            f"pip install 'ddpckpt[{extra}]'"
        ) from None
