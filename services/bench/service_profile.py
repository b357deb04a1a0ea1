"""Where the service processes' threads spend a benchmark's time: py-spy samples, summarised per thread.

    with ServiceProfiles(Path("out/profile"), "colocated", {"verifier": 4242, "coordinator": 4240}) as prof:
        ...  # the requests
    prof.summary   # {"verifier": {"seconds": 21.3, "threads": {"MainThread": {...}, ...}}, ...}

Two py-spy samplers attach to each process (`py-spy record --threads --nonblocking`, RATE samples a
second, the process never stopped): one samples every thread that is on a CPU, the other (`--gil`)
the thread holding the interpreter lock. Each writes its raw stacks (`{label}-{role}.raw`,
`{label}-{role}-gil.raw`: flamegraph.pl or speedscope read them). Per thread the summary gives
`samples` (on a CPU or in Python code), `active` (those not parked in a known wait: a lock, a
condition, a selector, a queue), `gil` (holding the interpreter lock), their `*_share` of the
window (samples / (seconds x RATE)), and where each goes (`top`, `top_gil`: `where`, aerie's two
innermost frames of a stack, or the leaf in aerie's innermost frame where the leaf is not aerie's). A thread far more `active` than `gil` is in native code that
released the lock (torch's kernels, a gRPC call) or waiting to take it; two threads of one process
whose `gil` shares add up to near 1 contend for it (what the ninth session's H200 run suspected of
the colocated verifier: docs/gpu.md). `py-spy` comes from PATH or this interpreter's directory
(`pip install py-spy`; scripts/gpu_wheels.sh carries its wheel to a GPU machine). Used by
`aerie bench --shape S --pipeline --profile DIR` (services/bench/pipeline_shape.py).
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.errors import InvalidRequest

RATE = 200  # samples a second, per sampler
TOP = 12  # frames listed per thread
REPO = str(Path(__file__).resolve().parents[2]) + "/"
PACKAGES = ("services/", "verifier_svc/", "drafter_svc/", "coordinator/", "gateway/", "aerie_cli/")
# leaves of a thread that waits (threading, selectors, queues, futures, gRPC's poller)
WAITS = re.compile(r"^(wait|_wait_for_tstate_lock|select|poll|epoll|_worker|_poll_wrapper|acquire|sleep|"
                   r"Condition\.wait|Event\.wait|Thread\.run|EpollSelector\.select|_PollLikeSelector\.select|"
                   r"SimpleQueue\.get|Queue\.get) ")


def find_py_spy() -> str:
    """The py-spy executable, or InvalidRequest saying how to get it."""
    beside = Path(sys.executable).parent / "py-spy"  # (a virtual environment's, not on PATH)
    found = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
    if found is None:
        raise InvalidRequest("--profile needs py-spy (pip install py-spy; on a GPU machine without a network "
                             "scripts/gpu_wheels.sh carries its wheel in .whl/)")
    return found


def thread_name(frame: str) -> str:
    """py-spy's thread frame 'thread (0x7f..): name' or 'thread (1234): name' -> name."""
    return frame.split("): ", 1)[1] if "): " in frame else frame


def ours(frame: str) -> bool:
    """Whether a py-spy frame 'function (path:line)' is in aerie's code (its path absolute under the
    checkout, or relative to it: a process started there with `python -m`)."""
    path = frame.rpartition(" (")[2].removeprefix(REPO)
    return path.startswith(PACKAGES)


def where(frames: list[str]) -> str:
    """A stack's place: aerie's two innermost frames ("inner < outer") where the leaf is aerie's, else
    the leaf and aerie's innermost frame ("leaf in inner"; an event loop's own work shows as its
    `run_until_complete` caller)."""
    mine = [f.replace(REPO, "") for f in frames if ours(f)]
    if frames and mine and ours(frames[-1]):
        return " < ".join(mine[-2:][::-1])
    leaf = frames[-1] if frames else "(native)"
    return f"{leaf} in {mine[-1]}" if mine else leaf


def read_raw(path: Path) -> dict[str, tuple[int, int, collections.Counter]]:
    """py-spy's raw output ('thread;frame;...;leaf count' lines) -> thread name -> (samples, active
    samples, Counter of where the active ones were)."""
    out: dict[str, list] = {}
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        n = int(count)
        entry = out.setdefault(thread_name(frames[0]), [0, 0, collections.Counter()])
        entry[0] += n
        body = frames[1:]
        if body and WAITS.match(body[-1]):
            continue
        entry[1] += n
        entry[2][where(body) if body else "(native)"] += n
    return {name: (s, a, c) for name, (s, a, c) in out.items()}


def summarize(all_raw: Path, gil_raw: Path, seconds: float) -> dict:
    """One process's threads from its two samplers' files, over a window of `seconds`."""
    window = max(seconds * RATE, 1.0)
    every, held = read_raw(all_raw), read_raw(gil_raw)
    threads = {}
    for name in sorted(set(every) | set(held), key=lambda n: -(every.get(n, (0, 0))[1])):
        samples, active, tops = every.get(name, (0, 0, collections.Counter()))
        _, gil, gil_tops = held.get(name, (0, 0, collections.Counter()))
        threads[name] = {"samples": samples, "active": active, "gil": gil,
                         "active_share": round(active / window, 3), "gil_share": round(gil / window, 3),
                         "top": tops.most_common(TOP), "top_gil": gil_tops.most_common(TOP)}
    return {"seconds": round(seconds, 2), "rate": RATE, "threads": threads}


class ServiceProfiles:
    """py-spy on each of `pids` (role -> pid) while the block runs; `summary` after it (role ->
    `summarize`, or {"error": ...} where a sampler could not attach)."""

    def __init__(self, out_dir: Path, label: str, pids: dict[str, int]) -> None:
        self.out_dir, self.label, self.pids = Path(out_dir), label, pids
        self.py_spy = find_py_spy()
        self.procs: list[tuple[str, Path, Path, subprocess.Popen, subprocess.Popen]] = []
        self.summary: dict = {}

    def __enter__(self) -> ServiceProfiles:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for role, pid in self.pids.items():
            base = self.out_dir / f"{self.label}-{role}"
            every, held = base.with_suffix(".raw"), Path(f"{base}-gil.raw")
            log = open(base.with_suffix(".py-spy.log"), "w")
            common = [self.py_spy, "record", "-p", str(pid), "--threads", "--nonblocking", "--format", "raw",
                      "-r", str(RATE)]
            self.procs.append((role, every, held,
                               subprocess.Popen([*common, "-o", str(every)], stdout=log, stderr=log),
                               subprocess.Popen([*common, "--gil", "-o", str(held)], stdout=log, stderr=log)))
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self.t0
        for _, _, _, a, b in self.procs:
            for p in (a, b):
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
        for role, every, held, a, b in self.procs:
            for p in (a, b):
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if not every.exists():
                log = self.out_dir / f"{self.label}-{role}.py-spy.log"
                self.summary[role] = {"error": f"py-spy wrote no samples (see {log}): "
                                               f"{log.read_text()[-300:].strip() if log.exists() else ''}"}
                continue
            self.summary[role] = summarize(every, held, seconds)


def profile_rows(label: str, summary: dict, threads: int = 3) -> list[tuple[str, str]]:
    """Table rows: each role's busiest threads, their active and GIL shares, and where the active
    time went most."""
    rows = []
    for role, s in summary.items():
        if "error" in s:
            rows.append((f"  profile {label}, {role}", s["error"]))
            continue
        for name, t in list(s["threads"].items())[:threads]:
            top = t["top"][0][0] if t["top"] else "-"
            rows.append((f"  profile {label}, {role}, {name}: active, GIL share",
                         f"{t['active_share']:.2f}, {t['gil_share']:.2f} (most: {top})"))
    return rows
