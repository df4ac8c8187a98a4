"""Saving and loading a checkpoint: the collective save/load, the write path, async saves and staging."""
