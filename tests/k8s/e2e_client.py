"""The client side of scripts/k8s_e2e.sh: requests through the installed chart's HTTP API.

    python tests/k8s/e2e_client.py chat       one chat completion == `aerie generate` (same prompt, greedy)
    python tests/k8s/e2e_client.py failover   a streamed chat; the drafter holding the sequence is killed
                                              (docker kill of its container) as soon as one reports it; the
                                              stream still completes, equal to `aerie generate`

Environment (set by the script): AERIE_E2E_BASE_URL (https://127.0.0.1:PORT/v1, a kubectl port-forward to
the coordinator), AERIE_E2E_CA (the release's ca.crt), AERIE_E2E_TOKEN_FILE (the "default" API token),
AERIE_E2E_STATE (cache of the local references), AERIE_E2E_NS / AERIE_E2E_RELEASE (failover), DOCKER_HOST.
Exits 0 on success; any mismatch raises. Only 127.0.0.1 and pod IPs on docker0 are contacted.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import openai

QUESTION = "What is the capital of France?"
STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."
FAILOVER_TOKENS = 300


def client() -> openai.OpenAI:
    token = Path(os.environ["AERIE_E2E_TOKEN_FILE"]).read_text().strip()
    return openai.OpenAI(base_url=os.environ["AERIE_E2E_BASE_URL"], api_key=token, max_retries=0,
                         http_client=httpx.Client(verify=os.environ["AERIE_E2E_CA"], timeout=600))


def reference(prompt: str, max_new_tokens: int) -> dict:
    """`aerie generate` in a local process (the default model, fp32, greedy); cached under the state dir."""
    key = hashlib.sha256(f"{prompt}\0{max_new_tokens}".encode()).hexdigest()[:16]
    path = Path(os.environ["AERIE_E2E_STATE"]) / f"reference-{key}.json"
    if not path.exists():
        out = subprocess.run([sys.executable, "-m", "aerie_cli", "generate", "--prompt", prompt, "--max-new-tokens",
                              str(max_new_tokens), "--dtype", "fp32", "--json"],
                             check=True, capture_output=True, text=True).stdout
        path.write_text(out)
    return json.loads(path.read_text())


def served_model(c: openai.OpenAI, tries: int = 120) -> str:
    """The served model's id, once the coordinator answers /v1/models. A coordinator is Ready once it
    reaches Redis, which can be a few seconds before its first verifier joined the pool: /v1/models then
    answers 504 (seen on the real cluster), so it is asked again, once a second, `tries` times."""
    for i in range(tries):
        try:
            [model] = c.models.list().data
            if i:
                print(f"/v1/models answered after {i} retries", flush=True)
            return model.id
        except openai.InternalServerError:
            if i == tries - 1:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


def chat() -> None:
    c = client()
    model_id = served_model(c)
    r = c.chat.completions.create(model=model_id, messages=[{"role": "user", "content": QUESTION}],
                                  max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    local = reference(QUESTION, 12)
    print(f"chat: {text!r} (aerie generate: {local['text']!r})", flush=True)
    if text != local["text"] or r.usage.completion_tokens != len(local["tokens"]):
        raise SystemExit(f"chat through the chart differs from aerie generate: {text!r} != {local['text']!r}")


def kubectl(*args: str) -> str:
    ns = os.environ.get("AERIE_E2E_NS", "default")
    return subprocess.run(["kubectl", "-n", ns, *args], check=True, capture_output=True, text=True).stdout


def drafters(component: str = "drafter") -> list[tuple[str, str]]:
    """(pod name, pod IP) of every running pod of a component of the release."""
    sel = f"app.kubernetes.io/instance={os.environ.get('AERIE_E2E_RELEASE', 'aerie')},app.kubernetes.io/component={component}"
    out = kubectl("get", "pods", "-l", sel, "-o", "go-template={{range .items}}{{.metadata.name}} {{.status.podIP}}\n{{end}}")
    return [tuple(line.split()) for line in out.splitlines() if len(line.split()) == 2]


def metric(ip: str, prefix: str) -> float:
    """The sample starting with `prefix` on one pod's metrics port (plain HTTP), 0 when absent."""
    with urllib.request.urlopen(f"http://{ip}:9090/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(prefix):
                return float(line.split()[-1])
    return 0.0


def sequences_in_flight(ip: str) -> float:
    return metric(ip, 'aerie_sequences_in_flight{service="drafter"}')


def drafter_failovers() -> float:
    """aerie_failovers_total for drafters, every reason, summed over the coordinator pods: a killed
    container restarts in the same pod (same IP), so the next call finds it down ("unavailable") or
    already back without the sequence ("not_found") — a race the test does not choose."""
    total = 0.0
    for _, ip in drafters("coordinator"):
        with urllib.request.urlopen(f"http://{ip}:9090/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("aerie_failovers_total{") and 'role="drafter"' in line:
                    total += float(line.split()[-1])
    return total


def kill_container(pod: str) -> None:
    ids = subprocess.run(["docker", "ps", "-q", "--filter", f"label=io.kubernetes.pod.name={pod}",
                          "--filter", "label=io.kubernetes.container.name=drafter"],
                         check=True, capture_output=True, text=True).stdout.split()
    if not ids:
        raise SystemExit(f"no running drafter container in pod {pod}")
    subprocess.run(["docker", "kill", *ids], check=True, capture_output=True)


def failover() -> None:
    local = reference(STORY, FAILOVER_TOKENS)
    c = client()
    model_id = served_model(c)
    failovers = drafter_failovers()
    stream = c.chat.completions.create(model=model_id, messages=[{"role": "user", "content": STORY}],
                                       max_tokens=FAILOVER_TOKENS, temperature=0, stream=True)
    parts: list[str] = []
    killed_after = None
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        parts.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
        if killed_after is None:  # kill the drafter that holds this sequence's draft KV, once it holds it
            holding = [pod for pod, ip in drafters() if sequences_in_flight(ip) > 0]
            if holding:
                kill_container(holding[0])
                killed_after = len("".join(parts))
                print(f"failover: killed drafter {holding[0]} (holding the sequence) after {killed_after} characters",
                      flush=True)
    text = "".join(parts)
    print(f"failover: stream finished ({finish}), {len(text)} characters, {len(text) - (killed_after or 0)} after the kill",
          flush=True)
    if killed_after is None:
        raise SystemExit("no drafter reported holding the sequence (aerie_sequences_in_flight) while it streamed")
    if killed_after >= len(text):
        raise SystemExit("the stream ended before the drafter was killed: nothing was failed over")
    moved = drafter_failovers() - failovers
    print(f"failover: the coordinator counted {moved:.0f} drafter fail-over(s)", flush=True)
    if moved < 1:
        raise SystemExit("the coordinator counted no drafter fail-over (aerie_failovers_total)")
    if text != local["text"]:
        raise SystemExit(f"the failed-over stream differs from aerie generate:\n{text!r}\n!=\n{local['text']!r}")


if __name__ == "__main__":
    {"chat": chat, "failover": failover}[sys.argv[1]]()
