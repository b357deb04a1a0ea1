"""Every servicer checks that a sequence's state supports the call before mutating anything (issue 15,
item 3): a tree or draft that does not fit the sequence's reserved KV, and a second Prefill of a live
sequence, are refused with the sequence left exactly as it was (it still verifies/drafts afterwards)."""

import grpc
import pytest
import torch

from services.rpc import codec
from services.rpc.stubs import common as pb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import verifier as vpb
from tests.pipeline import start_pipeline

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url)
    yield p
    p.close()


def status_of(call):
    with pytest.raises(grpc.RpcError) as e:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    return e.value.code(), e.value.details()


def chain(n: int, first: int = 5) -> pb.DraftTree:
    """A root-to-leaf chain of n nodes."""
    from services.spec.tree import DraftTree

    tree = DraftTree(tokens=torch.arange(first, first + n), parents=torch.tensor([-1] + list(range(n - 1))),
                     depths=torch.arange(n), mask=torch.ones(n, n, dtype=torch.bool).tril(),
                     paths=torch.arange(n).unsqueeze(0), scores=torch.zeros(n))
    return codec.encode_tree(tree)


def test_verifier_tree_larger_than_the_reserved_kv_mutates_nothing(pipeline):
    stub = pipeline.verifier_stub()
    prefill = vpb.VerifierPrefillRequest(sequence_id="tight", prompt_ids=[1, 2, 3], capacity=6,
                                         feature_kind=pb.FEATURE_KIND_NONE)
    first = next(iter(stub.Prefill(prefill, timeout=30))).first_token
    verifier, pool = pipeline.verifier.verifier, pipeline.verifier.runner.pool
    seq = verifier._seqs["tight"]
    before = (seq.length, pool.length(seq.slot))
    code, details = status_of(lambda: stub.Verify(vpb.VerifyRequest(sequence_id="tight", round_index=1,
                                                                     tree=chain(8, first)), timeout=30))
    assert (code, details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                               "sequence 'tight' may use 6 KV rows; 3 used, 8 more requested")
    assert (seq.length, pool.length(seq.slot)) == before
    # the same sequence still verifies a tree that fits, as if the refused call never happened
    ok = stub.Verify(vpb.VerifyRequest(sequence_id="tight", round_index=1, tree=chain(2, first)), timeout=30)
    assert ok.bonus >= 0
    # a second Prefill of the live sequence is refused and leaves it alone
    assert status_of(lambda: stub.Prefill(prefill, timeout=30)) == \
        (INVALID, "sequence 'tight' already exists on this verifier")
    stub.Verify(vpb.VerifyRequest(sequence_id="tight", round_index=2, tree=chain(1, 7)), timeout=30)
    assert stub.Release(pb.ReleaseRequest(sequence_id="tight"), timeout=10).released


def test_drafter_rows_beyond_the_reserved_kv_mutate_nothing(pipeline):
    f = pipeline.drafter.drafter.head.config.feature_size
    stub = pipeline.drafter_stub()
    first = dpb.DrafterPrefillRequest(sequence_id="dtight", tokens=[1, 2], max_rows=4,
                                      features=codec.encode_tensor(torch.zeros(2, f)))
    stub.Prefill(iter([first]), timeout=30)
    cache = pipeline.drafter.drafter._caches["dtight"]
    rows = cache.length
    # round 2: round 1's tree is the Prefill's (a Draft of round 1 is answered as its replay)
    many = dpb.DraftRequest(sequence_id="dtight", round_index=2, tokens=list(range(1, 11)),
                            features=codec.encode_tensor(torch.zeros(10, f)))
    assert status_of(lambda: stub.Draft(many, timeout=30)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "draft KV of sequence 'dtight' holds 16 rows; 2 used, 10 committed rows "
                                            "and 12 tree rows requested")
    assert pipeline.drafter.drafter._caches["dtight"].length == rows
    # the same Prefill again is a retry (its stored answer); another one under the id is refused
    assert stub.Prefill(iter([first]), timeout=30).tree.tokens.data
    other = dpb.DrafterPrefillRequest(sequence_id="dtight", tokens=[1, 2, 3], max_rows=4,
                                      features=codec.encode_tensor(torch.zeros(3, f)))
    assert status_of(lambda: stub.Prefill(iter([other]), timeout=30)) == \
        (INVALID, "sequence 'dtight' already exists on this drafter")
    assert pipeline.drafter.drafter._caches["dtight"].length == rows
    fits = dpb.DraftRequest(sequence_id="dtight", round_index=2, tokens=[3],
                            features=codec.encode_tensor(torch.zeros(1, f)))
    assert stub.Draft(fits, timeout=30).tree.tokens.data
    stub.Release(pb.ReleaseRequest(sequence_id="dtight"), timeout=10)
