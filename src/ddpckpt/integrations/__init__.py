"""ddpckpt where the training loop is a framework's: one module per framework, each behind
an extra of its name.

* :mod:`ddpckpt.integrations.lightning` (``pip install 'ddpckpt[lightning]'``): a
  Lightning ``CheckpointIO`` writing ddpckpt checkpoints, and a callback that makes a
  mid-epoch resume exact (the train loader's position, every rank's random streams).
* :mod:`ddpckpt.integrations.accelerate` (``pip install 'ddpckpt[accelerate]'``): an
  ``Accelerator``'s whole state (prepared models, optimizers, schedulers, GradScaler,
  the prepared DataLoaders' positions) saved and loaded with ddpckpt.
* :mod:`ddpckpt.integrations.transformers` (``pip install 'ddpckpt[transformers]'``): a
  ``Trainer`` whose checkpoints are ddpckpt checkpoints and whose
  ``resume_from_checkpoint`` is exact, and the export of a ``from_pretrained`` directory.

Each reports every committed checkpoint (:mod:`ddpckpt.events`) to what the framework
already logs to. Importing a module whose framework is not installed raises an
``ImportError`` naming the extra to install.
"""
