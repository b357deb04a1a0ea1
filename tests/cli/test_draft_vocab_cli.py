"""`aerie draft-vocab` counts the target's tokenization of a corpus (text files and self-distillation
shards), and `aerie generate --draft-vocab K --draft-dtype D` stays equal to transformers greedy."""

import json

import pytest
import torch
from safetensors.torch import save_file

from aerie_cli.main import main
from services.model.draft_vocab import COUNTS_FILE, load_counts
from services.model.head_checkpoint import save_head
from tests.helpers import VOCAB, hf_greedy, save_tiny_tokenizer, tiny_text

PROMPT = [5, 17, 99, 3, 42, 8]


@pytest.fixture(scope="module")
def dirs(llama_pair, tmp_path_factory):
    hf, _, head = llama_pair
    root = tmp_path_factory.mktemp("dv")
    hf.save_pretrained(root / "target")
    save_tiny_tokenizer(root / "target")
    save_head(head, root / "head", "bin")
    return root, hf


def test_counts_from_text_and_shards(dirs, capsys):
    root, _ = dirs
    (root / "a.txt").write_text(tiny_text(1, 300))
    (root / "b.txt").write_text("t5 t5 t5 t7")
    save_file({"next": torch.tensor([-1, -1, 9, 9, 5], dtype=torch.int32)}, str(root / "shard.safetensors"))
    out = root / "head" / COUNTS_FILE
    code = main(["draft-vocab", "--from", str(root / "a.txt"), str(root / "b.txt"), str(root / "shard.safetensors"),
                 "--out", str(out), "--target", str(root / "target")])
    report = json.loads(capsys.readouterr().out)
    from transformers import AutoTokenizer
    a_ids = AutoTokenizer.from_pretrained(str(root / "target")).encode(tiny_text(1, 300), add_special_tokens=False)
    assert code == 0 and report["tokens"] == len(a_ids) + 4 + 3
    expected = torch.bincount(torch.tensor(a_ids), minlength=VOCAB)
    expected[5] += 3  # b.txt
    expected[7] += 1
    expected[9] += 2  # the shard's answer tokens (-1 = prompt rows, not counted)
    expected[5] += 1
    assert torch.equal(load_counts(root / "head", VOCAB), expected)


@pytest.mark.parametrize("argv, message", [
    (["--from", "nope.txt"], "nope.txt does not exist"),
    (["--from", "{root}/b.txt", "--out", "{root}/counts.bin"], "token_counts.safetensors"),
])
def test_draft_vocab_bad_input(dirs, capsys, argv, message):
    root, _ = dirs
    (root / "b.txt").write_text("t5 t6")
    argv = [a.format(root=root) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(root / "x" / COUNTS_FILE)]
    code = main(["draft-vocab", *argv, "--target", str(root / "target")])
    err = capsys.readouterr().err
    assert code == 2 and message in err


@pytest.mark.parametrize("k, dtype", [(16, "fp32"), (0, "int8"), (32, "bf16")])
def test_generate_with_reduced_vocab_and_draft_dtype_is_lossless(dirs, capsys, k, dtype):
    root, hf = dirs
    counts = torch.arange(VOCAB).flip(0) * 3
    from services.model.draft_vocab import save_counts
    save_counts(root / "head", counts)
    code = main(["generate", "--target", str(root / "target"), "--draft", str(root / "head"),
                 "--draft-vocab", str(k), "--draft-dtype", dtype, "--prompt-ids", ",".join(map(str, PROMPT)),
                 "--max-new-tokens", "24", "--ignore-eos", "--tree-tokens", "8", "--tree-depth", "3", "--tree-top-k", "2", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["tokens"] == hf_greedy(hf, PROMPT, 24)
