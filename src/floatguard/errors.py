"""floatguard's exceptions: one family, each also the builtin it stands for.

Every exception class floatguard defines derives from :class:`FloatguardError` and
from the builtin a caller would otherwise catch (``except ValueError`` keeps working
for a :class:`SnapshotError`, ``except RuntimeError`` for a :class:`PeerFailed`), so
``except floatguard.FloatguardError`` catches whatever floatguard itself decided to
raise. Bad arguments are the builtin ``ValueError``/``TypeError`` with the fix named.

=========================  =============  ==============================================
class                      also a         raised when
=========================  =============  ==============================================
``SnapshotError``          ValueError     a snapshot file or folder cannot be used
``ForeignSnapshotError``   SnapshotError  the file named is another run's
``SnapshotFolderBusy``     SnapshotError  another live guard writes in the folder
``GuardStopped``           RuntimeError   the response policy stopped the run
``DistributedStop``        RuntimeError   a rank stops for its peers (the two below)
``PeerFailed``             .              a peer failed, exited or went silent
``GuardDesync``            .              the ranks are on different steps or settings
``ReproError``             ValueError     a repro bundle cannot be read or re-run
``NothingToEmulate``       ValueError     an emulation recipe matches no layer
``NotRegularFile``         OSError        a FIFO, device or directory where a file was
=========================  =============  ==============================================
"""

from __future__ import annotations

__all__ = ["FloatguardError"]


class FloatguardError(Exception):
    """The base of every exception floatguard defines (see the module)."""
