"""τ with the cost-model budget (services/train/tau.py): a head's end-to-end acceptance in aerie's
engine, recorded in its report.json next to the teacher-forced agreement."""

import json

import pytest

from services.spec.cost import ZERO, CostCurve
from services.train import tau
from tests.helpers import save_bench_dirs

FLAT = CostCurve((1, 64), (0.010, 0.010))  # a target forward: 10 ms whatever its rows
SLOW = CostCurve((1, 64), (0.050, 0.050))  # a head step or projection: 50 ms


def synthetic_costs(monkeypatch, head: CostCurve) -> None:
    """The auto budget plans from these curves instead of a calibration timed on this machine (the
    calibration, and so what the budget chooses, would follow the CPU and its load)."""
    monkeypatch.setattr("services.engine.local.target_costs", lambda model, model_id, recalibrate=False: FLAT)
    monkeypatch.setattr("services.engine.local.head_costs", lambda h, head_id, recalibrate=False: (head, head))


@pytest.fixture(scope="module")
def dirs(llama_pair, tmp_path_factory):
    return save_bench_dirs(llama_pair, tmp_path_factory.mktemp("tau"))


def test_tau_of_a_distilled_head_through_the_engine_is_written_into_its_report(dirs, capsys, monkeypatch):
    synthetic_costs(monkeypatch, SLOW)
    (dirs / "head" / "report.json").write_text(json.dumps({"top1_agreement": 0.8, "kind": "eagle"}))
    code = tau.main(["--head", str(dirs / "head"), "--target", str(dirs / "target"), "--prompts",
                     str(dirs / "prompts.jsonl"), "--per-category", "1", "--max-new-tokens", "16", "--write"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    report = json.loads((dirs / "head" / "report.json").read_text())
    assert report["top1_agreement"] == 0.8 and report["kind"] == "eagle"  # the rest of the report is kept
    t = report["tau"]
    assert t == printed
    assert t["prompts"] == 2 and set(t["categories"]) == {"writing", "math"}
    assert t["exact_match"] == 1.0 and t["budget"].startswith("auto") and t["vs_plain"] > 0
    # a head step costs 5 target forwards, so the budget never drafts: every round commits one
    # token, and there is no drafted round to average over
    assert t["eagle_round_share"] == 0 and t["tau"] == pytest.approx(1.0) and t["tau_drafted"] is None


def test_tau_with_a_free_head_counts_the_drafted_rounds(dirs, monkeypatch):
    synthetic_costs(monkeypatch, ZERO)
    t = tau.measure(dirs / "head", dirs / "prompts.jsonl", str(dirs / "target"), per_category=0,
                    max_new_tokens=16)
    assert t["budget"].startswith("auto") and t["exact_match"] == 1.0
    # drafting costs nothing and every tree shape costs one forward: every round drafts
    assert t["eagle_round_share"] == 1.0 and t["tau"] == t["tau_drafted"] > 1.0


def test_tau_counts_the_tokens_each_drafted_round_commits(dirs):
    from services.spec.tree import TreeParams

    t = tau.measure(dirs / "head", dirs / "prompts.jsonl", str(dirs / "target"), per_category=0,
                    max_new_tokens=16, tree=TreeParams(top_k=4, depth=3, size=16))
    assert t["budget"] == "fixed 16/3/4" and t["prompts"] == 4 and t["exact_match"] == 1.0
    # every round verifies the fixed tree, and the head was distilled from this target: drafts land
    assert t["eagle_round_share"] == 1.0
    assert t["tau"] == t["tau_drafted"] > 1.5


def test_tau_rejects_a_non_positive_token_count(dirs):
    from services.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="max_new_tokens must be >= 1; got 0"):
        tau.measure(dirs / "head", dirs / "prompts.jsonl", str(dirs / "target"), max_new_tokens=0)
