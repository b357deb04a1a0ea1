"""The first run says what it is doing: cost calibration names what it measures and where it caches
it, a GGUF conversion announces its three phases; AERIE_PROGRESS=0 (and a non-terminal stderr
without AERIE_PROGRESS=1) keeps stderr quiet."""

from services.engine.calibration import head_costs, target_costs
from tests.model.test_gguf import TOKENS, write_llama_gguf
from tests.model.test_gguf import cache_dir  # noqa: F401 (fixture)


def test_calibration_announces_what_it_measures(llama_pair, tmp_path, monkeypatch, capsys):
    _, target, head = llama_pair
    monkeypatch.setenv("AERIE_COST_DIR", str(tmp_path))
    monkeypatch.setenv("AERIE_PROGRESS", "1")
    target_costs(target, "progress-test")
    head_costs(head, "progress-test")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"aerie: measuring the target's verify cost: its forward over 1..64 tree rows after a "
                      f"128-token prefix, fastest of 5 per row count once on this device for the draft budget "
                      f"(cached in {tmp_path}; --recalibrate measures again) ...")
    assert err[1].startswith("aerie: measuring the target's verify cost") and " done in " in err[1]
    assert err[2].startswith("aerie: measuring the draft head's cost: its layer and its vocabulary projection")
    assert len(err) == 4  # a non-terminal stderr gets no per-call counter
    target_costs(target, "progress-test")  # cached: nothing to announce
    assert capsys.readouterr().err == ""


def test_progress_off(llama_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AERIE_COST_DIR", str(tmp_path))
    monkeypatch.setenv("AERIE_PROGRESS", "0")
    target_costs(llama_pair[1], "progress-off")
    assert capsys.readouterr().err == ""


def test_gguf_conversion_announces_its_phases(tiny, tmp_path, cache_dir, monkeypatch, capsys):  # noqa: F811
    from services.model.loading import load_target

    monkeypatch.setenv("AERIE_PROGRESS", "1")
    load_target(str(write_llama_gguf(tiny.hf_model("llama_gqa", vocab_size=len(TOKENS)), tmp_path / "p.gguf")))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("aerie:")]
    assert lines[0].startswith(f"aerie: converting {tmp_path / 'p.gguf'} once into a Hugging Face directory")
    phases = [line.split("aerie:   ")[1] for line in lines[1:]]
    assert [p.split(" ", 1)[0] for p in phases] == ["[1/3]", "[1/3]", "[2/3]", "[2/3]", "[3/3]", "[3/3]"]
    assert all(" done in " in p for p in phases[1::2])


def test_a_second_process_waits_for_the_first_calibration(tmp_path, monkeypatch):
    """Two processes wanting the same calibration (`aerie up`'s verifier and drafter) measure one at a
    time: the second waits on the lock, then reads the first's result instead of measuring again."""
    import fcntl
    import hashlib
    import json
    import threading

    from services import progress
    from services.engine import calibration

    monkeypatch.setenv("AERIE_COST_DIR", str(tmp_path))
    monkeypatch.delenv("AERIE_RECALIBRATE", raising=False)
    key = "lock-test"
    path = tmp_path / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
    waiting = threading.Event()
    monkeypatch.setattr(progress, "note", lambda text: waiting.set() if text.startswith("waiting for") else None)
    measured = []
    result = {}
    with open(path.with_suffix(".lock"), "a") as held:  # the first process, mid-measurement
        fcntl.flock(held, fcntl.LOCK_EX)
        second = threading.Thread(target=lambda: result.update(
            costs=calibration.cached(key, lambda: measured.append(1) or {"v": 2}, what="x")))
        second.start()
        assert waiting.wait(60)  # the second found the lock taken and waits
        path.write_text(json.dumps({"key": key, "costs": {"v": 1}}))  # the first's result
        fcntl.flock(held, fcntl.LOCK_UN)
    second.join(60)
    assert result["costs"] == {"v": 1} and measured == []
