"""The ddpckpt command line and its local tools."""
