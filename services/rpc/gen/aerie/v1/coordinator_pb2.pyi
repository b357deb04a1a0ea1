from aerie.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SequenceStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEQUENCE_STATUS_UNSPECIFIED: _ClassVar[SequenceStatus]
    SEQUENCE_STATUS_RUNNING: _ClassVar[SequenceStatus]
    SEQUENCE_STATUS_FINISHED: _ClassVar[SequenceStatus]
    SEQUENCE_STATUS_CANCELLED: _ClassVar[SequenceStatus]
    SEQUENCE_STATUS_FAILED: _ClassVar[SequenceStatus]
SEQUENCE_STATUS_UNSPECIFIED: SequenceStatus
SEQUENCE_STATUS_RUNNING: SequenceStatus
SEQUENCE_STATUS_FINISHED: SequenceStatus
SEQUENCE_STATUS_CANCELLED: SequenceStatus
SEQUENCE_STATUS_FAILED: SequenceStatus

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "skip_chat_template", "add_special_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SKIP_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    skip_chat_template: bool
    add_special_tokens: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., skip_chat_template: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "token_strs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens", "skip_special_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GenerationDefaults(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class CoordinatorInfo(_message.Message):
    __slots__ = ("target", "dtype", "vocab_size", "draft", "tree", "model", "max_context", "text", "chat_template", "max_new_tokens", "verifiers_ready", "drafters_ready", "drafters_configured", "generation_defaults", "model_aliases")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIERS_READY_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_READY_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ALIASES_FIELD_NUMBER: _ClassVar[int]
    target: str
    dtype: str
    vocab_size: int
    draft: str
    tree: _common_pb2.TreeParams
    model: str
    max_context: int
    text: bool
    chat_template: bool
    max_new_tokens: int
    verifiers_ready: int
    drafters_ready: int
    drafters_configured: int
    generation_defaults: GenerationDefaults
    model_aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, target: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., draft: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., model: _Optional[str] = ..., max_context: _Optional[int] = ..., text: _Optional[bool] = ..., chat_template: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., verifiers_ready: _Optional[int] = ..., drafters_ready: _Optional[int] = ..., drafters_configured: _Optional[int] = ..., generation_defaults: _Optional[_Union[GenerationDefaults, _Mapping]] = ..., model_aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_ids", "max_new_tokens", "sampling", "stop_token_ids", "ignore_eos", "sequence_id", "prompt", "messages", "skip_chat_template", "stop", "skip_special_tokens")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SKIP_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    sequence_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    skip_chat_template: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., sequence_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., skip_chat_template: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class RoundStats(_message.Message):
    __slots__ = ("index", "round_index", "accept_length", "tree_size", "tree_depth", "tree_max_depth", "draft_s", "verify_s", "commit_s", "ahead", "ahead_s", "ahead_wait_s", "ahead_hit", "saved_s", "drafted_in_verify", "detached", "run", "tree_run")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TREE_MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    COMMIT_S_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    AHEAD_S_FIELD_NUMBER: _ClassVar[int]
    AHEAD_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HIT_FIELD_NUMBER: _ClassVar[int]
    SAVED_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_IN_VERIFY_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    TREE_RUN_FIELD_NUMBER: _ClassVar[int]
    index: int
    round_index: int
    accept_length: int
    tree_size: int
    tree_depth: int
    tree_max_depth: int
    draft_s: float
    verify_s: float
    commit_s: float
    ahead: bool
    ahead_s: float
    ahead_wait_s: float
    ahead_hit: bool
    saved_s: float
    drafted_in_verify: bool
    detached: bool
    run: bool
    tree_run: bool
    def __init__(self, index: _Optional[int] = ..., round_index: _Optional[int] = ..., accept_length: _Optional[int] = ..., tree_size: _Optional[int] = ..., tree_depth: _Optional[int] = ..., tree_max_depth: _Optional[int] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., commit_s: _Optional[float] = ..., ahead: _Optional[bool] = ..., ahead_s: _Optional[float] = ..., ahead_wait_s: _Optional[float] = ..., ahead_hit: _Optional[bool] = ..., saved_s: _Optional[float] = ..., drafted_in_verify: _Optional[bool] = ..., detached: _Optional[bool] = ..., run: _Optional[bool] = ..., tree_run: _Optional[bool] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("drafter", "verifier")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    verifier: str
    def __init__(self, drafter: _Optional[str] = ..., verifier: _Optional[str] = ...) -> None: ...

class SequenceInfo(_message.Message):
    __slots__ = ("placement", "target", "draft", "tree", "prompt_tokens")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    target: str
    draft: str
    tree: _common_pb2.TreeParams
    prompt_tokens: int
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ..., target: _Optional[str] = ..., draft: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("sequence_id", "tokens", "stats", "finish_reason", "info", "text", "logprobs", "prompt_logprobs")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    stats: RoundStats
    finish_reason: str
    info: SequenceInfo
    text: str
    logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _common_pb2.TokenLogprobs
    def __init__(self, sequence_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[RoundStats, _Mapping]] = ..., finish_reason: _Optional[str] = ..., info: _Optional[_Union[SequenceInfo, _Mapping]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    def __init__(self, sequence_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: SequenceStatus
    def __init__(self, status: _Optional[_Union[SequenceStatus, str]] = ...) -> None: ...

class GetSequenceRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    def __init__(self, sequence_id: _Optional[str] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("sequence_id", "prompt_ids", "tokens", "status", "finish_reason", "round", "round_index", "placement", "error")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    status: SequenceStatus
    finish_reason: str
    round: int
    round_index: int
    placement: Placement
    error: str
    def __init__(self, sequence_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., status: _Optional[_Union[SequenceStatus, str]] = ..., finish_reason: _Optional[str] = ..., round: _Optional[int] = ..., round_index: _Optional[int] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("sequence_id", "from_token_index")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    from_token_index: int
    def __init__(self, sequence_id: _Optional[str] = ..., from_token_index: _Optional[int] = ...) -> None: ...
