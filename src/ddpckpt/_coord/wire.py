"""What a call's store keys hold, and who writes and deletes each: the protocol's invariants.

A ddpckpt collective (:class:`~ddpckpt._coord.comm.Comm`) runs over a key-value store, one
key per message, keyed ``<namespace>/<op>/<tag>/<who>`` (``op``: the call's number on this
rank, the same on every rank because calls are matched by order). Every value starts with
one :class:`Mark` byte, so that a value can be told from the markers the heartbeat threads
write into the very key a main thread is blocked on (a store wakes a ``wait`` only when the
key it waits for is set).

Key lifecycles, per exchange ``tag`` of a call:

===================  ==============================  ========================================
key                  written by                      deleted by
===================  ==============================  ========================================
``tag/<rank>``       that rank (``DATA``), or rank   that rank once rank 0's reply came; the
                     0's heartbeat (a wake mark)     last rank to close for a rank that read
                                                     ``FAILED`` (rank 0 may still read both);
                                                     rank 0 for a key it found marked
``tag/reply``        rank 0 (``DATA`` or            the last rank to close the call (shared)
                     ``ERROR``), or a waiting rank's
                     heartbeat (``FAILED``, or
                     ``ERROR``: rank 0 is silent)
``tag/from<src>``    ``src`` (``DATA``), or a        the last rank to close (shared)
                     waiting rank's heartbeat (as
                     for ``tag/reply``)
``tag/to<rank>``     rank 0, before its reply        that rank, once read
``failed/all``       the first rank to post a        the last rank to close (shared)
                     failure (``compare_set``)
``closed/count``     every rank, once (``add`` of    the last rank to close
                     :meth:`CloseCount.add`)
``orphans/all``      ranks leaving orphan keys       the last rank to close
``left/all``         the last rank to close, when    rank 0, which waits for it
                     rank 0 waits for it
``nodes/all``        rank 0, in the first exchange   the last rank to close (shared)
a pair's addresses   each rank of a transfer pair    that rank, as it closes
===================  ==============================  ========================================

A call that ends well leaves nothing behind but each rank's heartbeat record (one per rank
for the job) and the roster of the ranks that have one (:mod:`ddpckpt._coord.liveness`). A
failed one may also leave a ``tag/to<rank>`` its receiver never read (it raised first, or
died), and ``left/all`` when rank 0 stopped waiting for the last rank before it came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final


class Mark:
    """The first byte of every value of a call's keys (compare it with ``value[:1]``).

    A rank's main thread writes only ``DATA`` and ``ERROR``. The heartbeat threads write
    the others, and ``ERROR`` for a rank they judge silent, into the keys a main thread is
    blocked on, with ``compare_set`` on an empty expected value: a mark never overwrites a
    message (one posted first wins). A message posted after a mark overwrites it: rank 0,
    which reads the parts after it woke, then finds that rank's part instead of its mark
    and counts it as posted.
    """

    DATA: Final = b"K"  # a rank's part or rank 0's reply; the data follows
    ERROR: Final = b"E"  # rank 0's reply: an error every rank raises (failures.encode_error)
    FAILED: Final = b"F"  # a waiting rank's heartbeat, in the key it waits on: a posted failure
    SILENT: Final = b"T"  # rank 0's heartbeat, in a part key: that rank timed out
    PENDING: Final = b"P"  # rank 0's heartbeat, in a part key: woken as another is silent
    POSTED: Final = b"A"  # rank 0's heartbeat, in a part key: some rank posted a failure

    WAKES: ClassVar[tuple[bytes, ...]] = (SILENT, PENDING, POSTED)  # rank 0 reads no part
    RAISES: ClassVar[tuple[bytes, ...]] = (ERROR, FAILED)  # the reader raises the error

    @classmethod
    def wakes(cls, value: bytes) -> bool:
        """Whether ``value`` is a heartbeat's wake mark, not a rank's part."""
        return value[:1] in cls.WAKES

    @classmethod
    def raises(cls, value: bytes) -> bool:
        """Whether ``value`` carries an error the reader raises."""
        return value[:1] in cls.RAISES


@dataclass(frozen=True)
class CloseCount:
    """The value of a call's ``closed/count`` key, read back from each rank's one ``add``.

    Three counts share one integer so that a single atomic ``add`` both counts this rank
    out of the call and tells it what every rank before it did: ``left`` (ranks that
    closed) in the low 32 bits, ``orphaned`` (of those, ranks that left keys rank 0 may
    still read) from bit 32, and ``waiting`` (rank 0 waits for the last rank to leave) at
    bit 62. Neither count can carry into the next field: a job has fewer than 2**30 ranks.
    """

    left: int
    orphaned: int
    waiting: bool

    ORPHANED: ClassVar[int] = 1 << 32
    WAITING: ClassVar[int] = 1 << 62

    @classmethod
    def add(cls, orphans: bool, waits: bool) -> int:
        """What one rank adds as it closes: itself, whether it leaves orphans, whether it is
        rank 0 and waits for the others to leave."""
        return 1 + (cls.ORPHANED if orphans else 0) + (cls.WAITING if waits else 0)

    @classmethod
    def of(cls, count: int) -> CloseCount:
        """The counts in the key's value ``count``."""
        return cls(
            left=count % cls.ORPHANED,
            orphaned=(count % cls.WAITING) // cls.ORPHANED,
            waiting=count >= cls.WAITING,
        )
