"""Typed errors of fdeplb and the one table mapping them to HTTP status codes and CLI exit codes.

Every input check raises one of these (never a bare ``assert``). The API turns ``err.http_status`` into the
response code and the CLI exits with ``err.exit_code``; both come from :data:`ERROR_TABLE`.
"""

from __future__ import annotations


class FdeplbError(Exception):
    """Base class of every error fdeplb raises on purpose."""

    code = "internal"


# ---- bad input (4xx / exit 2): nothing was changed ----------------------------------------------------------------
class InputError(FdeplbError, ValueError):
    """Input that fdeplb refuses: wrong shape or dtype, NaN, negative load, bad topology, bad JSON."""

    code = "bad_input"


class LoadFileError(InputError):
    """An expert-load dump that cannot be read; the message names the file and the problem."""

    code = "bad_load_file"


class PlacementFileError(InputError):
    """A placement file that cannot be read or does not match the topology."""

    code = "bad_placement_file"


class TopologyError(InputError):
    """Topology that cannot hold a placement (e.g. num_replicas not a multiple of num_gpus)."""

    code = "bad_topology"


class RedundancyError(TopologyError):
    """Fail closed: some logical expert would have no replica on a live EP rank (every replica sat on excluded
    ranks and the live ranks hold no redundant replica to give up). ``orphans`` lists the uncovered experts as
    ``(layer, log_id)`` pairs, in order; nothing is placed or committed."""

    code = "redundancy_insufficient"

    def __init__(self, message: str, orphans: "list[tuple[int, int]] | None" = None) -> None:
        super().__init__(message)
        self.orphans = list(orphans or [])


class ReplayError(InputError):
    """A recording (exported audit) that does not replay: an illegal or out-of-order transition, a version gap, a
    fence going backwards, a guard that did not hold, a broken audit chain, or a plan that does not reproduce. The
    message names the first bad line and why. Its own row: exit 1 (a verdict), not 2 (a usage error)."""

    code = "replay_mismatch"


class PayloadTooLargeError(InputError):
    """A request body over the API's size limit (read no further than the limit)."""

    code = "payload_too_large"


class NotFoundError(FdeplbError):
    """A record, plan, rank or route that does not exist."""

    code = "not_found"


class AuthError(FdeplbError):
    """Missing or wrong API credentials (compared in constant time; never logged). Nothing was changed."""

    code = "unauthorized"


# ---- state machine refusals (409 / exit 3): nothing was changed ---------------------------------------------------
class StateError(FdeplbError):
    """A transition that was refused; Redis and the audit stream are unchanged."""

    code = "state_conflict"


class IllegalTransitionError(StateError):
    """The trigger is not legal from the record's current state (per the machine's table)."""

    code = "illegal_transition"


class StaleStateError(StateError):
    """The record changed since it was read (another writer won the race): expected state/version did not match."""

    code = "stale_state"


class ContentionError(StaleStateError):
    """An optimistic store transaction gave up (:data:`fdeplb.store.txn.TXN_ATTEMPTS` attempts): another writer
    changed a key it WATCHed before each attempt could commit. Nothing was written; the caller may try again."""

    code = "contention"


class GenerationError(StaleStateError):
    """A cluster transition decided under an older membership generation than the stored one (a rank joined,
    left or was suspected meanwhile): refused by the commit script, nothing written. The caller reads again."""

    code = "stale_generation"


class FenceError(StateError):
    """The caller's fencing token is not the current lease holder's: a deposed coordinator may not commit."""

    code = "fenced"


class GuardError(StateError):
    """A guard that spans records refused the transition (e.g. not every rank is LOADED for this plan)."""

    code = "guard_refused"


# ---- weights (500 / exit 4) ---------------------------------------------------------------------------------------
class WeightError(FdeplbError):
    """Base class of failures while reading, staging or swapping expert weights."""

    code = "weight_error"


class CheckpointError(WeightError):
    """A checkpoint file, index or tensor is missing or malformed; the message names tensor and file."""

    code = "checkpoint_error"


class StagingBudgetError(WeightError):
    """Staging the plan's experts would exceed the configured memory budget (checked before reading anything)."""

    code = "staging_budget"


class VerificationError(WeightError):
    """A swapped slot does not match its logical expert's checkpoint tensors (checksum mismatch)."""

    code = "verification_failed"


class PeerTransferError(WeightError):
    """A peer rank did not deliver an expert from its live slot: it refused (another live placement, an expert it
    does not hold), died, ran past its deadline, failed authentication or sent a truncated frame or wrong bytes.
    Staging reads that expert from the checkpoint instead (:mod:`fdeplb.weights.peer_staging`)."""

    code = "peer_transfer"


class PeerAuthError(PeerTransferError):
    """The handshake with a peer's address failed (:func:`fdeplb.weights.peer.peer_authkey`): the two ends do not
    hold the same key (their ``FDEPLB_PEER_SECRET`` or cluster id differ), or what listens there is not an fdeplb
    peer; the handshake cannot tell which (:func:`fdeplb.weights.peer.handshake_failure` says what it shows). A
    configuration error, not a transient one: the rank agent raises one alarm for it
    (:mod:`fdeplb.orchestration.peer_agent`)."""


class DependencyError(FdeplbError):
    """An optional dependency (an extra) is not installed; the message names the extra."""

    code = "missing_dependency"


class RedisUnavailableError(FdeplbError):
    """Redis did not answer at the given URL (connection refused, unknown host, timeout, authentication)."""

    code = "redis_unavailable"


class CorruptRecordError(FdeplbError):
    """A value read from Redis that fdeplb did not write that way (unparsable field, wrong shape, unknown state).

    The message names the key and the field; nothing was changed. ``key`` is the Redis key of the value (None when
    the raiser did not say), so a reader that goes on past one bad value (``fdeplb status``, the metrics) can name
    it."""

    code = "corrupt_record"

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class StoreError(FdeplbError):
    """Redis answered with an error fdeplb did not expect (e.g. WRONGTYPE on a key another program wrote)."""

    code = "store_error"


class DeadlineError(FdeplbError):
    """A wait ran past its deadline."""

    code = "deadline"


#: error class -> (HTTP status, CLI exit code). Lookup walks the MRO, so subclasses inherit their parent's row.
ERROR_TABLE: dict[type[FdeplbError], tuple[int, int]] = {
    ReplayError: (422, 1),
    InputError: (400, 2),
    PayloadTooLargeError: (413, 2),
    AuthError: (401, 2),
    NotFoundError: (404, 2),
    StateError: (409, 3),
    WeightError: (500, 4),
    DependencyError: (500, 5),
    DeadlineError: (504, 6),
    RedisUnavailableError: (503, 7),
    CorruptRecordError: (500, 8),
    StoreError: (500, 8),
    FdeplbError: (500, 1),
}


def _row(err: BaseException) -> tuple[int, int]:
    for cls in type(err).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]  # type: ignore[index]
    return (500, 1)


def http_status(err: BaseException) -> int:
    """HTTP status for ``err`` (500 for anything that is not an :class:`FdeplbError`)."""
    return _row(err)[0]


def exit_code(err: BaseException) -> int:
    """CLI exit code for ``err`` (1 for anything that is not an :class:`FdeplbError`)."""
    return _row(err)[1]
