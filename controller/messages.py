"""What travels on the reconciler's queue: typed messages, not fake API events.

Informer threads put what they saw (`Watched`, `Synced`); the writes that run beside the
decision thread (a release's, a commit's) put back what they wrote (`WrittenBeside`) and that
they are done (`ReleaseDone`, `CommitDone`); a fresh read that settles a failed write comes back
as `Settled`. One queue keeps them in the order they happened,
so the decision thread applies a write's answer after every event that came before it, and a
message can never be mistaken for an object.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.objects import EventType, Kind
from process.kube import Obj


@dataclass(frozen=True)
class Watched:
    """An informer event: `obj` was added, modified or deleted."""

    kind: Kind
    type_: EventType
    obj: Obj


@dataclass(frozen=True)
class Synced:
    """The informer of `kind` has delivered its first complete list."""

    kind: Kind


@dataclass(frozen=True)
class WrittenBeside:
    """A claim as the apiserver answered a write made beside the decision thread; it goes into
    the store as an informer's copy would, if the claim is still there (`ClusterStore.
    still_stored`)."""

    claim: Obj


@dataclass(frozen=True)
class ReleaseDone:
    """The release writes of claim `claim` (its key) ended, written or not: look at it again."""

    claim: str


@dataclass(frozen=True)
class CommitDone:
    """What a placement's writes beside the decision thread left behind."""

    pod: str
    stored: tuple[Obj, ...]  # the last copy of every claim it wrote, as the apiserver answered
    ungated: Obj | None
    error: Exception | None
    allocated: bool  # every allocation was written (a failure, if any, came after)


@dataclass(frozen=True)
class Settled:
    """A fresh read of claim `claim` (its key), made to settle a write that failed and may have
    landed (`controller.settle`): the claim as read, or that it is gone, or why the read
    failed (`error`; the placement stays held and the read is tried again)."""

    claim: str
    fresh: Obj | None
    gone: bool = False
    error: str | None = None


@dataclass(frozen=True)
class LookedUp:
    """A claim a gated pod names but the store does not hold, read from the apiserver
    (`controller.lookup`): as read, None if it does not exist, or why the read failed."""

    claim: str
    found: Obj | None
    error: str | None = None


Message = Watched | Synced | WrittenBeside | ReleaseDone | CommitDone | Settled | LookedUp
