"""The ddpckpt command line and its local tools."""

from ddpckpt.cli.main import main

__all__ = ["main"]
