"""Converting checkpoints of other formats into ddpckpt checkpoints (``ddpckpt import``).

``torchfile.py`` reads a ``torch.save`` file without running it and within limits;
``legacy.py`` recognises the usual layouts in what it holds and writes a checkpoint through
:mod:`ddpckpt._io.writing`.
"""
