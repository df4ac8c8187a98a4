"""``ddpckpt check-resume``: prove that a user's own training script resumes exactly.

* :mod:`.record`: inside the training processes, the library records digests of the whole
  training state at every step, only while the checker's environment variable is set.
* :mod:`.runner`: runs the script uninterrupted, then kills one rank at a step, restarts it.
* :mod:`.compare`: finds the first step and component where the two runs split, and why.
* :mod:`.report`: the terminal summary, ``report.json`` and ``resume-check.png``.
"""

from __future__ import annotations
