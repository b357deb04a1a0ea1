from aerie.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterPrefillRequest(_message.Message):
    __slots__ = ("sequence_id", "max_rows", "sampling", "tokens", "features", "tree", "round_index")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    max_rows: int
    sampling: bool
    tokens: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    tree: _common_pb2.TreeParams
    round_index: int
    def __init__(self, sequence_id: _Optional[str] = ..., max_rows: _Optional[int] = ..., sampling: _Optional[bool] = ..., tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., round_index: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("sequence_id", "round_index", "tokens", "features", "tree", "first_row")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    round_index: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    tree: _common_pb2.TreeParams
    first_row: int
    def __init__(self, sequence_id: _Optional[str] = ..., round_index: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., first_row: _Optional[int] = ...) -> None: ...

class DraftAheadRequest(_message.Message):
    __slots__ = ("sequence_id", "round_index", "tokens", "features", "guess", "tree", "branches", "chain", "exclude", "exclude_sizes")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    GUESS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_SIZES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    round_index: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    guess: _containers.RepeatedScalarFieldContainer[int]
    tree: _common_pb2.TreeParams
    branches: int
    chain: _containers.RepeatedScalarFieldContainer[int]
    exclude: _containers.RepeatedScalarFieldContainer[int]
    exclude_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[str] = ..., round_index: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., guess: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., branches: _Optional[int] = ..., chain: _Optional[_Iterable[int]] = ..., exclude: _Optional[_Iterable[int]] = ..., exclude_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tree", "busy")
    TREE_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.DraftTree
    busy: float
    def __init__(self, tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., busy: _Optional[float] = ...) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("draft", "dtype", "feature_kind", "feature_size", "vocab_size", "tree", "max_sequences", "num_sequences", "fixed_tree", "head_cost", "logits_cost", "top1_agreement")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_KIND_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FIXED_TREE_FIELD_NUMBER: _ClassVar[int]
    HEAD_COST_FIELD_NUMBER: _ClassVar[int]
    LOGITS_COST_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    draft: str
    dtype: str
    feature_kind: _common_pb2.FeatureKind
    feature_size: int
    vocab_size: int
    tree: _common_pb2.TreeParams
    max_sequences: int
    num_sequences: int
    fixed_tree: bool
    head_cost: _common_pb2.CostCurve
    logits_cost: _common_pb2.CostCurve
    top1_agreement: float
    def __init__(self, draft: _Optional[str] = ..., dtype: _Optional[str] = ..., feature_kind: _Optional[_Union[_common_pb2.FeatureKind, str]] = ..., feature_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., max_sequences: _Optional[int] = ..., num_sequences: _Optional[int] = ..., fixed_tree: _Optional[bool] = ..., head_cost: _Optional[_Union[_common_pb2.CostCurve, _Mapping]] = ..., logits_cost: _Optional[_Union[_common_pb2.CostCurve, _Mapping]] = ..., top1_agreement: _Optional[float] = ...) -> None: ...
