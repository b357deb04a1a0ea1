"""The one codec: aerie's dataclasses and tensors <-> `aerie.v1` messages, with input validation.

Every message that crosses a process boundary is converted here and nowhere else. Decoders check
what a peer sent and raise `InvalidRequest` naming the field (the servicer edge maps it to
INVALID_ARGUMENT): an unknown dtype, bytes that do not match dtype x shape, a wrong dtype or shape,
an oversize tensor, token ids outside the vocabulary, a malformed tree, a bad sequence id.
It knows nothing about gRPC status codes, channels or sessions.

Tensors travel as raw row-major bytes in little-endian order, the native order of every platform
aerie runs on (x86-64, aarch64): encoding is one memcpy, decoding one `frombuffer`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator, Sequence

import torch

from services.engine.engine import GenerationRequest, RoundStats
from services.engine.roles import FeatureKind
from services.engine.verifier import VerifyResult
from services.errors import InvalidRequest
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import verifier as vpb
from services.spec.cost import CostCurve
from services.spec.logprobs import TokenLogprobs
from services.spec.sampling import SamplingParams
from services.spec.tree import DraftTree, TreeParams, ancestors
from services.spec.verify import Acceptance

assert sys.byteorder == "little", "the tensor codec writes native byte order, which must be little-endian"

DTYPES: dict[int, torch.dtype] = {
    pb.DTYPE_FLOAT32: torch.float32, pb.DTYPE_BFLOAT16: torch.bfloat16, pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_INT64: torch.int64, pb.DTYPE_INT32: torch.int32, pb.DTYPE_BOOL: torch.bool,
}
WIRE_DTYPES = {v: k for k, v in DTYPES.items()}
FEATURE_KINDS: dict[int, FeatureKind] = {pb.FEATURE_KIND_HIDDEN: "hidden", pb.FEATURE_KIND_TAPS: "taps", pb.FEATURE_KIND_NONE: "none"}
WIRE_FEATURE_KINDS = {v: k for k, v in FEATURE_KINDS.items()}
SEQUENCE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_TREE_NODES = 4096  # far above any useful tree (EAGLE-2 uses 60); bounds the [N, N] mask
DEFAULT_MAX_NEW_TOKENS = 128  # a GenerateRequest without max_new_tokens (the CLI's default too)
# Documented upper bounds on what one request may carry (docs/security.md): a request over one gets
# INVALID_ARGUMENT naming the field and the limit, before anything is stored or allocated.
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids entries
MAX_TOP_K = 1 << 20  # top_k (larger than any vocabulary; 0 = off)
# seed: [0, 2**63) (SamplingParams checks it); max_new_tokens: the coordinator's AERIE_MAX_NEW_TOKENS


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- ids ---------------------------------------------------------------------------------------


def sequence_id(value: str) -> str:
    if not SEQUENCE_ID.fullmatch(value):
        raise InvalidRequest(f"sequence_id must be 1-128 characters from [A-Za-z0-9._:-]; got {value!r}")
    return value


def token_ids(values: Iterable[int], vocab_size: int, field: str) -> list[int]:
    """Check every id is in [0, vocab_size). Message as the engine's: 'prompt token id 999 at
    position 1 is outside the vocabulary [0, 128)'."""
    ids = list(values)
    for i, tok in enumerate(ids):
        if not 0 <= tok < vocab_size:
            raise InvalidRequest(
                f"{field} token id {tok} at position {i} is outside the vocabulary [0, {vocab_size})")
    return ids


# ---- tensors -------------------------------------------------------------------------------------


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_raw(data: bytes | bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def encode_tensor(t: torch.Tensor) -> pb.Tensor:
    return pb.Tensor(dtype=WIRE_DTYPES[t.dtype], shape=list(t.shape), data=_raw(t))


def _check_meta(field: str, msg: pb.Tensor, dtype: torch.dtype | None,
                shape: Sequence[int | None] | None, max_bytes: int | None) -> tuple[torch.dtype, tuple[int, ...], int]:
    """-> (dtype, shape, byte size) after checking them against the expectation."""
    if msg.dtype not in DTYPES:
        raise InvalidRequest(f"{field} has an unknown dtype ({msg.dtype}); expected one of "
                             f"{sorted(dtype_name(d) for d in DTYPES.values())}")
    dt = DTYPES[msg.dtype]
    dims = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in dims):
        raise InvalidRequest(f"{field} has a negative dimension in its shape {list(dims)}")
    if dtype is not None and dt != dtype:
        raise InvalidRequest(f"{field} must be {dtype_name(dtype)}; got {dtype_name(dt)}")
    if shape is not None and (len(dims) != len(shape) or any(e is not None and e != d for e, d in zip(shape, dims))):
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise InvalidRequest(f"{field} must have shape {want}; got {list(dims)}")
    numel = 1
    for d in dims:
        numel *= d
    size = numel * dt.itemsize
    if max_bytes is not None and size > max_bytes:
        raise InvalidRequest(f"{field} is {size} bytes (shape {list(dims)}), over the limit of {max_bytes}")
    return dt, dims, size


def decode_tensor(msg: pb.Tensor, field: str, *, dtype: torch.dtype | None = None,
                  shape: Sequence[int | None] | None = None, max_bytes: int | None = None,
                  allow_inf: bool = False) -> torch.Tensor:
    """A tensor from one message. `shape` entries of None match any size. Floating tensors must be
    finite (NaN never; +-inf only with `allow_inf`)."""
    dt, dims, size = _check_meta(field, msg, dtype, shape, max_bytes)
    if len(msg.data) != size:
        raise InvalidRequest(f"{field} has {len(msg.data)} bytes; dtype {dtype_name(dt)} and shape "
                             f"{list(dims)} need {size}")
    return finite(_from_raw(msg.data, dt, dims), field, allow_inf)


def finite(t: torch.Tensor, field: str, allow_inf: bool = False) -> torch.Tensor:
    """Refuse NaN (and inf unless allowed) before a tensor reaches any KV: features that poison a
    draft KV would keep poisoning every later tree of that sequence."""
    if t.is_floating_point():
        bad = torch.isnan(t) if allow_inf else ~torch.isfinite(t)
        if bool(bad.any()):
            raise InvalidRequest(f"{field} holds {int(bad.sum())} non-finite value(s) "
                                 f"({'NaN' if allow_inf else 'NaN or inf'})")
    return t


def tensor_chunks(t: torch.Tensor, chunk_bytes: int, first_chunk_bytes: int | None = None) -> Iterator[pb.Tensor]:
    """The chunked form: the first message carries dtype, shape and the first slice of the bytes
    (`first_chunk_bytes`, default `chunk_bytes`: less when that message carries other large fields)."""
    data = _raw(t)
    first = chunk_bytes if first_chunk_bytes is None else max(0, min(first_chunk_bytes, chunk_bytes))
    yield pb.Tensor(dtype=WIRE_DTYPES[t.dtype], shape=list(t.shape), data=data[:first])
    for offset in range(first, len(data), chunk_bytes):
        yield pb.Tensor(data=data[offset:offset + chunk_bytes])


def drafter_prefill(seq_id: str, max_rows: int, sampling: bool, tokens: torch.Tensor, features: torch.Tensor,
                    params: TreeParams | None, round_index: int, chunk_bytes: int) -> Iterator[dpb.DrafterPrefillRequest]:
    """The Drafter's Prefill stream: tokens [n] (prompt[1:] and the first token; in the first message, at
    most 10 bytes each as varints) and features [n, F] in chunks of `chunk_bytes`; `round_index` the
    call's index (1: sent as 0)."""
    chunks = tensor_chunks(features, chunk_bytes, chunk_bytes - 10 * int(tokens.numel()) - 64)
    first = dpb.DrafterPrefillRequest(sequence_id=seq_id, max_rows=max_rows, sampling=sampling, tokens=tokens.tolist(),
                                      features=next(chunks), round_index=round_index if round_index > 1 else 0)
    if params is not None:
        first.tree.CopyFrom(encode_tree_params(params))
    yield first
    for chunk in chunks:
        yield dpb.DrafterPrefillRequest(features=chunk)


class TensorAssembler:
    """Rebuilds a chunked tensor, checking dtype, shape and size as soon as the first chunk arrives
    (an oversize tensor is refused before its bytes are received)."""

    def __init__(self, field: str, *, dtype: torch.dtype | None = None,
                 shape: Sequence[int | None] | None = None, max_bytes: int | None = None) -> None:
        self.field, self.dtype, self.shape, self.max_bytes = field, dtype, shape, max_bytes
        self._meta: tuple[torch.dtype, tuple[int, ...], int] | None = None
        self._data = bytearray()

    def add(self, msg: pb.Tensor) -> None:
        if self._meta is None:
            self._meta = _check_meta(self.field, msg, self.dtype, self.shape, self.max_bytes)
        elif msg.dtype or msg.shape:
            raise InvalidRequest(f"{self.field}: only the first chunk may carry dtype and shape")
        self._data += msg.data
        if len(self._data) > self._meta[2]:
            raise InvalidRequest(f"{self.field}: chunks add up to more than the {self._meta[2]} bytes "
                                 f"its dtype and shape need")

    def result(self) -> torch.Tensor:
        if self._meta is None:
            raise InvalidRequest(f"{self.field} is missing")
        dt, dims, size = self._meta
        if len(self._data) != size:
            raise InvalidRequest(f"{self.field} has {len(self._data)} bytes; dtype {dtype_name(dt)} and "
                                 f"shape {list(dims)} need {size}")
        return finite(_from_raw(self._data, dt, dims), self.field)


# ---- parameters ----------------------------------------------------------------------------------


def encode_sampling(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, min_p=p.min_p,
                            repetition_penalty=p.repetition_penalty)
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def decode_sampling(msg: pb.SamplingParams) -> SamplingParams:
    """Validated by SamplingParams itself (InvalidRequest naming the field), plus the wire limits."""
    if msg.top_k > MAX_TOP_K:
        raise InvalidRequest(f"top_k must be <= {MAX_TOP_K} (0 = off); got {msg.top_k}")
    return SamplingParams(temperature=msg.temperature, top_p=msg.top_p if msg.HasField("top_p") else 1.0,
                          top_k=msg.top_k, seed=msg.seed, min_p=msg.min_p,
                          repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
                          logprobs=msg.logprobs if msg.HasField("logprobs") else None,
                          prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None)


def encode_logprobs(lp: TokenLogprobs | None) -> pb.TokenLogprobs | None:
    if lp is None:
        return None
    return pb.TokenLogprobs(token_ids=lp.token_ids.tolist(), logprobs=lp.logprobs.tolist(),
                            top=int(lp.top_ids.shape[1]), top_ids=lp.top_ids.flatten().tolist(),
                            top_logprobs=lp.top_logprobs.flatten().tolist(),
                            ranks=lp.ranks.tolist() if lp.ranks is not None else None)


def decode_logprobs(msg: pb.TokenLogprobs, tokens: Sequence[int] | None) -> TokenLogprobs:
    """The log-probabilities of `tokens` (a response's own): InvalidRequest when they do not match
    (`tokens` None: the message's own token ids, e.g. prompt tokens, only its shapes are checked)."""
    if tokens is None:
        tokens = list(msg.token_ids)
    n, k = len(msg.token_ids), msg.top
    if list(msg.token_ids) != list(tokens) or len(msg.logprobs) != n or k < 0 or \
            len(msg.top_ids) != n * k or len(msg.top_logprobs) != n * k or len(msg.ranks) not in (0, n):
        raise InvalidRequest(f"logprobs of {n} tokens (top {k}) do not match the {len(tokens)} tokens they "
                             f"come with")
    return TokenLogprobs(torch.tensor(list(msg.token_ids), dtype=torch.long),
                         torch.tensor(list(msg.logprobs), dtype=torch.float32),
                         torch.tensor(list(msg.top_ids), dtype=torch.long).reshape(n, k),
                         torch.tensor(list(msg.top_logprobs), dtype=torch.float32).reshape(n, k),
                         torch.tensor(list(msg.ranks), dtype=torch.long) if len(msg.ranks) == n and n else None)


def encode_tree_params(t: TreeParams) -> pb.TreeParams:
    msg = pb.TreeParams(top_k=t.top_k, depth=t.depth, size=t.size, total_tokens=t.size)  # (deprecated copy)
    if t.stop_logprob > float("-inf"):
        msg.stop_logprob = t.stop_logprob
    return msg


def decode_tree_params(msg: pb.TreeParams) -> TreeParams:
    """Raises InvalidRequest naming the bad field (TreeParams checks every value)."""
    stop = msg.stop_logprob if msg.HasField("stop_logprob") else float("-inf")
    return TreeParams(msg.top_k, msg.depth, msg.size or msg.total_tokens, stop)  # (an older peer: total_tokens)


def encode_cost(curve: CostCurve) -> pb.CostCurve:
    return pb.CostCurve(rows=list(curve.rows), seconds=list(curve.seconds))


def decode_cost(msg: pb.CostCurve, name: str) -> CostCurve | None:
    """None when the message is empty (a service that did not calibrate)."""
    if not msg.rows:
        return None
    try:
        return CostCurve(tuple(int(r) for r in msg.rows), tuple(float(x) for x in msg.seconds))
    except InvalidRequest as e:
        raise InvalidRequest(f"{name}: {e}") from None


def decode_budget(vinfo, dinfo, retrieval: bool):
    """The coordinator's budget from the services' GetInfo: t_verify from the verifier, t_draft and
    the head's prior from the drafter, its largest (or fixed) shape. Services that report no cost
    curves (built without calibration) give the drafter's shape every round, as before."""
    from services.spec.budget import NOMINAL_COSTS, build_budget
    from services.spec.cost import ZERO, CostModel

    verify = decode_cost(vinfo.verify_cost, "verifier verify_cost")
    if dinfo is None:
        if not retrieval:
            return None
        return build_budget(CostModel(verify) if verify else None, None, None, eagle=False, retrieval=True)
    tree = decode_tree_params(dinfo.tree)
    head = decode_cost(dinfo.head_cost, "drafter head_cost")
    logits = decode_cost(dinfo.logits_cost, "drafter logits_cost")
    if dinfo.fixed_tree or verify is None or head is None or logits is None:
        costs = CostModel(verify or NOMINAL_COSTS.verify, head or ZERO, logits or ZERO)
        return build_budget(costs, None, tree, eagle=True, retrieval=retrieval)
    report = {"top1_agreement": dinfo.top1_agreement} if dinfo.top1_agreement > 0 else None
    # the drafter's KV is sized for its own largest shape
    return build_budget(CostModel(verify, head, logits), report, None, eagle=True, retrieval=retrieval, largest=tree)


def feature_kind(value: int) -> FeatureKind:
    try:
        return FEATURE_KINDS[value]
    except KeyError:
        raise InvalidRequest(f"feature_kind must be HIDDEN, TAPS or NONE; got {value}") from None


# ---- draft trees ---------------------------------------------------------------------------------


def encode_tree(tree: DraftTree) -> pb.DraftTree:
    return pb.DraftTree(tokens=encode_tensor(tree.tokens.long()), parents=encode_tensor(tree.parents.long()),
                        paths=encode_tensor(tree.paths.long()), scores=encode_tensor(tree.scores.float()))


def decode_tree(msg: pb.DraftTree, vocab_size: int, max_nodes: int = MAX_TREE_NODES) -> DraftTree:
    """Rebuild a DraftTree, recomputing depths and the ancestor mask from `parents` and checking that
    every path is a root-to-leaf chain, so a malformed tree can never index out of range."""
    tokens = decode_tensor(msg.tokens, "tree.tokens", dtype=torch.int64, shape=(None,))
    n = int(tokens.shape[0])
    if not 1 <= n <= max_nodes:
        raise InvalidRequest(f"tree must have 1 to {max_nodes} nodes (this server's limit, AERIE_MAX_TREE_NODES); "
                             f"got {n}")
    token_ids(tokens.tolist(), vocab_size, "tree")
    parents = decode_tensor(msg.parents, "tree.parents", dtype=torch.int64, shape=(n,))
    scores = decode_tensor(msg.scores, "tree.scores", dtype=torch.float32, shape=(n,), allow_inf=True)
    # checked on Python lists: a tree has a few to a few hundred nodes, and per-element torch ops
    # cost more than the loops here (this runs twice per round: coordinator and verifier)
    plist = parents.tolist()
    if plist[0] != -1:
        raise InvalidRequest(f"tree.parents[0] must be -1 (node 0 is the root); got {plist[0]}")
    for i, p in enumerate(plist[1:], start=1):
        if not 0 <= p < i:
            raise InvalidRequest(f"tree.parents[{i}] must be in [0, {i}) (parents precede children); got {p}")
    depths, mask = ancestors(plist)
    width = int(depths.max()) + 1
    paths = decode_tensor(msg.paths, "tree.paths", dtype=torch.int64, shape=(None, width))
    if paths.shape[0] < 1:
        raise InvalidRequest("tree.paths must hold at least one path")
    rows = paths.tolist()
    if any(not -1 <= v < n for row in rows for v in row):
        raise InvalidRequest(f"tree.paths entries must be node indices in [0, {n}) or -1 (padding)")
    if any(row[0] != 0 for row in rows):
        raise InvalidRequest("every row of tree.paths must start at the root (node 0)")
    if any(row[j] >= 0 and row[j - 1] < 0 for row in rows for j in range(1, width)):
        raise InvalidRequest("tree.paths rows may be padded with -1 only at the end")
    for r, row in enumerate(rows):
        if any(row[j] >= 0 and plist[row[j]] != row[j - 1] for j in range(1, width)):
            raise InvalidRequest(f"tree.paths row {r} is not a root-to-leaf chain of tree.parents")
    return DraftTree(tokens=tokens, parents=parents, depths=depths, mask=mask, paths=paths, scores=scores)


# ---- verification --------------------------------------------------------------------------------


def encode_verify_result(res: VerifyResult) -> vpb.VerifyResponse:
    acc = res.acceptance
    return vpb.VerifyResponse(path=acc.path, accepted=acc.accepted, accept_length=acc.accepted,  # (deprecated copy)
                              nodes=acc.nodes.tolist(),
                              tokens=acc.tokens.tolist(), bonus=acc.bonus, features=encode_tensor(res.features))


def decode_verify_result(msg: vpb.VerifyResponse, with_features: bool = True, kept: int = 0,
                         any_rows: bool = False) -> VerifyResult:
    """`with_features` False for a sequence whose drafter consumes none (feature kind "none");
    `kept`: rows that Decode calls kept on the verifier since the previous Verify (their features
    come first); `any_rows`: the features may hold any number of rows (a run that drafts ahead: the
    rows the drafter has not taken)."""
    m = msg.accepted or msg.accept_length  # (an older verifier fills only the deprecated field)
    if len(msg.nodes) != m + 1 or len(msg.tokens) != m + 1:
        raise InvalidRequest(f"verify result has {len(msg.nodes)} nodes and {len(msg.tokens)} tokens for "
                             f"accepted {m}")
    acc = Acceptance(path=msg.path, accepted=m, nodes=torch.tensor(list(msg.nodes), dtype=torch.long),
                     tokens=torch.tensor(list(msg.tokens), dtype=torch.long), bonus=msg.bonus)
    rows = None if any_rows else kept + m + 1 if with_features else 0
    return VerifyResult(acc, decode_tensor(msg.features, "features", shape=(rows, None)))


# ---- the public API ------------------------------------------------------------------------------


def encode_generation_request(req: GenerationRequest, seq_id: str = "") -> cpb.GenerateRequest:
    return cpb.GenerateRequest(prompt_ids=list(req.prompt_ids), max_new_tokens=req.max_new_tokens,
                               sampling=encode_sampling(req.sampling), stop_token_ids=list(req.stop_token_ids),
                               ignore_eos=req.ignore_eos, sequence_id=seq_id)


def decode_generation_request(msg: cpb.GenerateRequest, max_new_tokens_limit: int) -> GenerationRequest:
    """Parameters only; token ids against the vocabulary are the engine's `validate`."""
    n = msg.max_new_tokens if msg.HasField("max_new_tokens") else min(DEFAULT_MAX_NEW_TOKENS, max_new_tokens_limit)
    if n > max_new_tokens_limit:
        raise InvalidRequest(f"max_new_tokens must be <= {max_new_tokens_limit} on this coordinator; got {n}")
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids; got {len(msg.stop_token_ids)}")
    return GenerationRequest(prompt_ids=tuple(msg.prompt_ids), max_new_tokens=n,
                             sampling=decode_sampling(msg.sampling), stop_token_ids=tuple(msg.stop_token_ids),
                             ignore_eos=msg.ignore_eos)


def round_only_stats(round_index: int) -> cpb.RoundStats:
    """A Resume message's stats: the round index alone."""
    return cpb.RoundStats(round_index=round_index, index=round_index)  # (deprecated copy)


def decode_round_index(msg: cpb.RoundStats | cpb.Sequence) -> int:
    """The round's number from a RoundStats or a Sequence: `round_index`, else (an older peer fills
    only the deprecated field) RoundStats.index / Sequence.round. Both agree whenever both are set."""
    old = msg.index if isinstance(msg, cpb.RoundStats) else msg.round
    return msg.round_index or old


def encode_stats(s: RoundStats, commit_s: float = 0.0) -> cpb.RoundStats:
    return cpb.RoundStats(round_index=s.round_index, index=s.round_index,  # (deprecated copy)
                          accept_length=s.accept_length, tree_size=s.tree_size,
                          tree_max_depth=s.tree_max_depth, tree_depth=s.tree_max_depth,  # (deprecated copy)
                          draft_s=s.draft_s, verify_s=s.verify_s, commit_s=commit_s,
                          ahead=s.ahead, ahead_s=s.ahead_s, ahead_wait_s=s.ahead_wait_s, ahead_hit=s.ahead_hit,
                          saved_s=s.saved_s, drafted_in_verify=s.drafted_in_verify, detached=s.detached,
                          run=s.run, tree_run=s.tree_run)


def decode_stats(msg: cpb.RoundStats) -> RoundStats:
    return RoundStats(round_index=decode_round_index(msg), accept_length=msg.accept_length, tree_size=msg.tree_size,
                      tree_max_depth=msg.tree_max_depth or msg.tree_depth,  # (an older coordinator: tree_depth)
                      draft_s=msg.draft_s, verify_s=msg.verify_s, ahead=msg.ahead, ahead_s=msg.ahead_s,
                      ahead_wait_s=msg.ahead_wait_s, ahead_hit=msg.ahead_hit, saved_s=msg.saved_s,
                      drafted_in_verify=msg.drafted_in_verify, detached=msg.detached, run=msg.run,
                      tree_run=msg.tree_run)
