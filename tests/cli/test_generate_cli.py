"""`aerie generate`: JSON output equals transformers greedy in fp32, and every bad input ends with
exit code 2 and one line naming the offending value."""

import json
import subprocess
import sys

import pytest

from aerie_cli.main import main
from services.model.head_checkpoint import save_head
from tests.helpers import hf_greedy

PROMPT = [5, 17, 99, 3, 42, 8]


@pytest.fixture(scope="module")
def dirs(llama_pair, tmp_path_factory):
    hf, _, head = llama_pair
    root = tmp_path_factory.mktemp("cli")
    hf.save_pretrained(root / "target")
    save_head(head, root / "head", "bin")
    return root / "target", root / "head", hf


def run_cli(capsys, *argv):
    code = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_equals_transformers_greedy(dirs, capsys):
    target, head, hf = dirs
    code, out, err = run_cli(capsys, "--target", target, "--draft", head, "--dtype", "fp32",
                             "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 32,
                             "--tree-tokens", 16, "--tree-depth", 3, "--tree-top-k", 4, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["tokens"] == hf_greedy(hf, PROMPT, 32)
    assert res["text"] is None  # the tiny target has no tokenizer
    assert res["rounds"] == len(res["accept_lengths"]) > 0
    assert max(res["accept_lengths"]) > 1
    # tokens: 1 from the prefill, then each round's accepted tokens + bonus, cut at max_new_tokens
    assert 1 + sum(res["accept_lengths"]) >= 32 > 1 + sum(res["accept_lengths"][:-1])
    assert res["tree"] == {"mode": "fixed", "top_k": 4, "depth": 3, "tokens": 16, "mean_tokens": 16.0}
    assert {"prefill_s", "total_s", "draft_s", "verify_s", "tokens_per_s"} <= set(res["timings"])


@pytest.mark.parametrize("draft", ["{head}", "{head}+sam", "sam"])
def test_auto_budget_and_retrieval_from_the_cli(dirs, capsys, draft):
    """No --tree-* flag: the auto budget; `DIR+sam` / `sam`: retrieval joins / replaces the head."""
    target, head, hf = dirs
    code, out, err = run_cli(capsys, "--target", target, "--draft", draft.format(head=head), "--dtype", "fp32",
                             "--prompt-ids", ",".join(map(str, PROMPT * 2)), "--max-new-tokens", 32, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["tokens"] == hf_greedy(hf, list(PROMPT * 2), 32)
    if res["tree"] is not None:
        assert res["tree"]["mode"] == "auto" and "top_k" not in res["tree"]


def test_tau_is_tokens_per_target_forward(dirs, capsys, monkeypatch):
    """tau checked against counted target forwards: a run cut at a round boundary generates
    1 (prefill) + tau * forwards tokens."""
    from services.engine.verifier import Verifier

    target, head, _ = dirs
    argv = ["--target", target, "--draft", head, "--prompt-ids", ",".join(map(str, PROMPT)),
            "--tree-tokens", 16, "--tree-depth", 3, "--tree-top-k", 4, "--json"]
    full = json.loads(run_cli(capsys, *argv, "--max-new-tokens", 64)[1])
    k = len(full["accept_lengths"]) // 2
    cut = 1 + sum(full["accept_lengths"][:k])  # ends exactly after round k
    forwards = []
    verify = Verifier.verify
    monkeypatch.setattr(Verifier, "verify", lambda self, *a, **kw: forwards.append(1) or verify(self, *a, **kw))
    res = json.loads(run_cli(capsys, *argv, "--max-new-tokens", cut)[1])
    assert len(res["tokens"]) == cut and len(forwards) == k > 1
    assert res["tau"] == (cut - 1) / len(forwards) > 1


def test_draft_none_is_the_plain_baseline(dirs, capsys):
    target, _, hf = dirs
    code, out, _ = run_cli(capsys, "--target", target, "--draft", "none", "--dtype", "fp32",
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 20, "--json")
    res = json.loads(out)
    assert code == 0 and res["tokens"] == hf_greedy(hf, PROMPT, 20)
    assert res["accept_lengths"] == [1] * 19 and res["draft"] is None


def test_seeded_sampling_is_reproducible(dirs, capsys):
    target, head, _ = dirs
    args = ["--target", target, "--draft", head, "--prompt-ids", "1,2,3", "--max-new-tokens", 24,
            "--temperature", 0.9, "--top-p", 0.95, "--json"]
    runs = [json.loads(run_cli(capsys, *args, "--seed", s)[1])["tokens"] for s in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


BAD = [
    (["--prompt-ids", ""], "prompt is empty"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1,128"], "prompt token id 128 at position 1 is outside the vocabulary [0, 128)"),
    (["--prompt-ids", "-3"], "prompt token id -3"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "max_new_tokens must be >= 1; got 0"),
    (["--prompt-ids", "1", "--max-new-tokens", "600"], "exceeds the model context of 512"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature must be >= 0; got -1.0"),
    (["--prompt-ids", "1", "--temperature", "1", "--top-p", "1.5"], "top_p must be in (0, 1]; got 1.5"),
    (["--prompt-ids", "1", "--top-p", "0"], "top_p must be in (0, 1]; got 0.0"),
    (["--prompt-ids", "1", "--tree-tokens", "200", "--tree-depth", "2", "--tree-top-k", "3"],
     "size=200 needs more than the 21 candidates"),
    (["--prompt-ids", "1", "--tree-top-k", "0"], "top_k must be >= 1 (--tree-top-k); got 0"),
    (["--prompt-ids", "1", "--tree-top-k", "200", "--tree-tokens", "20"],
     "top_k=200 (--tree-top-k) exceeds the draft vocabulary (128)"),
    (["--prompt", "hello"], "has no tokenizer"),
    (["--prompt-ids", "1", "--stop-token-ids", "999"], "stop token id 999"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_is_one_line_and_exit_2(dirs, capsys, argv, message):
    target, head, _ = dirs
    code, out, err = run_cli(capsys, "--target", target, "--draft", head, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("aerie: error: ")
    assert message in err, err


def test_missing_checkpoints(dirs, capsys, tmp_path):
    target, head, _ = dirs
    code, _, err = run_cli(capsys, "--target", tmp_path / "nope", "--prompt-ids", "1")
    assert code == 3 and "does not exist" in err and err.count("\n") == 1  # exit code 3: model unavailable
    code, _, err = run_cli(capsys, "--target", target, "--draft", tmp_path, "--prompt-ids", "1")
    assert code == 2 and "no config.json" in err


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
def test_console_script_exit_code(dirs):
    target, _, _ = dirs
    proc = subprocess.run([sys.executable, "-m", "aerie_cli", "generate", "--target", str(target),
                           "--draft", "none", "--prompt-ids", "1,999"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "aerie: error: prompt token id 999 at position 1 is outside the vocabulary [0, 128)"]


def test_bf16_generation_end_to_end(dirs, capsys):
    """--dtype bf16 loads bf16 weights and generates with speculation; on this peaked tiny model the
    greedy output is the same as transformers' fp32 greedy (bf16 is not token-exact in general)."""
    import torch

    from services.engine.local import build_local_engine

    target, head, hf = dirs
    assert build_local_engine(str(target), str(head), "bf16").engine.verifier.target.dtype == torch.bfloat16
    code, out, err = run_cli(capsys, "--target", target, "--draft", head, "--dtype", "bf16",
                             "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 32, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["dtype"] == "bf16" and res["finish_reason"] == "length"
    assert res["tokens"] == hf_greedy(hf, PROMPT, 32)
    assert max(res["accept_lengths"]) > 1  # the bf16 head drafts
