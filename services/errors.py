"""Domain exceptions. Each carries an actionable message naming the offending value.

The gRPC edge (`services.rpc`) maps these classes to status codes in one place; the algorithm and the
models raise them and never import grpc.
"""


class AerieError(Exception):
    """Base class of every error aerie reports to a user."""


class InvalidRequest(AerieError, ValueError):
    """Bad request input: token ids, sampling or tree parameters, lengths (INVALID_ARGUMENT)."""


class CheckpointError(AerieError):
    """A model or draft-head checkpoint is missing, malformed or unsupported."""


class ModelUnavailable(CheckpointError):
    """A model or draft head that cannot be had: a path that does not exist, a Hugging Face Hub id
    neither in the local cache nor downloadable (offline, unknown, gated)."""


class Unreachable(AerieError):
    """A server that does not answer: connection refused, a timeout, no route (the CLI's exit code 4)."""


class IncompatibleHead(CheckpointError):
    """A draft head that does not fit the target (hidden size, vocabulary, feature taps)."""


class SequenceNotFound(AerieError, KeyError):
    """An unknown sequence id (NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "sequence not found"


class SequencePreempted(SequenceNotFound):
    """The verifier released a sequence's KV so that older sequences could grow theirs under the KV
    budget (services/engine/kv_growth.py). NOT_FOUND at the edge, as for any sequence a verifier no
    longer holds: the coordinator prefills it again from its committed tokens (nothing is lost). The
    message holds PREEMPTED, which the coordinator's fail-over metric reads as its reason."""


PREEMPTED = "was preempted on this verifier"


class DraftRowsMissing(SequenceNotFound):
    """A Draft's `first_row` lies past the rows the sequence's draft KV holds: rows its caller counts
    as taken never reached it. NOT_FOUND at the edge (the KV is not the one the caller knows); the
    message holds ROWS_MISSING, which the coordinator reads to rebuild the KV on the same drafter."""


ROWS_MISSING = "lacks rows before the call's first row"


class CapacityExceeded(AerieError):
    """Over a configured capacity: sequences, prompt length, KV slots (RESOURCE_EXHAUSTED)."""


class KVBudgetExceeded(CapacityExceeded):
    """A sequence's KV does not fit the pool's memory budget right now (RESOURCE_EXHAUSTED once
    its admission wait is over). `fits_empty`: it would fit an empty pool (worth waiting for)."""

    def __init__(self, message: str, fits_empty: bool = True) -> None:
        super().__init__(message)
        self.fits_empty = fits_empty


class GroupError(AerieError, RuntimeError):
    """A tensor-parallel group's collective failed or missed its deadline: a rank is gone or stuck
    (services/dist). The group answers UNAVAILABLE from then on."""
