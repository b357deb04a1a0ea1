"""A serving benchmark against any OpenAI-compatible server (aerie, vLLM, SGLang): streamed requests at a
request rate or a concurrency, timed from the client's side.

    config = ServeBenchConfig(base_url="http://127.0.0.1:8000", num_prompts=39, max_concurrency=4)
    result = asyncio.run(run(config, load_prompts(None)))    # a dict: table(), chart(), JSON

Per request, from the timestamps of the streamed SSE chunks (time.perf_counter() on arrival):
    ttft   send -> the first chunk that carries text (a role-only chunk does not count)
    itl    between consecutive chunks that carry text (aerie sends a round's tokens in one chunk, so
           its ITL is per round; vLLM's and SGLang's per token or per stream interval)
    tpot   (e2e - ttft) / (output tokens - 1): the mean time per output token after the first
    e2e    send -> the end of the stream
Output tokens are the server's `usage.completion_tokens` (stream_options.include_usage); a server
that sends no usage gets its text chunks counted instead (marked in the result).
Run totals: req/s and output tok/s over the wall time from the first send to the last completion;
mean, median and p99 of each latency. Acceptance comes from the server's Prometheus /metrics, read
before and after the run (the deltas of `aerie:spec_decode_*` or vLLM's `vllm:spec_decode_*`
counters): acceptance rate = accepted / draft tokens, mean accepted length = 1 + accepted / drafts.

Arrivals: `request_rate` requests/s as a Poisson process (seeded), inf = all at once; at most
`max_concurrency` in flight (None = unbounded). It knows nothing about aerie's internals.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.errors import InvalidRequest, Unreachable

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "serve.jsonl"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"  # the server's root (a trailing /v1 is dropped)
    endpoint: str = "/v1/chat/completions"
    model: str | None = None  # None: the first id of GET /v1/models
    num_prompts: int = 39  # requests sent; the prompt set is cycled when shorter
    request_rate: float = math.inf  # requests/s (Poisson arrivals); inf = all at once
    max_concurrency: int | None = None  # requests in flight at most; None = unbounded
    max_tokens: int = 128  # output tokens asked for per request
    ignore_eos: bool = False  # sent as `ignore_eos` (aerie, vLLM and SGLang read it): every output max_tokens long
    temperature: float = 0.0
    seed: int = 0  # arrival times and the order prompts are cycled in
    api_key: str | None = None  # sent as a bearer token
    metrics_url: str | None = None  # None: base_url + /metrics; "" = do not read acceptance
    extra_body: dict | None = None  # merged into every request body (server-specific parameters)
    timeout_s: float = 600.0  # per request

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise InvalidRequest(f"endpoint must be one of {ENDPOINTS}; got {self.endpoint!r}")
        if self.num_prompts < 1:
            raise InvalidRequest(f"num_prompts must be >= 1; got {self.num_prompts}")
        if not self.request_rate > 0:
            raise InvalidRequest(f"request_rate must be > 0 (inf = all at once); got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidRequest(f"max_concurrency must be >= 1 (or unset); got {self.max_concurrency}")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1; got {self.max_tokens}")
        if not self.base_url.startswith(("http://", "https://")):
            raise InvalidRequest(f"base_url must start with http:// or https://; got {self.base_url!r}")

    @property
    def root(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")


@dataclass(slots=True)
class RequestResult:
    prompt_index: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # [text chunks - 1]
    output_tokens: int = 0
    input_tokens: int | None = None  # usage.prompt_tokens when the server sends usage
    usage: bool = False  # output_tokens came from the server's usage (else: text chunks counted)
    chunks: int = 0  # streamed chunks that carried text
    text: str = ""  # the streamed text, joined

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def load_prompts(path: str | Path | None) -> list[str]:
    """Prompts of a JSONL file: Spec-Bench's {"turns": [...]} (the first turn) or {"prompt": "..."};
    None = the shipped set (services/bench/prompts/serve.jsonl)."""
    p = Path(path) if path is not None else DEFAULT_PROMPTS
    if not p.is_file():
        raise InvalidRequest(f"prompt file {p} does not exist")
    prompts = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["turns"][0] if "turns" in row else row["prompt"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise InvalidRequest(f"{p} line {n}: expected a JSON object with \"turns\" or \"prompt\"") from None
        if not isinstance(text, str) or not text:
            raise InvalidRequest(f"{p} line {n}: the prompt must be a non-empty string")
        prompts.append(text)
    if not prompts:
        raise InvalidRequest(f"prompt file {p} holds no prompts")
    return prompts


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each of n requests: exponential gaps of mean 1/rate (0 for the first
    and everywhere when rate is inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, median, p99 (linear interpolation, numpy's default) of `values` times `scale` (ms)."""
    if not values:
        return {"mean": None, "median": None, "p99": None}
    xs = sorted(v * scale for v in values)

    def q(p: float) -> float:
        k = (len(xs) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"mean": sum(xs) / len(xs), "median": q(0.5), "p99": q(0.99)}


def parse_spec_counters(text: str) -> dict[str, float]:
    """The spec-decode counters of a Prometheus scrape, summed over labels: aerie's `aerie:` names
    or vLLM's `vllm:` ones; the ones absent are left out (a labelled counter has no sample before its
    first increment, and a server without speculation exports none)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        prefix, _, base = name.partition(":")
        base = base.removesuffix("_total")
        if prefix in ("aerie", "vllm") and base in SPEC_COUNTERS:
            out[base] = out.get(base, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _one(client, config: ServeBenchConfig, model: str, prompt: str, index: int) -> RequestResult:
    res = RequestResult(index)
    body: dict = {"model": model, "max_tokens": config.max_tokens, "temperature": config.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    chat = config.endpoint.endswith("/chat/completions")
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body or {})
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", config.root + config.endpoint, json=body, timeout=config.timeout_s) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if msg.get("usage"):
                    res.output_tokens = int(msg["usage"]["completion_tokens"])
                    res.input_tokens = int(msg["usage"]["prompt_tokens"])
                    res.usage = True
                choices = msg.get("choices") or []
                text = (choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")) if choices else None
                if text:
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.chunks += 1
                    res.text += text
        res.e2e_s = time.perf_counter() - t0
    except Exception as e:  # a broken stream is one failed request, not the end of the run
        res.error = f"{type(e).__name__}: {e}"
        return res
    if not res.usage:
        res.output_tokens = res.chunks
    res.ok = res.ttft_s is not None
    if not res.ok:
        res.error = "the stream carried no text"
    return res


async def _scrape(client, url: str) -> dict[str, float] | None:
    """The spec counters at `url`; None when it does not answer 200."""
    try:
        r = await client.get(url, timeout=30)
    except Exception:
        return None
    return parse_spec_counters(r.text) if r.status_code == 200 else None


async def first_model(client, config: ServeBenchConfig) -> str:
    import httpx

    try:
        r = await client.get(config.root + "/v1/models", timeout=30)
    except httpx.TransportError as e:
        raise Unreachable(f"cannot reach {config.root}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise InvalidRequest(f"GET {config.root}/v1/models answered {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    if not data:
        raise InvalidRequest(f"{config.root}/v1/models lists no model: pass --model")
    return data[0]["id"]


async def run(config: ServeBenchConfig, prompts: list[str]) -> dict:
    """Send config.num_prompts streamed requests; returns the result dict (summarize's)."""
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency or config.num_prompts)
    async with httpx.AsyncClient(headers=headers, limits=limits, trust_env=False) as client:
        model = config.model or await first_model(client, config)
        metrics_url = config.root + "/metrics" if config.metrics_url is None else config.metrics_url
        before = await _scrape(client, metrics_url) if metrics_url else None
        order = list(range(len(prompts)))
        random.Random(config.seed).shuffle(order)
        gate = asyncio.Semaphore(config.max_concurrency or config.num_prompts)

        async def limited(i: int) -> RequestResult:
            async with gate:
                return await _one(client, config, model, prompts[order[i % len(order)]], order[i % len(order)])

        tasks = []
        t0 = time.perf_counter()
        for i, gap in enumerate(arrival_gaps(config.num_prompts, config.request_rate, config.seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = await _scrape(client, metrics_url) if before is not None else None
    if all(not r.ok for r in results) and results[0].error and "Connect" in results[0].error:
        raise Unreachable(f"cannot reach {config.root}: {results[0].error}")
    return summarize(config, model, results, duration, before, after)


def summarize(config: ServeBenchConfig, model: str, results: list[RequestResult], duration_s: float,
              before: dict | None, after: dict | None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    acceptance = None
    if before is not None and after is not None and set(after) == set(SPEC_COUNTERS):
        d = {k: after[k] - before.get(k, 0.0) for k in SPEC_COUNTERS}  # absent before: no increment yet
        drafts, offered, accepted = (d[k] for k in SPEC_COUNTERS)
        acceptance = {"drafts": drafts, "draft_tokens": offered, "accepted_tokens": accepted,
                      "acceptance_rate": accepted / offered if offered else None,
                      "mean_accept_length": 1 + accepted / drafts if drafts else None}
    cfg = asdict(config)
    cfg.pop("api_key")
    cfg["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate  # JSON has no inf
    return {
        "config": cfg, "model": model, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "total_output_tokens": out_tokens,
        "total_input_tokens": sum(r.input_tokens or 0 for r in ok),
        "output_tokens_from": "usage" if ok and all(r.usage for r in ok) else "text chunks",
        "ttft_ms": percentiles([r.ttft_s for r in ok]),
        "tpot_ms": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_ms": percentiles([r.e2e_s for r in ok]),
        "acceptance": acceptance,
        "requests": [{"prompt_index": r.prompt_index, "ok": r.ok, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                      "itl_s": r.itl_s, "chunks": r.chunks, "output_tokens": r.output_tokens,
                      "input_tokens": r.input_tokens, "text": r.text, "error": r.error} for r in results],
    }


def machine_name() -> str:
    """This machine's CPU model and core count (the title of a chart)."""
    from services.engine.calibration import device_name

    return device_name("cpu")
