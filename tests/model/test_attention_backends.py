"""The attention backends (services/model/attention.py) compute one function: `grouped` and
`expanded`, the CUDA paths, run here on the CPU against SDPA, for causal, tree-masked and
maskless-decode calls with grouped heads (`paged`, which only the static-shape forward runs, is the
device's default here: SDPA on the CPU; its kernel is tested in test_paged_attention.py)."""

import sys
import types

import pytest
import torch

from services.model.attention import attend, paged_attention_fn


@pytest.mark.parametrize("backend", ["grouped", "expanded", "paged"])
@pytest.mark.parametrize("case", ["decode", "causal-prefill", "tree-mask"])
def test_backend_equals_sdpa(monkeypatch, backend, case):
    g = torch.Generator().manual_seed(len(case))
    h, nkv, hd = 8, 2, 16
    t, s = {"decode": (1, 40), "causal-prefill": (12, 12), "tree-mask": (5, 30)}[case]
    q = torch.randn(h, t, hd, generator=g)
    k, v = torch.randn(nkv, s, hd, generator=g), torch.randn(nkv, s, hd, generator=g)
    mask = None
    if case == "tree-mask":
        mask = torch.ones(t, s, dtype=torch.bool)
        mask[:, s - t:] = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                        [1, 0, 1, 0, 1]]).bool()
    causal = case == "causal-prefill"
    monkeypatch.setenv("AERIE_ATTENTION", "sdpa")
    expected = attend(q, k, v, mask, causal)
    monkeypatch.setenv("AERIE_ATTENTION", backend)
    got = attend(q, k, v, mask, causal)
    assert got.shape == (h, t, hd)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and it is not SDPA without the mask: the masked keys change the answer
    if mask is not None:
        assert not torch.allclose(attend(q, k, v, None, False), expected, atol=1e-3)


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("AERIE_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="AERIE_ATTENTION must be one of sdpa, grouped, expanded, paged; got 'cudnn'"):
        attend(torch.zeros(2, 1, 4), torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), None, False)


def test_paged_without_triton_names_the_variable_and_the_package(monkeypatch):
    monkeypatch.delitem(sys.modules, "services.model.paged_attention", raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delenv("AERIE_ATTENTION", raising=False)
    assert paged_attention_fn(torch.device("cpu"), 1) is None  # not selected: nothing imported
    monkeypatch.setenv("AERIE_ATTENTION", "paged")
    with pytest.raises(RuntimeError, match="AERIE_ATTENTION=paged needs the triton package"):
        paged_attention_fn(torch.device("cpu"), 1)


def test_paged_is_the_cuda_default_for_decode_blocks_only(monkeypatch):
    """Without AERIE_ATTENTION, CUDA static-shape blocks of one row a sequence run the paged kernel
    (measured faster there; trees keep `grouped`), never the CPU; triton missing -> `grouped`, no error.
    The kernel module is stood in for so triton is not imported here (its CPU tests must set the
    interpreter flag before the first import)."""
    kernel = types.ModuleType("services.model.paged_attention")
    kernel.paged_attention = lambda *a: None
    monkeypatch.setitem(sys.modules, "services.model.paged_attention", kernel)
    monkeypatch.delenv("AERIE_ATTENTION", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [paged_attention_fn(cuda, t) for t in (1, 2, 8, 64)] == [kernel.paged_attention] * 4
    assert paged_attention_fn(cuda, 65) is None  # wider blocks (prefill chunks) gather for `expanded`
    assert paged_attention_fn(cpu, 1) is None
    monkeypatch.setenv("AERIE_ATTENTION", "grouped")
    assert paged_attention_fn(cuda, 1) is None
    monkeypatch.setenv("AERIE_ATTENTION", "paged")
    assert paged_attention_fn(cuda, 64) is kernel.paged_attention
    monkeypatch.delenv("AERIE_ATTENTION")
    monkeypatch.setitem(sys.modules, "services.model.paged_attention", None)  # no triton: import fails
    assert paged_attention_fn(cuda, 1) is None


def test_a_kernel_that_does_not_run_here_keeps_the_gathered_path(monkeypatch, caplog):
    """The default checks once per (device, heads) that the kernel builds and runs (a GPU whose Triton
    cannot build it keeps `grouped`, logged, instead of failing every request); forcing skips the check."""
    from services.model import attention

    heads = attention.DecodeHeads(torch.float32, 4, 2, 8)
    seen = []

    def works(q, k, v, table, prefix, tree, scale):
        seen.append((q.shape, k.shape, table.shape, prefix.shape, tree.shape))
        return q

    def broken(*args):
        raise RuntimeError("out of resource: shared memory, Required: 327680")

    assert attention.paged_runs(works, torch.device("cpu"), heads)
    assert attention.paged_runs(works, torch.device("cpu"), heads, 64)
    assert seen == [((1, 1, 4, 8), (2, 1024, 8), (1, 1024), (1,), (1, 1, 1)),
                    ((1, 64, 4, 8), (2, 1024, 8), (1, 1024), (1,), (1, 64, 64))]
    with caplog.at_level("WARNING", logger="services.model.attention"):
        assert not attention.paged_runs(broken, torch.device("cpu"), heads)
        assert not attention.paged_runs(broken, torch.device("cpu"), heads, 64)
    assert "decode steps keep the gathered `grouped` attention" in caplog.text
    assert "trees (steps of up to 64 rows) keep the gathered `grouped` attention" in caplog.text
    assert "Required: 327680" in caplog.text  # the cause, with its traceback

    kernel = types.ModuleType("services.model.paged_attention")
    kernel.paged_attention = works
    monkeypatch.setitem(sys.modules, "services.model.paged_attention", kernel)
    monkeypatch.delenv("AERIE_ATTENTION", raising=False)
    monkeypatch.setattr(attention, "_paged_runs_here", lambda device, h, kernel, rows: False)
    assert paged_attention_fn(torch.device("cuda"), 1, heads) is None
    monkeypatch.setattr(attention, "_paged_runs_here", lambda device, h, kernel, rows: True)
    assert paged_attention_fn(torch.device("cuda"), 1, heads) is works
    monkeypatch.setattr(attention, "_paged_runs_here", lambda device, h, kernel, rows: False)
    monkeypatch.setenv("AERIE_ATTENTION", "paged")
    assert paged_attention_fn(torch.device("cuda"), 1, heads) is works  # forced: no check


def test_the_check_is_remembered_per_device_and_heads_but_never_during_a_capture(monkeypatch):
    from services.model import attention

    monkeypatch.setattr(attention, "_PAGED_RUNS", {})
    calls = []

    def kernel(q, *args):
        calls.append(q.shape)
        return q

    cpu = torch.device("cpu")
    h = attention.DecodeHeads(torch.float32, 4, 2, 8)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert attention._paged_runs_here(cpu, h, kernel) and calls == [] and attention._PAGED_RUNS == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert attention._paged_runs_here(cpu, h, kernel) and attention._paged_runs_here(cpu, h, kernel)
    assert calls == [(1, 1, 4, 8)] and attention._PAGED_RUNS == {(cpu, h, 1): True}
    # trees: tried once, at the widest tree (the largest query block), for every width
    assert all(attention._paged_runs_here(cpu, h, kernel, rows) for rows in (2, 16, 64))
    assert calls[1:] == [(1, 64, 4, 8)] and attention._PAGED_RUNS == {(cpu, h, 1): True, (cpu, h, 64): True}
