"""τ with the cost-model budget (services/train/tau.py): a head's end-to-end acceptance in aerie's
engine, recorded in its report.json next to the teacher-forced agreement."""

import json

import pytest

from services.train import tau
from tests.helpers import save_bench_dirs


@pytest.fixture(scope="module")
def dirs(llama_pair, tmp_path_factory):
    return save_bench_dirs(llama_pair, tmp_path_factory.mktemp("tau"))


def test_tau_of_a_distilled_head_through_the_engine_is_written_into_its_report(dirs, capsys):
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
    # on a 2-layer target a head step costs about what a target forward does, so the budget never
    # drafts: every round commits one token, and there is no drafted round to average over
    assert t["eagle_round_share"] == 0 and t["tau"] == pytest.approx(1.0) and t["tau_drafted"] is None


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
