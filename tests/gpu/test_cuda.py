"""CUDA checks (`pytest -m gpu`; skipped without a GPU; scripts/gpu_check.sh runs them): the paged,
static-shape path and its CUDA graphs against the eager path, the CPU, transformers and the EAGLE
reference fixture."""

import copy

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import DecodeCall, Verifier
from services.model.paged_kv import PagedKVPool
from services.model.runner import ModelRunner
from services.model.step import Step, StepEntry
from services.model.uniform import UniformRunner, UniformShape, forward_uniform
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams
from tests.helpers import VOCAB, hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on one)")]

SHAPES = {"60/5/10": TreeParams(10, 5, 60), "16/3/4": TreeParams(4, 3, 16), "chain 8/7/1": TreeParams(1, 7, 8),
          # dynamic depth (the budget's trees): the draft graph expands every branch, rerank applies the stop
          "60/5/10 stop -3": TreeParams(10, 5, 60, stop_logprob=-3.0)}


def on_cuda(target, head=None, dtype=torch.float32):
    """Copies of a CPU target (and its head, re-pointed at the copy's lm_head) on the GPU."""
    t = copy.deepcopy(target).to("cuda", dtype)
    if head is None:
        return t
    h = copy.deepcopy(head)
    if hasattr(h, "_target_head"):
        h._target_head = (t.lm_head,)
    return t, h.to("cuda", dtype)


def generate(engine, prompt, n, **kw):
    tokens, accepts = [], []
    for out in engine.generate(GenerationRequest(tuple(prompt), n, **kw)):
        tokens += out.tokens
        accepts.append(out.stats.accept_length)
    return tokens, accepts


def prompts(seed, count=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


@pytest.fixture
def deterministic(monkeypatch):
    """cuBLAS and torch in their deterministic modes (no atomics-based reductions)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def _steps(runner):
    """The same steps on a fresh runner: 3 prefills, 4 batched decodes, a 3-node tree. Each step's
    outputs are copied at once: a replay's logits are the graph's buffers, reused by the next one."""
    ss = [runner.allocate(200) for _ in range(3)]
    steps = [Step(tuple(StepEntry(s, torch.tensor(p), logits="last") for s, p in zip(ss, prompts(1))))]
    steps += [Step(tuple(StepEntry(s, torch.tensor([5 + k + i]), logits="last") for i, s in enumerate(ss)))
              for k in range(4)]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool()
    steps.append(Step((StepEntry(ss[0], torch.tensor([3, 4, 5]), tree_mask=tree),)))
    outs = []
    for step in steps:
        o = runner.execute(step)
        outs.append((torch.cat([x.clone() for x in o.logits]), o.hidden.clone()))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_bit_for_bit(llama_pair, dtype, deterministic):
    """The same steps through captured graphs and through the eager static-shape forward: the same
    logits and hidden states, bit for bit (decodes at batch 3, then a tree). Precondition checked
    first: two eager runs agree bit for bit (else the comparison would say nothing)."""
    _, target, _ = llama_pair
    t = on_cuda(target, dtype=dtype)
    runs = [_steps(ModelRunner(t, PagedKVPool.for_model(t, 2048), graphs=g)) for g in (False, False, True)]
    for (l0, h0), (l1, h1) in zip(runs[0], runs[1]):
        assert torch.equal(l0, l1) and torch.equal(h0, h1), "eager is not deterministic here"
    for k, ((le, he), (lg, hg)) in enumerate(zip(runs[0], runs[2])):
        assert torch.equal(le, lg) and torch.equal(he, hg), (
            f"step {k}: graph vs eager max |diff| logits {(le - lg).abs().max().item():.3g}, "
            f"hidden {(he - hg).abs().max().item():.3g}")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_fp32_cuda_equals_cpu_token_for_token(pair, shape, request):
    """EAGLE in fp32 on CUDA (paged KV, graphs) == on the CPU, and == transformers' greedy."""
    hf, target, head = request.getfixturevalue(pair)
    t, h = on_cuda(target, head)
    cpu = Engine(Verifier(target, head.feature_kind), Drafter(head, SHAPES[shape]), 512, VOCAB)
    gpu = Engine(Verifier(t, h.feature_kind), Drafter(h, SHAPES[shape]), 512, VOCAB)
    assert isinstance(gpu.verifier.runner.pool, PagedKVPool) and gpu.verifier.runner.uniform.graphs_on
    for prompt in prompts(seed=len(shape)):
        expected = generate(cpu, prompt, 40)
        assert generate(gpu, prompt, 40) == expected, prompt
        assert expected[0] == hf_greedy(hf, prompt, 40)
    assert gpu.drafter.graphs.captures >= 1 and gpu.drafter.graphs.expansions > 3  # the draft-loop graph ran


def test_the_paged_kernel_for_trees_keeps_fp32_tokens_exact(llama_pair, monkeypatch):
    """AERIE_ATTENTION=paged (the Triton kernel for trees too, not only decode steps: the candidate
    default, measured faster for trees on the H200): EAGLE in fp32 on CUDA through every tree shape
    == the CPU == transformers' greedy, and the EAGLE reference fixture's rounds replay."""
    monkeypatch.setenv("AERIE_ATTENTION", "paged")
    hf, target, head = llama_pair
    t, h = on_cuda(target, head)
    for shape in SHAPES:
        cpu = Engine(Verifier(target, head.feature_kind), Drafter(head, SHAPES[shape]), 512, VOCAB)
        gpu = Engine(Verifier(t, h.feature_kind), Drafter(h, SHAPES[shape]), 512, VOCAB)
        for prompt in prompts(seed=len(shape), count=2):
            expected = generate(cpu, prompt, 40)
            assert generate(gpu, prompt, 40) == expected, (shape, prompt)
            assert expected[0] == hf_greedy(hf, prompt, 40)
    replay_reference_fixture()


def replay_reference_fixture() -> None:
    """The EAGLE reference's greedy rounds (tests/spec/golden) through the CUDA path in fp32: every
    round's accept length and the tokens, the draft from the static draft."""
    from tests.spec import test_reference_golden as ref

    t, h = on_cuda(*ref.build_greedy_models())
    g = ref.GOLDEN["greedy"]
    for run in g["runs"]:
        total, depth, top_k = run["shape"]
        engine = Engine(Verifier(t, h.feature_kind), Drafter(h, TreeParams(top_k, depth, total)),
                        t.config.max_context, t.config.vocab_size, ())
        tokens, accepts = generate(engine, run["prompt"], g["case"]["max_new_tokens"], ignore_eos=True)
        assert accepts[1:] == run["accept_lengths"][: len(accepts) - 1]
        assert tokens == run["tokens"][: len(tokens)]
        assert engine.drafter.graphs.expansions > 0


def test_reference_fixture_replays_on_cuda_fp32():
    """The EAGLE reference's greedy rounds (tests/spec/golden) through the CUDA path in fp32."""
    replay_reference_fixture()


def test_draft_graph_replay_equals_static_eager(llama_pair):
    """The draft expansion replayed from its CUDA graph == the same static code run eagerly."""
    from services.engine.draft_graphs import DraftGraphs

    _, target, head = llama_pair
    t, h = on_cuda(target, head)
    trees = []
    for graphs in (False, True):
        d = Drafter(h, SHAPES["60/5/10"])
        d.graphs = DraftGraphs(h, d.pool, graphs=graphs)
        engine = Engine(Verifier(t, h.feature_kind), d, 512, VOCAB, device_trees=False)  # (host trees: draft_many)
        seen = []
        original = d.draft_many
        d.draft_many = lambda calls, original=original, seen=seen: seen.extend(original(calls)) or seen[-len(calls):]
        generate(engine, prompts(seed=2, count=1)[0], 32)
        trees.append([(x.tokens.tolist(), x.parents.tolist()) for x in seen])
        assert d.graphs.expansions > 3
    assert trees[0] == trees[1]


@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_a_batched_draft_graph_drafts_each_sequence_s_own_draft(pair, request):
    """Several sequences' drafts of one shape in one CUDA graph per batch bucket (Drafter.draft_many ->
    DraftGraphs.draft_batch) == each drafted alone from its own graph, round after round (fp32: tokens
    and parents exactly), and the graphs were replayed (one per batch bucket and width)."""
    from services.engine.drafter import DraftCall

    _, target, head = request.getfixturevalue(pair)
    _, h = on_cuda(target, head)
    params = SHAPES["16/3/4"]
    together, alone = Drafter(h, params), Drafter(h, params)
    ids = [f"s{i}" for i in range(5)]
    for d in (together, alone):
        for seq in ids:
            d.start(seq, 256, sampling=False)
    g = torch.Generator().manual_seed(4)
    f = h.config.feature_size
    for r in range(5):
        calls = []
        for i, seq in enumerate(ids):
            n = 8 if r == 0 else 1 + (i + r) % 4
            calls.append(DraftCall(seq, torch.randint(0, VOCAB, (n,), generator=g),
                                   torch.randn(n, f, generator=g).cuda(), params))
        batch = calls[: 2 + r % 4]
        got = together.draft_many(batch)
        want = [alone.draft(c.seq_id, c.tokens, c.features, c.params) for c in batch]
        for a, b in zip(got, want, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist(), r
    assert together.graphs.batched == sum(2 + r % 4 for r in range(5)) and together.graphs.captures >= 3


@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_draft_graph_with_extension_equals_static_eager_and_eager(pair, request):
    """The extension of n <= 16 committed rows + the expansion replayed from CUDA graphs (one per
    width W) == the same static code run eagerly on CUDA == the eager extend + expand, round after
    round (n = 8, 1, 3, 16, 5, 2, 1, 12 over scattered pages): candidates, last rows, draft K/V.
    Then the static draft runs under torch's sync-debug mode: no host synchronisation."""
    from services.engine.draft_graphs import DraftGraphs
    from services.spec.tree_static import draft_static
    from tests.spec.test_extend_static import ROUNDS, assert_same_draft, eager_rounds, static_rounds

    _, target, head = request.getfixturevalue(pair)
    _, h = on_cuda(target, head)
    shape = SHAPES["60/5/10"]
    graphed, pool_g, cache_g, dg = static_rounds(h, shape, graphs=True)
    static, pool_s, cache_s, _ = static_rounds(h, shape, graphs=False)
    eager, flat = eager_rounds(h, shape)
    assert dg.captures == len({DraftGraphs.width_for(n) for n in ROUNDS})  # one key bucket: a graph per W
    assert_same_draft(graphed, static, atol=1e-6)
    assert_same_draft(graphed, eager, atol=1e-4)
    rows = torch.from_numpy(cache_g.rows_host[:cache_g.length]).cuda()
    torch.testing.assert_close(pool_g.k[:, :, rows], pool_s.k[:, :, rows], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool_g.v[:, :, rows], flat.v[:, :, :flat.length], atol=1e-4, rtol=1e-4)
    w, s = 4, 256
    key_rows = torch.from_numpy(cache_s.rows_host[:s]).cuda()
    write_rows = torch.zeros(w, dtype=torch.long, device="cuda")  # the trash page
    stable = torch.tensor([cache_s.length], device="cuda")
    count = torch.tensor([3], device="cuda")
    feats = torch.zeros(w, h.config.feature_size, device="cuda")
    toks = torch.zeros(w, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        draft_static(h, pool_s, key_rows, write_rows, stable, count, feats, toks, 10, 5)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_start_up_warm_up_captures_the_graphs_requests_then_replay(llama_pair, deterministic):
    """ModelRunner.warm_up on CUDA captures the decode (1, 2, 4, 8 sequences) and tree (2-64 rows)
    graphs, with and without taps, before any request (20 graphs, memory reported); the steps that
    follow replay them (no capture of a warmed shape) and give a cold runner's bits."""
    _, target, _ = llama_pair
    t = on_cuda(target)
    warm = ModelRunner(t, PagedKVPool.for_model(t, 2048), graphs=True)
    done = warm.warm_up(max_sequences=8)
    assert (done.shapes, done.graphs, warm.uniform.captures) == (20, True, 20) and done.memory_bytes > 0
    # _steps' decodes of 3 sequences and its 3-row tree run warmed shapes (4 x 1 and 1 x 4 rows)
    assert {UniformShape(4, 1, 256, False), UniformShape(1, 4, 256, False)} <= set(warm.uniform._graphs)
    runs = [_steps(warm), _steps(ModelRunner(t, PagedKVPool.for_model(t, 2048), graphs=True))]
    for (l0, h0), (l1, h1) in zip(*runs, strict=True):
        assert torch.equal(l0, l1) and torch.equal(h0, h1)


def test_bf16_plain_equals_transformers_bf16(llama_pair):
    hf, target, _ = llama_pair
    hf16 = copy.deepcopy(hf).to("cuda", torch.bfloat16)
    t = on_cuda(target, dtype=torch.bfloat16)
    engine = Engine(Verifier(t), None, 512, VOCAB)
    for prompt in prompts(seed=4):
        out = hf16.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert generate(engine, prompt, 32)[0] == out[0, len(prompt):].tolist()


def test_batched_equals_alone_on_cuda(llama_pair):
    _, target, _ = llama_pair
    t = on_cuda(target)
    batch, alone = Verifier(t), Verifier(t)
    last = {}
    for i, p in enumerate(prompts(seed=6, count=5)):
        last[i] = batch.prefill(f"s{i}", torch.tensor(p), SamplingParams(), 100).first_token
        assert alone.prefill(f"s{i}", torch.tensor(p), SamplingParams(), 100).first_token == last[i]
    for r in range(1, 20):
        got = batch.run([DecodeCall(f"s{i}", last[i], r) for i in range(5)])
        for i in range(5):
            assert alone.decode(f"s{i}", last[i], r) == got[i]
            last[i] = got[i]


def _kernel_inputs(t, g):
    """Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, hd 128): 3 sequences with
    prefixes 0, 300, 700 over S = 768 slots scattered in a 4096-row arena, random trees (diagonal on)."""
    b, h, nkv, hd, s, rows = 3, 32, 8, 128, 768, 4096
    q = torch.randn(b, t, h, hd, generator=g, device="cuda")
    k, v = (torch.randn(nkv, rows, hd, generator=g, device="cuda") for _ in range(2))
    table = torch.randperm(rows, generator=g, device="cuda")[:b * s].view(b, s)
    prefix = torch.tensor([0, 300, 700], device="cuda")
    tree = ((torch.rand(b, t, t, generator=g, device="cuda") < 0.5).tril(-1)
            | torch.eye(t, dtype=torch.bool, device="cuda")).long()
    return q, k, v, table, prefix, tree


@pytest.mark.parametrize("t", [1, 16, 64])
@pytest.mark.parametrize("splits", [None, 1])
def test_paged_kernel_equals_gathered_attention_on_cuda(t, splits):
    """The Triton kernel (AERIE_ATTENTION=paged) against `grouped`'s gather + attend_gathered. fp32:
    equal to 1e-4. bf16: both compared with the fp32 answer; the kernel's error is at most twice
    grouped's (it keeps the scores in fp32, grouped rounds them to bf16 first)."""
    from services.model.paged_attention import paged_attention
    from tests.helpers import gathered_attention

    g = torch.Generator(device="cuda").manual_seed(t)
    q, k, v, table, prefix, tree = _kernel_inputs(t, g)
    hd = k.shape[2]

    def grouped(q, k, v):
        return gathered_attention(q, k, v, table, prefix, tree)

    exact = grouped(q, k, v)
    got = paged_attention(q, k, v, table, prefix, tree, hd ** -0.5, splits=splits)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    err_paged = (paged_attention(q16, k16, v16, table, prefix, tree, hd ** -0.5, splits=splits).float()
                 - exact).abs().max().item()
    err_grouped = (grouped(q16, k16, v16).float() - exact).abs().max().item()
    assert err_paged <= 2 * err_grouped + 1e-3, (err_paged, err_grouped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_backend_equals_grouped_and_replays_bit_for_bit(llama_pair, dtype, deterministic, monkeypatch):
    """The static-shape forward with AERIE_ATTENTION=paged: eagerly, the logits of `grouped` (fp32
    to 1e-4; bf16 to 5e-2); replayed from CUDA graphs, the eager paged run's bits."""
    _, target, _ = llama_pair
    t = on_cuda(target, dtype=dtype)
    monkeypatch.setenv("AERIE_ATTENTION", "grouped")
    grouped = _steps(ModelRunner(t, PagedKVPool.for_model(t, 2048), graphs=False))
    monkeypatch.setenv("AERIE_ATTENTION", "paged")
    eager = _steps(ModelRunner(t, PagedKVPool.for_model(t, 2048), graphs=False))
    replayed = _steps(ModelRunner(t, PagedKVPool.for_model(t, 2048), graphs=True))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for k, ((lg, _), (le, he), (lr, hr)) in enumerate(zip(grouped, eager, replayed, strict=True)):
        torch.testing.assert_close(le.float(), lg.float(), rtol=tol, atol=tol, msg=lambda m, k=k: f"step {k}: {m}")
        assert torch.equal(le, lr) and torch.equal(he, hr), (
            f"step {k}: paged graph vs eager max |diff| logits {(le - lr).abs().max().item():.3g}")


@pytest.mark.parametrize("backend", ["default", "grouped", "paged"])
def test_static_forward_and_replay_never_synchronise(llama_pair, backend, monkeypatch):
    """torch's sync debug mode raises on any host synchronisation inside the forward and the replay."""
    if backend != "default":
        monkeypatch.setenv("AERIE_ATTENTION", backend)
    _, target, _ = llama_pair
    t = on_cuda(target)
    pool = PagedKVPool.for_model(t, 1024)
    runner = UniformRunner(t, pool, graphs=True)
    slot = pool.allocate(64)
    step = Step((StepEntry(slot, torch.tensor([1]), logits="last"),))
    shape = runner.shape_for(step)
    inputs = runner.fill(step, shape).to("cuda")
    graph = runner._capture(shape)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_uniform(t, pool, shape, inputs)
        graph.inputs.copy_(inputs)
        graph.graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(RuntimeError):  # the detector works
        torch.cuda.set_sync_debug_mode("error")
        try:
            int(inputs.max())
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_plain_runs_give_the_same_tokens_and_queue_steps_without_a_host_read(llama_pair):
    """In-process plain runs from CUDA graphs (services/engine/plain_run.py): the tokens of one decode
    a round and of transformers (fp32), a stop inside a run too; queuing a step from the previous
    step's device argmax makes no host synchronisation (torch's sync debug mode)."""
    hf, target, _ = llama_pair
    t = on_cuda(target)

    def verifier():
        return Verifier(None, "hidden", runner=ModelRunner(t, PagedKVPool.for_model(t, 2048), graphs=True))

    p = prompts(7, 1)[0]
    want = hf_greedy(hf, p, 20)
    runs = Engine(verifier(), None, t.config.max_context, VOCAB, plain_run=8)
    single = Engine(verifier(), None, t.config.max_context, VOCAB)
    assert generate(runs, p, 20)[0] == generate(single, p, 20)[0] == want
    stop = want[10]
    assert generate(runs, p, 20, stop_token_ids=(stop,))[0] == want[:want.index(stop) + 1]
    v = verifier()
    first = v.prefill("s", torch.tensor(p), SamplingParams(), 64).first_token
    tok = v.decode_on_device("s", first, 1)  # captures the decode graph (a capture synchronises)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for r in range(2, 5):
            tok = v.decode_on_device("s", tok, r)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(tok) == want[4] and v.length("s") == len(p) + 4


def test_drafter_warm_up_captures_its_tree_s_graphs_before_requests(llama_pair):
    """Drafter.warm_up on CUDA: the drafter's tree at the expansion alone and every extension width
    (6 graphs, first key bucket); a short generation afterwards replays them without a capture and
    gives the tokens of a cold drafter."""
    _, target, head = llama_pair
    t, h = on_cuda(target, head)
    warm, cold = Drafter(h, SHAPES["16/3/4"]), Drafter(h, SHAPES["16/3/4"])
    done = warm.warm_up()
    assert (done.shapes, done.graphs, warm.graphs.captures) == (6, True, 6)
    p = prompts(9, 1)[0]
    out = [generate(Engine(Verifier(t, h.feature_kind), d, 512, VOCAB), p, 24) for d in (warm, cold)]
    assert out[0] == out[1] and warm.graphs.captures == 6 and warm.graphs.expansions > 3


def test_drafter_warm_up_captures_the_batched_drafts_too(llama_pair):
    """Drafter.warm_up(max_sequences) on CUDA (the 42nd, written without a GPU: its body ran on the CPU
    with the capture stood in for, tests/spec/test_extend_static.py): besides the 6 graphs above, the
    batched drafts of its tree for batch buckets 2 and 4 at every extension width (10 graphs); three
    sequences drafted together afterwards replay them without a capture and give a cold drafter's trees."""
    from tests.spec.test_extend_static import draft_three_together

    _, target, head = llama_pair
    t, h = on_cuda(target, head)
    warm, cold = Drafter(h, SHAPES["16/3/4"]), Drafter(h, SHAPES["16/3/4"])
    done = warm.warm_up(3)
    assert (done.shapes, done.graphs, warm.graphs.captures) == (16, True, 16)
    draft_three_together(warm, cold, SHAPES["16/3/4"])
    assert warm.graphs.captures == 16


def test_device_trees_queue_the_verify_behind_the_draft_without_a_host_read(llama_pair):
    """On CUDA the in-process engine leaves each tree on the device between draft and verify
    (Engine.device_trees, on by default there): fp32 tokens == host trees == transformers. A round's
    draft (replayed, re-ranked on the device) and its verify forward are queued without a host
    synchronisation (torch's sync debug mode); acceptance then reads the argmax and the host tree."""
    hf, target, head = llama_pair
    t, h = on_cuda(target, head)
    p = prompts(13, 1)[0]

    def engine(on):
        return Engine(Verifier(t, h.feature_kind), Drafter(h, SHAPES["60/5/10"]), 512, VOCAB, device_trees=on)

    default = engine(None)
    assert default.device_trees
    assert generate(default, p, 30)[0] == generate(engine(False), p, 30)[0] == hf_greedy(hf, p, 30)
    v, d = Verifier(t, h.feature_kind), Drafter(h, SHAPES["60/5/10"])
    d.warm_up()  # the draft graphs of every extension width
    pre = v.prefill("s", torch.tensor(p), SamplingParams(), 256)
    d.start("s", 256, sampling=False)
    res = v.verify("s", d.draft_on_device("s", torch.tensor(p[1:] + [pre.first_token]), pre.features), 1)
    out = [pre.first_token, *res.acceptance.new_tokens]
    execute = v.runner.execute

    def strict(step):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    v.runner.execute = strict
    for r in (2, 3):  # widths and key slots of round 1: no capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tree = d.draft_on_device("s", torch.tensor(res.acceptance.new_tokens), res.features)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        res = v.verify("s", tree, r)
        out += res.acceptance.new_tokens
    assert out == hf_greedy(hf, p, len(out))


def test_verdict_drafts_queue_the_next_draft_without_a_host_read(llama_pair, monkeypatch):
    """A fixed tree on CUDA: each greedy round's next draft is queued from the verdict on the device
    (Engine.verdict_drafts, on by default there) with no host synchronisation (the hook runs under
    torch's sync debug mode: a sync raises, and the engine would turn verdict drafts off); every
    round's draft after the first is committed from its verdict; fp32 tokens == transformers."""
    hf, target, head = llama_pair
    t, h = on_cuda(target, head)
    p = prompts(17, 1)[0]
    d = Drafter(h, SHAPES["60/5/10"])
    d.warm_up()
    e = Engine(Verifier(t, h.feature_kind), d, 512, VOCAB)
    assert e.device_trees and e.verdict_drafts
    want = hf_greedy(hf, p, 30)
    assert generate(e, p, 30)[0] == want  # (captures the verify graphs)
    commits = []
    commit = d.commit
    monkeypatch.setattr(d, "commit", lambda seq_id, n: (commits.append(n), commit(seq_id, n))[1])
    verdict_hook = Engine._verdict_hook

    def strict(self, seq_id, seq, draft):
        hook = verdict_hook(self, seq_id, seq, draft)
        if hook is None:
            return None

        def run(logits, features):
            torch.cuda.set_sync_debug_mode("error")
            try:
                hook(logits, features)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    monkeypatch.setattr(Engine, "_verdict_hook", strict)
    tokens, accepts = generate(e, p, 30)
    assert tokens == want and e.verdict_drafts
    assert len(commits) == len(accepts) - 2 > 3 and commits == accepts[1:-1]


def test_the_adaptive_budget_drafts_from_verdicts_without_a_host_read(llama_pair, monkeypatch):
    """The adaptive budget on CUDA (a GPU-like cost model): the next draft is queued from each verdict
    with no host synchronisation, and the tree the plan made after the verdict asks for (a re-rank of
    the same candidates, or an expansion alone: Drafter.redraft) is built without one either; the
    queued drafts served rounds; fp32 tokens == transformers."""
    from services.spec.acceptance import prior_stats
    from services.spec.budget import AUTO_LARGEST, Budget
    from services.spec.cost import CostCurve, CostModel

    hf, target, head = llama_pair
    t, h = on_cuda(target, head)
    p = prompts(19, 1)[0]
    rows = (1, 2, 4, 8, 16, 32, 64)
    costs = CostModel(CostCurve(rows, tuple(1 + 0.02 * (r - 1) for r in rows)), CostCurve((1, 16), (0.05, 0.06)),
                      CostCurve((1, 16), (0.05, 0.07)))
    d = Drafter(h, AUTO_LARGEST)
    e = Engine(Verifier(t, h.feature_kind), d, 512, VOCAB,
               budget=Budget(costs, prior_stats({"top1_agreement": 0.6}), largest=AUTO_LARGEST))
    assert e.device_trees and e.verdict_drafts
    want = hf_greedy(hf, p, 30)
    assert generate(e, p, 30)[0] == want  # (captures the graphs of the shapes it plans)

    def strict(f):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return f(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run

    verdict_hook = Engine._verdict_hook

    def strict_hook(self, *args):
        hook = verdict_hook(self, *args)
        return strict(hook) if hook is not None else None

    monkeypatch.setattr(Engine, "_verdict_hook", strict_hook)
    monkeypatch.setattr(d, "redraft", strict(d.redraft))
    e.verdict_counts.clear()
    e.realized = e.budget.prior.realized  # the first run's plans again: their graphs are captured (a capture syncs)
    assert generate(e, p, 30)[0] == want and e.verdict_drafts
    served = e.verdict_counts["kept"] + e.verdict_counts["reranked"] + e.verdict_counts["expanded"]
    assert served > 3 and not e.verdict_counts["dropped"], e.verdict_counts
