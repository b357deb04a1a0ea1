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


class IncompatibleHead(CheckpointError):
    """A draft head that does not fit the target (hidden size, vocabulary, feature taps)."""


class SequenceNotFound(AerieError, KeyError):
    """An unknown sequence id (NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "sequence not found"


class CapacityExceeded(AerieError):
    """Over a configured capacity: sequences, prompt length, KV slots (RESOURCE_EXHAUSTED)."""


class GroupError(AerieError, RuntimeError):
    """A tensor-parallel group's collective failed or missed its deadline: a rank is gone or stuck
    (services/dist). The group answers UNAVAILABLE from then on."""
