"""Capturing and restoring training state: models, optimizers, plain objects, RNG streams."""
