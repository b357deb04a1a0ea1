"""The pipeline on a model shape: plain and EAGLE decoding through `aerie up` (each service its own
process, gRPC on loopback, Redis) against the in-process engine on the same random checkpoint, on
any device, in one run (`aerie bench --shape S --device cuda --pipeline`; scripts/gpu_check.sh with
GPU_PIPELINE=1).

    res = run_pipeline_bench(PipelineBenchConfig("llama-3.1-8b", "cuda", "bf16"))   # a dict: table(res)

1. A checkpoint of the shape with random weights is written to a temporary directory: the target as
   transformers writes it (config.json + safetensors, LlamaForCausalLM) and an EAGLE-2 head as
   `save_head` writes it. No tokenizer: every request is token ids (the coordinator's gRPC API).
2. In process: `build_local_engine` on that checkpoint (what `aerie generate` runs: CUDA graphs,
   device trees, plain runs where the device has them), plain decoding and EAGLE with a fixed tree.
3. Through the services: `aerie up --target DIR --draft HEAD --tree-* ...` (its default flags
   otherwise; the HTTP API inside the coordinator), the same with `--colocate` (each verifier serves
   the head too and drafts the next tree inside each Verify: one call a round), the same with
   `--direct-drafts` (separate drafters; each verifier sends its verdict's Draft itself), then `aerie up
   --draft none` (plain decoding: no drafter), each request through the coordinator's gRPC stream
   (`RemoteSession`). The colocated and direct pipelines are compared with the in-process EAGLE engine.
   `pipelines` picks them (`aerie bench --pipelines`), among them `colocated-host`: `--colocate` with
   AERIE_DEVICE_ROUND=0 (the colocated rounds on the host: the A/B of verifier_svc/device_round.py).
   They run one after another, or with `interleave` (`--interleave`) all up at once, their requests
   taken in turn, so that the machine's drift or the order of the `aerie up`s favours none of them.

Each side decodes the same `prompt`-token prompt (random ids) `repeats` times after a warm-up
request, `tokens` new tokens each, ignoring EOS. ms/token is the decode time after the first
streamed token (the prefill's) divided by the tokens after it, the median over the repeats: the
same measure on both sides, taken where a client sees the tokens arrive. Random weights accept
nothing, so an EAGLE "token" here is a round: its cost, never a speed-up. `ratio` = in process /
pipeline ms (1.0 = the split costs nothing); `device_rounds`: a colocated verifier's
aerie_device_rounds_total (kept, dropped) after its requests, warm-up included (0 where its rounds
stayed on the host); `same_tokens`: whether the pipeline streamed the
in-process engine's greedy tokens (it should: the same forward code, one sequence); `round_ms`: a
round's median wall, draft and verify ms as each round's stats say (through the pipeline the
coordinator's draft and verify calls, transit included; the wall beyond them is the commit, the
stream and the engine's own work), where a GPU round's extra time goes; its `wall_mean` and
`slow_extra` (`summary`) say what the median leaves out: a run's first round and the single calls at
the request's end cost more than the rounds inside a run. With `profile` (a folder;
`aerie bench --profile DIR`) py-spy samples each service process while its pipeline's requests run
(services/bench/service_profile.py): `profile` in each pipeline's result, rows in the table.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import re
import subprocess
import sys
import tempfile
import urllib.request
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

READY = "ready: aerie generate --coordinator "
TREE = (4, 3, 16)  # top_k, depth, tokens: the fixed tree both sides draft
# through the services: label -> (draft, `aerie up --colocate`, the in-process label it is compared with,
# more `aerie up` flags, more environment); colocated-host: the colocated pipeline without its device
# rounds (verifier_svc/device_round.py), each round's next tree drafted and read on the host
PIPELINES = {"eagle": ("head", False, "eagle", ("--no-direct-drafts",), {}),
             "colocated": ("head", True, "eagle", (), {}),
             "colocated-host": ("head", True, "eagle", (), {"AERIE_DEVICE_ROUND": "0"}),
             "direct": ("head", False, "eagle", ("--direct-drafts",), {}),
             "plain": ("none", False, "plain", (), {})}
DEFAULT_PIPELINES = ("eagle", "colocated", "direct", "plain")


@dataclass(frozen=True, slots=True)
class PipelineBenchConfig:
    shape: str
    device: str
    dtype: str  # bf16 | fp16 | fp32
    prompt: int = 512
    tokens: int = 64
    repeats: int = 3
    startup_timeout_s: float = 600.0
    pipelines: tuple[str, ...] = DEFAULT_PIPELINES  # PIPELINES' labels, measured in this order
    interleave: bool = False  # all of them up at once, their requests in turn (else one after another)
    profile: str | None = None  # a folder: py-spy on each service while its requests run (service_profile.py)


def write_checkpoint(shape: str, device: str, dtype: str, root: Path) -> tuple[Path, Path]:
    """(target dir, head dir) of `shape` with random weights under `root` (built on `device`)."""
    from transformers import LlamaForCausalLM

    from services.bench.gpu import hf_config, random_head
    from services.model.head_checkpoint import save_head
    from services.model.loading import load_head_anchors

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    with torch.device(device):  # initialised where it is built, in its dtype (no fp32 copy)
        hf = LlamaForCausalLM._from_config(hf_config(shape), dtype=torch_dtype)
    hf.save_pretrained(root / "target")
    del hf
    anchors = load_head_anchors(str(root / "target"), torch_dtype, device).model  # the head's shape, its lm_head
    save_head(random_head(anchors), root / "head", skip=("embed_tokens.weight",))
    del anchors
    _free(device)
    return root / "target", root / "head"


@dataclass
class Stream:
    """One generation as its caller saw it."""
    seconds: float  # after the first streamed round (the prefill's)
    decoded: int  # tokens after the first round
    tokens: list[int]  # every token
    parts_ms: list[tuple[float, float, float]]  # per round from round 2 on: (wall, draft, verify) ms
    in_runs: int = 0  # of those rounds, the ones a run computed (RoundStats.run or tree_run)


def timed_stream(generate: Callable[[], Iterator]) -> Stream:
    """Time one generation's stream; each round's draft and verify seconds as its stats say (the
    coordinator's calls, RPC included, through the pipeline)."""
    first_at, first_tokens, tokens, parts = None, 0, [], []
    last, in_runs = None, 0
    for step in generate():
        now = time.perf_counter()
        tokens += step.tokens
        if first_at is None:
            first_at, first_tokens = now, len(tokens)
        elif step.stats.round_index > 1 and last is not None:  # round 1 was drafted inside the prefill step
            parts.append(((now - last) * 1e3, step.stats.draft_s * 1e3, step.stats.verify_s * 1e3))
            in_runs += step.stats.run or step.stats.tree_run
        last = now
    assert first_at is not None
    return Stream(time.perf_counter() - first_at, len(tokens) - first_tokens, tokens, parts, in_runs)


def ms_per_token(generate: Callable[[], Iterator], repeats: int) -> dict:
    """The median ms/token over `repeats` streams, after one warm-up stream (not counted); the
    tokens of the first (every stream decodes the same request greedily); a round's median wall,
    draft and verify ms over every stream's rounds."""
    timed_stream(generate)
    return summary([timed_stream(generate) for _ in range(repeats)])


def interleaved(sides: dict[str, Callable[[], Iterator]], repeats: int) -> dict[str, dict]:
    """`ms_per_token` of every side, their streams taken in turn (a warm-up of each, then each side's
    request once a repeat): a slower stretch of the machine falls on every side alike."""
    for generate in sides.values():
        timed_stream(generate)
    runs: dict[str, list[Stream]] = {label: [] for label in sides}
    for _ in range(repeats):
        for label, generate in sides.items():
            runs[label].append(timed_stream(generate))
    return {label: summary(rs) for label, rs in runs.items()}


def summary(runs: list[Stream]) -> dict:
    """ms_per_token's dict of these streams. `round_ms`: the median over every stream's rounds of the
    wall between two streamed rounds (`wall`), of draft and verify; `wall_mean`: the median over the
    streams of their mean wall (what ms/token x tokens a round comes to), and `slow_extra`: the ms a
    round, on average, that the rounds slower than 1.3x the median wall take beyond it (a run's first
    round, the single calls that may end a request: where the mean and the median part);
    `run_share`: the share of those rounds a run computed (plain or tree runs)."""
    per = [r.seconds * 1e3 / max(r.decoded, 1) for r in runs]
    parts = [p for r in runs for p in r.parts_ms]
    round_ms = {name: statistics.median(p[i] for p in parts) if parts else None
                for i, name in enumerate(("wall", "draft", "verify"))}
    walls = [[p[0] for p in r.parts_ms] for r in runs if r.parts_ms]
    median = round_ms["wall"]
    round_ms["wall_mean"] = statistics.median(statistics.mean(w) for w in walls) if walls else None
    round_ms["slow_extra"] = (statistics.median(sum(x - median for x in w if x > 1.3 * median) / len(w) for w in walls)
                              if walls and median is not None else None)
    round_ms["run_share"] = sum(r.in_runs for r in runs) / len(parts) if parts else None
    return {"ms_per_token": statistics.median(per), "runs_ms_per_token": per, "token_ids": runs[0].tokens,
            "round_ms": round_ms}


def run_pipeline_bench(cfg: PipelineBenchConfig, log=print) -> dict:
    """Every measurement of the module doc -> the result dict (`table` prints it)."""
    from services.bench.gpu import hf_config, random_prompt
    from services.engine.engine import GenerationRequest
    from services.engine.local import build_local_engine
    from services.spec.tree import TreeParams

    top_k, depth, size = TREE
    tree = TreeParams(top_k, depth, size)
    name = torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else "cpu"
    res: dict = {"shape": cfg.shape, "device": name, "dtype": cfg.dtype, "prompt": cfg.prompt,
                 "tokens": cfg.tokens, "repeats": cfg.repeats, "tree": f"{size}/{depth}/{top_k}",
                 "interleave": cfg.interleave,
                 "torch": torch.__version__}
    prompt = random_prompt(hf_config(cfg.shape).vocab_size, cfg.prompt, 0)
    request = GenerationRequest(prompt, cfg.tokens, ignore_eos=True)
    root = Path(tempfile.mkdtemp(prefix="aerie-pipeline-bench-"))
    try:
        t0 = time.perf_counter()
        target_dir, head_dir = write_checkpoint(cfg.shape, cfg.device, cfg.dtype, root)
        res["checkpoint_s"] = round(time.perf_counter() - t0, 1)
        log(f"random {cfg.shape} checkpoint written in {res['checkpoint_s']} s")

        local = build_local_engine(str(target_dir), str(head_dir), cfg.dtype, tree, device=cfg.device)
        engine = local.engine
        res["in_process"] = {"plain": ms_per_token(lambda: engine.plain().generate(request), cfg.repeats),
                             "eagle": ms_per_token(lambda: engine.generate(request), cfg.repeats)}
        for label, r in res["in_process"].items():
            log(f"in process, {label}: {r['ms_per_token']:.2f} ms/token")
        del local, engine
        _free(cfg.device)

        res["pipeline"] = {}
        if cfg.interleave:  # every pipeline up at once, their requests in turn
            with ExitStack() as stack:
                sides = {}
                ups = {label: _up(cfg, label, target_dir, head_dir, root) for label in cfg.pipelines}
                for label, up in ups.items():
                    address = stack.enter_context(up)
                    sides[label] = lambda a=address: remote_stream(a, request)
                with profiling(cfg, "interleaved", {f"{label}-{role}": pid for label, up in ups.items()
                                                    for role, pid in up.pids.items()}) as prof:
                    res["pipeline"] = interleaved(sides, cfg.repeats)
                for label, up in ups.items():
                    res["pipeline"][label]["device_rounds"] = device_rounds(up)
                    if prof is not None:
                        res["pipeline"][label]["profile"] = {role: prof.summary[f"{label}-{role}"] for role in up.pids}
            for label, r in res["pipeline"].items():
                log(f"pipeline, {label}: {r['ms_per_token']:.2f} ms/token (interleaved)")
        for label in cfg.pipelines if not cfg.interleave else ():
            up = _up(cfg, label, target_dir, head_dir, root)
            with up as address:
                with profiling(cfg, label, up.pids) as prof:
                    res["pipeline"][label] = ms_per_token(lambda: remote_stream(address, request), cfg.repeats)
                res["pipeline"][label]["device_rounds"] = device_rounds(up)
                if prof is not None:
                    res["pipeline"][label]["profile"] = prof.summary
            log(f"pipeline, {label}: {res['pipeline'][label]['ms_per_token']:.2f} ms/token")
        base = {label: res["in_process"][PIPELINES[label][2]] for label in res["pipeline"]}
        res["ratio"] = {label: base[label]["ms_per_token"] / res["pipeline"][label]["ms_per_token"]
                        for label in res["pipeline"]}
        # greedy on both sides: the pipeline must give the in-process engine's tokens (reported, not raised)
        res["same_tokens"] = {label: base[label]["token_ids"] == res["pipeline"][label]["token_ids"]
                              for label in res["pipeline"]}
        res["complete"] = True
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _up(cfg: PipelineBenchConfig, label: str, target_dir: Path, head_dir: Path, root: Path) -> AerieUp:
    """The `aerie up` of pipeline `label` on the checkpoint."""
    draft, colocate, _, extra, env = PIPELINES[label]
    return AerieUp(cfg, target_dir, str(head_dir) if draft == "head" else draft, root / f"up-{label}.log",
                   colocate, extra, env)


def profiling(cfg: PipelineBenchConfig, label: str, pids: dict[str, int]) -> AbstractContextManager:
    """py-spy on `pids` while the block runs where `cfg.profile` asks (-> the ServiceProfiles, else None)."""
    if cfg.profile is None:
        return nullcontext()
    from services.bench.service_profile import ServiceProfiles

    return ServiceProfiles(Path(cfg.profile), label, pids)


def device_rounds(up: AerieUp) -> dict[str, float] | None:
    """The verifier's aerie_device_rounds_total by outcome (verifier_svc/device_round.py), from its
    /metrics; None when `aerie up` printed no verifier metrics URL."""
    url = up.metrics.get("verifier")
    if url is None:
        return None
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    counts = {"kept": 0.0, "dropped": 0.0}
    for m in re.finditer(r'^aerie_device_rounds_total\{[^}]*outcome="(\w+)"[^}]*\} ([0-9.e+-]+)$', text, re.M):
        counts[m.group(1)] = counts.get(m.group(1), 0.0) + float(m.group(2))
    return counts


def remote_stream(address: str, request) -> Iterator:
    """One generation through the coordinator at `address`: its RoundOutputs as they arrive."""
    from services.rpc.coordinator_client import RemoteSession

    session = RemoteSession(address, None, "", timeout_s=600)
    try:
        yield from session.engine.generate(request)
    finally:
        session.close()


class AerieUp:
    """`aerie up` on the checkpoint as a child process (its own session), stopped with SIGTERM on exit;
    entering waits for its "ready:" line and gives the coordinator's address. Its output goes to
    `log_path` (its tail is raised with a failure to start)."""

    def __init__(self, cfg: PipelineBenchConfig, target: Path, draft: str, log_path: Path,
                 colocate: bool = False, extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        top_k, depth, size = TREE
        self.argv = [sys.executable, "-m", "aerie_cli", "up", "--target", str(target), "--draft", draft,
                     "--dtype", cfg.dtype, "--device", cfg.device, "--port", "0", "--http-port", "0",
                     "--gateway", "coordinator", "--no-restart", "--startup-timeout-s", str(cfg.startup_timeout_s),
                     "--tree-top-k", str(top_k), "--tree-depth", str(depth), "--tree-tokens", str(size),
                     *(["--colocate"] if colocate else []), *extra]
        self.log_path, self.timeout_s = log_path, cfg.startup_timeout_s
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.metrics: dict[str, str] = {}  # role -> the /metrics URL of its first process (`aerie up`'s lines)
        self.pids: dict[str, int] = {}  # role -> the pid of its first process

    def __enter__(self) -> str:
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        deadline = time.monotonic() + self.timeout_s
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # `aerie up` prints where everything listens, then the ready line
            self.log.write(line)
            m = re.match(r"^(coordinator|verifier|drafter)\s+\S+ \(pid (\d+), metrics (\S+)\)", line)
            if m:
                self.metrics.setdefault(m.group(1), m.group(3))
                self.pids.setdefault(m.group(1), int(m.group(2)))
            if line.startswith(READY):
                return line[len(READY):].split()[0]
            if time.monotonic() > deadline:
                break
        self.log.flush()
        tail = self._tail()  # before the log closes
        self.__exit__(None, None, None)
        raise RuntimeError(f"`aerie up` did not become ready (exit code {self.proc.poll()}; {' '.join(self.argv)}):"
                           f"\n{tail}")

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # a request failed: what the services said
            print(f"`aerie up` ({' '.join(self.argv)}) log tail:\n{self._tail()}", file=sys.stderr, flush=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _tail(self, chars: int = 6000) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()[-chars:]


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def table(res: dict) -> str:
    """The result as a table: ms/token in process and through the pipeline, and their ratio."""
    rows = [("device", res["device"]), ("shape / dtype / prompt", f"{res['shape']} / {res['dtype']} / {res['prompt']}"),
            ("tokens a request, repeats", f"{res['tokens']}, {res['repeats']}"
             + ("; the pipelines up at once, their requests in turn" if res.get("interleave") else ""))]
    names = {"plain": "plain decoding", "eagle": f"EAGLE, tree {res['tree']} (a round a token)",
             "colocated": "EAGLE, verifier --draft (aerie up --colocate)",
             "colocated-host": "EAGLE, --colocate, AERIE_DEVICE_ROUND=0 (rounds on the host)",
             "direct": "EAGLE, direct drafts (aerie up --direct-drafts)"}
    for label, name in names.items():
        if label not in res.get("pipeline", {}) and label != "plain" and label != "eagle":
            continue  # (not measured in this run)
        inp = res.get("in_process", {}).get(PIPELINES[label][2], {}).get("ms_per_token")
        pipe = res.get("pipeline", {}).get(label, {}).get("ms_per_token")
        ratio = res.get("ratio", {}).get(label)
        same = res.get("same_tokens", {}).get(label)
        counted = res.get("pipeline", {}).get(label, {}).get("device_rounds") if PIPELINES[label][1] else None
        rows.append((f"{name}: ms/token in process, pipeline (in process / pipeline)",
                     f"{_ms(inp)}, {_ms(pipe)}" + (f" ({ratio:.2f}x)" if ratio is not None else "")
                     + ("" if same is None else "; same tokens" if same else "; TOKENS DIFFER")
                     + ("" if counted is None else
                        f"; device rounds kept {counted['kept']:.0f}, dropped {counted['dropped']:.0f}")))
    for side, label, name in (("in_process", "eagle", "in process"), ("pipeline", "eagle", "pipeline"),
                              ("pipeline", "colocated", "colocated"), ("pipeline", "colocated-host", "colocated, host"),
                              ("pipeline", "direct", "direct drafts")):
        r = res.get(side, {}).get(label, {}).get("round_ms")
        if r and r.get("wall") is not None:
            rows.append((f"  EAGLE round {name}: wall (draft + verify) ms",
                         f"{r['wall']:.2f} ({r['draft']:.2f} + {r['verify']:.2f})"
                         + (f"; mean {r['wall_mean']:.2f}, slow rounds' extra {r['slow_extra']:.2f} a round"
                            if r.get("wall_mean") is not None else "")
                         + (f"; {100 * r['run_share']:.0f}% from runs" if r.get("run_share") is not None else "")))
    from services.bench.service_profile import profile_rows

    for label, r in res.get("pipeline", {}).items():
        if r.get("profile"):
            rows.extend(profile_rows(label, r["profile"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
