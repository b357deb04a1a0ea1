from aerie.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierPrefillRequest(_message.Message):
    __slots__ = ("sequence_id", "prompt_ids", "sampling", "capacity", "feature_kind", "rebuild", "offset", "more", "prompt_tokens", "next_draft")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FEATURE_KIND_FIELD_NUMBER: _ClassVar[int]
    REBUILD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    capacity: int
    feature_kind: _common_pb2.FeatureKind
    rebuild: bool
    offset: int
    more: bool
    prompt_tokens: int
    next_draft: NextDraft
    def __init__(self, sequence_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., capacity: _Optional[int] = ..., feature_kind: _Optional[_Union[_common_pb2.FeatureKind, str]] = ..., rebuild: _Optional[bool] = ..., offset: _Optional[int] = ..., more: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., next_draft: _Optional[_Union[NextDraft, _Mapping]] = ...) -> None: ...

class VerifierPrefillResponse(_message.Message):
    __slots__ = ("first_token", "features", "logprobs", "prompt_logprobs", "next_tree", "next_draft_seconds", "drafter_busy")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TREE_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_BUSY_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    features: _common_pb2.Tensor
    logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _common_pb2.TokenLogprobs
    next_tree: _common_pb2.DraftTree
    next_draft_seconds: float
    drafter_busy: float
    def __init__(self, first_token: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., next_tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., next_draft_seconds: _Optional[float] = ..., drafter_busy: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("sequence_id", "round_index", "tree", "next_draft")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    round_index: int
    tree: _common_pb2.DraftTree
    next_draft: NextDraft
    def __init__(self, sequence_id: _Optional[str] = ..., round_index: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., next_draft: _Optional[_Union[NextDraft, _Mapping]] = ...) -> None: ...

class NextDraft(_message.Message):
    __slots__ = ("round_index", "tree", "drafter")
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    round_index: int
    tree: _common_pb2.TreeParams
    drafter: str
    def __init__(self, round_index: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., drafter: _Optional[str] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("path", "accept_length", "accepted", "nodes", "tokens", "bonus", "features", "logprobs", "next_tree", "next_draft_seconds", "drafter_busy", "round_index", "ahead_seconds", "ahead_wait_seconds", "next_tree_ahead", "pending_rows", "draft_index", "ahead_failed", "verify_seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TREE_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_BUSY_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TREE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    PENDING_ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_INDEX_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FAILED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: int
    accept_length: int
    accepted: int
    nodes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    bonus: int
    features: _common_pb2.Tensor
    logprobs: _common_pb2.TokenLogprobs
    next_tree: _common_pb2.DraftTree
    next_draft_seconds: float
    drafter_busy: float
    round_index: int
    ahead_seconds: float
    ahead_wait_seconds: float
    next_tree_ahead: bool
    pending_rows: bool
    draft_index: int
    ahead_failed: bool
    verify_seconds: float
    def __init__(self, path: _Optional[int] = ..., accept_length: _Optional[int] = ..., accepted: _Optional[int] = ..., nodes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., bonus: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., next_tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., next_draft_seconds: _Optional[float] = ..., drafter_busy: _Optional[float] = ..., round_index: _Optional[int] = ..., ahead_seconds: _Optional[float] = ..., ahead_wait_seconds: _Optional[float] = ..., next_tree_ahead: _Optional[bool] = ..., pending_rows: _Optional[bool] = ..., draft_index: _Optional[int] = ..., ahead_failed: _Optional[bool] = ..., verify_seconds: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("sequence_id", "round_index", "token", "keep_features")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    KEEP_FEATURES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    round_index: int
    token: int
    keep_features: bool
    def __init__(self, sequence_id: _Optional[str] = ..., round_index: _Optional[int] = ..., token: _Optional[int] = ..., keep_features: _Optional[bool] = ...) -> None: ...

class VerifyRunRequest(_message.Message):
    __slots__ = ("sequence_id", "round_index", "tree", "next_draft", "rounds", "max_tokens", "stop_ids", "ahead")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    round_index: int
    tree: _common_pb2.DraftTree
    next_draft: NextDraft
    rounds: int
    max_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    ahead: RunAhead
    def __init__(self, sequence_id: _Optional[str] = ..., round_index: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., next_draft: _Optional[_Union[NextDraft, _Mapping]] = ..., rounds: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., ahead: _Optional[_Union[RunAhead, _Mapping]] = ...) -> None: ...

class RunAhead(_message.Message):
    __slots__ = ("depth", "max_guess", "branches", "sort_paths")
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_GUESS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    SORT_PATHS_FIELD_NUMBER: _ClassVar[int]
    depth: int
    max_guess: int
    branches: int
    sort_paths: bool
    def __init__(self, depth: _Optional[int] = ..., max_guess: _Optional[int] = ..., branches: _Optional[int] = ..., sort_paths: _Optional[bool] = ...) -> None: ...

class DecodeRunRequest(_message.Message):
    __slots__ = ("sequence_id", "round_index", "token", "steps", "keep_features")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FEATURES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    round_index: int
    token: int
    steps: int
    keep_features: bool
    def __init__(self, sequence_id: _Optional[str] = ..., round_index: _Optional[int] = ..., token: _Optional[int] = ..., steps: _Optional[int] = ..., keep_features: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token", "logprobs", "round_index")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprobs: _common_pb2.TokenLogprobs
    round_index: int
    def __init__(self, token: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., round_index: _Optional[int] = ...) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("target", "dtype", "vocab_size", "max_context", "eos_token_ids", "max_sequences", "num_sequences", "max_prompt_tokens", "verify_cost", "prefill_chunk")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    target: str
    dtype: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_sequences: int
    num_sequences: int
    max_prompt_tokens: int
    verify_cost: _common_pb2.CostCurve
    prefill_chunk: int
    def __init__(self, target: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_sequences: _Optional[int] = ..., num_sequences: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., verify_cost: _Optional[_Union[_common_pb2.CostCurve, _Mapping]] = ..., prefill_chunk: _Optional[int] = ...) -> None: ...
