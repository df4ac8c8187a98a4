"""A run directory: the Checkpointer, save and retention policies, the directory layout and its lock."""
