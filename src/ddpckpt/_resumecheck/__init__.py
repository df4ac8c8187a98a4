"""``ddpckpt check-resume``: prove that a user's own training script resumes exactly.

* :mod:`.record`: inside the training processes, the library records digests of the whole
  training state at every step (:mod:`.digests`), the seeding calls and ddpckpt's warnings,
  only while the checker's environment variable is set;
* :mod:`.isolate`: meanwhile, every path the script's ddpckpt calls use is mapped into the
  check's own directory, so the user's checkpoints are never read for resuming nor written;
* :mod:`.runner`: runs the script uninterrupted, then kills one rank at a step, restarts it;
* :mod:`.check`: the whole check, from the reference run to the verdict;
* :mod:`.compare` (one rank: :mod:`.compare_rank`): finds the first step and component where
  the runs split; :mod:`.explain` (:mod:`.explain_state`, :mod:`.situation`,
  :mod:`.evidence`) says why;
* :mod:`.report`: the terminal summary, ``report.json`` and ``resume-check.png``.
"""

from __future__ import annotations
