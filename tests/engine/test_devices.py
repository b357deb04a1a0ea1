"""Device handling, tested on the CPU in ways that fail for a cpu/cuda mix-up.

No GPU runs here, so two stand-ins:
  * the `meta` device behaves like CUDA for placement (an op mixing a meta tensor with a non-scalar
    CPU tensor raises "Tensor on device cpu is not on the expected device meta", as CUDA does, and
    indexing with CPU indices is allowed, as on CUDA), and it has no data: the first host copy
    raises "Cannot copy out of meta tensor". A verify round with the model on meta therefore runs
    the whole forward, tree handling and acceptance on the device and must stop exactly at the
    acceptance's one host copy of the accepted path;
  * a torch-function audit: during real CPU rounds every tensor factory called from aerie's code
    must name its device (a factory without `device=` lands on the CPU and mixes with CUDA tensors).
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from services.device import check_device, default_dtype, resolve_device
from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier, _Sequence
from services.errors import InvalidRequest
from services.model.target import TargetModel
from services.spec.penalty import SeenTokens
from services.spec.sampling import SamplingParams, round_generator
from services.spec.tree import TreeParams, build_tree
from services.spec.verify import accept_greedy, accept_sampling

TREE = TreeParams(top_k=3, depth=2, size=8)


def small_tree(device="cpu"):
    # root 5 -> (7 -> (9, 11), 8)
    return build_tree(torch.tensor([5, 7, 8, 9, 11], device=device), torch.tensor([-1, 0, 0, 1, 1], device=device),
                      torch.zeros(5, device=device), False)


def test_device_names():
    assert check_device("CUDA:1") == "cuda:1" and check_device("cpu") == "cpu"
    for bad in ("gpu", "cuda:x", "tpu", "cuda:"):
        with pytest.raises(InvalidRequest, match="device must be cpu, cuda or cuda:N"):
            check_device(bad)
    assert default_dtype("cuda:0") == "bf16" and default_dtype("cpu") == "fp32"


@pytest.mark.parametrize("gpus", [0, 1])
def test_resolve_device_defaults_to_cuda_when_torch_sees_one(monkeypatch, gpus):
    """Both branches on any machine: torch's view of the GPUs is stubbed (this test never touches one)."""
    monkeypatch.delenv("AERIE_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert resolve_device(None) == ("cuda" if gpus else "cpu")
    assert resolve_device("cpu") == "cpu"
    if gpus:
        assert resolve_device("cuda:0") == "cuda:0"
        with pytest.raises(InvalidRequest, match=r"'cuda:1' asked for, but torch sees 1 GPU"):
            resolve_device("cuda:1")
    else:
        with pytest.raises(InvalidRequest, match="torch sees no CUDA GPU"):
            resolve_device("cuda")


def test_aerie_device_env(monkeypatch):
    monkeypatch.setenv("AERIE_DEVICE", "cpu")
    assert resolve_device(None) == "cpu"
    monkeypatch.setenv("AERIE_DEVICE", "npu")
    with pytest.raises(InvalidRequest, match="'npu'"):
        resolve_device(None)


def test_tree_to_moves_every_tensor():
    tree = small_tree()
    assert tree.to("cpu") is tree  # no copy when already there
    moved = tree.to("meta")
    for name in ("tokens", "parents", "depths", "mask", "paths", "scores"):
        assert getattr(moved, name).device.type == "meta", name
    assert moved.paths.shape == tree.paths.shape


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["plain", "repetition-penalty"])
def test_verify_round_on_the_device_until_the_one_host_copy(llama_pair, penalty):
    """The model, its KV and the tree on `meta`: the round must run with no device mix and no host
    sync until acceptance copies the accepted path back, in accept_greedy (a repetition penalty's
    per-node context masks included)."""
    _, target, _ = llama_pair
    with torch.device("meta"):
        model = TargetModel(target.config).eval().requires_grad_(False)
    verifier = Verifier(model, "hidden")
    slot = verifier.runner.allocate(64)
    verifier.runner.pool.cache(slot).length = 10  # as if a 10-token prompt had been prefilled
    seen = SeenTokens(target.config.vocab_size, "meta") if penalty != 1.0 else None
    verifier._seqs["s"] = _Sequence(slot, 10, capacity=64, reserved=64, age=0, feature_kind="hidden", seen=seen,
                                    sampling=SamplingParams(repetition_penalty=penalty))
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor") as info:
        verifier.verify("s", small_tree("cpu"), 1)  # a host tree, as the drafter service sends it
    frames = [f for f in traceback.extract_tb(info.tb) if "/services/" in f.filename]
    assert frames[-1].name == "accept_greedy_argmax" and "one sync" in frames[-1].line, frames[-1]


def test_sampling_refuses_a_generator_on_another_device():
    tree = small_tree()
    logits = torch.zeros(5, 16, device="meta")
    with pytest.raises(ValueError, match="generator is on cpu, the logits on meta"):
        accept_sampling(tree, logits, SamplingParams(temperature=1.0), round_generator(1, 1, "cpu"))


def test_greedy_acceptance_matches_on_a_moved_tree():
    torch.manual_seed(0)
    logits = torch.randn(5, 16)
    logits[0, 7] = logits[1, 9] = logits[3, 2] = 100.0  # root -> 7 -> 9 accepted, bonus 2
    acc = accept_greedy(small_tree(), logits)
    assert (acc.accepted, acc.nodes.tolist(), acc.tokens.tolist(), acc.bonus) == (2, [0, 1, 3], [5, 7, 9], 2)
    assert acc.nodes.device.type == "cpu" and acc.tokens.device.type == "cpu"


FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "eye", "rand", "randn", "randint",
             "linspace", "as_tensor"}


class FactoryAudit(TorchFunctionMode):
    """Records tensor factories called from aerie's code (services/) without an explicit device."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        keeps_device = name == "as_tensor" and args and isinstance(args[0], torch.Tensor)  # no new tensor
        if name in FACTORIES and "device" not in kwargs and not keeps_device:
            caller = sys._getframe(1)
            if "/services/" in caller.f_code.co_filename:
                self.missing.append(f"torch.{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("temperature,extra", [(0.0, {}), (0.8, {}),
                                               (0.0, {"repetition_penalty": 1.3, "logprobs": 2}),
                                               (0.8, {"repetition_penalty": 1.3, "min_p": 0.05, "logprobs": 2})],
                         ids=["greedy", "sampled", "greedy-penalty-logprobs", "sampled-penalty-min_p-logprobs"])
def test_round_factories_name_their_device(llama_pair, temperature, extra):
    """A real draft/verify loop on the CPU (prefill, draft, verify, decode): every tensor created by
    aerie's hot path names its device, so on a GPU nothing lands on the host by default (the
    repetition penalty's context masks and the log-probabilities included)."""
    _, target, head = llama_pair
    verifier = Verifier(target, head.feature_kind)
    engine = Engine(verifier, Drafter(head, TREE), 512, target.config.vocab_size)
    plain = Engine(verifier, None, 512, target.config.vocab_size)
    req = GenerationRequest((3, 17, 29, 4), max_new_tokens=12,
                            sampling=SamplingParams(temperature=temperature, seed=7, **extra))
    # the engine itself builds host tensors (prompt, pending tokens) that the roles move: audit the roles
    audit = FactoryAudit()
    for role, method in ((verifier, "prefill"), (verifier, "verify"), (verifier, "decode"),
                         (engine.drafter, "draft")):
        original = getattr(role, method)

        def audited(*a, _original=original, **kw):
            with audit:
                return _original(*a, **kw)
        setattr(role, method, audited)
    out = [t for step in engine.generate(req) for t in step.tokens]
    out_plain = [t for step in plain.generate(req) for t in step.tokens]
    assert len(out) == 12 and len(out_plain) == 12
    if temperature == 0.0:
        assert out == out_plain
    assert not audit.missing, audit.missing
