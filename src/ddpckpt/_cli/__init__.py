"""The ddpckpt command line and its local tools."""

from ddpckpt._cli.main import main as main
