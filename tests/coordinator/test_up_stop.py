"""`aerie up` stops its processes in tiers, each tier at once, and kills what ignores SIGTERM.

Real processes (`sleep`); a process ignores SIGTERM because its disposition is set before exec, so
no test depends on when a child gets scheduled."""

import signal
import subprocess

from coordinator.redis_server import stop_processes
from coordinator.up import stop_services


def ignoring_sigterm() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "300"], preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))


def test_a_tier_is_terminated_at_once_and_what_ignores_sigterm_is_killed():
    polite, stubborn = subprocess.Popen(["sleep", "300"]), ignoring_sigterm()
    # the polite one first: it has the whole timeout to die of its SIGTERM, however loaded the machine
    assert stop_processes([polite, stubborn], timeout_s=2.0) == [-signal.SIGTERM, -signal.SIGKILL]
    assert stop_processes([polite]) == [-signal.SIGTERM]  # already stopped: its code again


class FakeService:
    """What stop_services reads of a Service: its role, name and process (the processes are real)."""

    def __init__(self, role: str, proc: subprocess.Popen) -> None:
        self.role, self.name, self.proc = role, role, proc


def test_services_stop_gateway_first_then_coordinators_then_the_pools(capsys):
    order: list[str] = []
    services = [FakeService(role, subprocess.Popen(["sleep", "300"]))
                for role in ("verifier", "drafter", "coordinator", "gateway")]
    for s in services:  # record the order in which each process is asked to stop
        s.proc.terminate = (lambda s=s, terminate=s.proc.terminate: (order.append(s.role), terminate()))
    services.append(FakeService("verifier-stubborn", ignoring_sigterm()))
    stop_services(services, timeout_s=2.0)  # type: ignore[arg-type]
    assert order == ["gateway", "coordinator", "verifier", "drafter"]
    assert all(s.proc.returncode is not None for s in services)
    err = capsys.readouterr().err
    assert f"verifier-stubborn (pid {services[-1].proc.pid}) did not stop within 2 s of SIGTERM: killed" in err
    assert "gateway" not in err
