"""Hugging Face Hub ids as model names: resolved from a cache laid out as huggingface_hub writes it
(HF_HUB_CACHE, HF_HUB_OFFLINE=1: never the network), for targets and draft heads, with revisions;
a model that cannot be had exits with code 3 and one line saying why."""

import json

import pytest

from aerie_cli.main import main
from services.errors import ModelUnavailable
from services.model.head_checkpoint import save_head
from services.model.hub import parse_hub_id, resolve_model
from tests.helpers import hf_greedy
from tests.hub_cache import add_to_hub_cache

PROMPT = "5,17,99,3,42,8"
REV1, REV2 = "1" * 40, "2" * 40


@pytest.fixture(scope="module")
def hub(llama_pair, tmp_path_factory):
    """A cache holding org/tiny (main = REV1, and REV2) and org/tiny-head; returns (cache, hf model)."""
    hf, _, head = llama_pair
    root = tmp_path_factory.mktemp("hub")
    hf.save_pretrained(root / "target")
    save_head(head, root / "head", "bin")
    cache = root / "cache"
    add_to_hub_cache(cache, "org/tiny", root / "target", REV1)
    add_to_hub_cache(cache, "org/tiny", root / "target", REV2, ref=None)
    add_to_hub_cache(cache, "org/tiny-head", root / "head")
    return cache, hf


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("AERIE_DOWNLOAD_DIR", "")  # recorded: --download-dir sets it, the test restores it
    return hub


@pytest.mark.parametrize("name,parsed", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct", None, None)),
    ("org/name@v1.0", ("org/name", "v1.0", None)),
    ("org/name/model.Q8_0.gguf", ("org/name", None, "model.Q8_0.gguf")),
    ("org/name@main/model.gguf", ("org/name", "main", "model.gguf")),
    ("./org/name", None), ("/abs/org/name", None), ("~/org/name", None), ("name", None), ("a/b/c", None),
])
def test_parse_hub_id(name, parsed):
    assert parse_hub_id(name) == parsed


def test_a_hub_id_resolves_to_its_cached_snapshot(offline):
    cache, _ = offline
    snapshots = cache / "models--org--tiny" / "snapshots"
    assert resolve_model("org/tiny") == str(snapshots / REV1)  # refs/main
    assert resolve_model(f"org/tiny@{REV2}") == str(snapshots / REV2)
    assert resolve_model("org/tiny-head", "draft head").endswith("0" * 40)  # its refs/main


def test_generate_with_hub_ids_for_target_and_head(offline, capsys):
    """vLLM's --model and SGLang's --speculative-* flags, both naming Hub ids; tokens = transformers greedy."""
    _, hf = offline
    code = main(["generate", "--model", "org/tiny", "--speculative-algorithm", "EAGLE",
                 "--speculative-draft-model-path", "org/tiny-head", "--dtype", "float32",
                 "--speculative-num-steps", "4", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16",
                 "--prompt-ids", PROMPT, "--max-new-tokens", "16", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(out)
    assert res["tokens"] == hf_greedy(hf, [int(x) for x in PROMPT.split(",")], 16)
    assert res["target"] == "org/tiny" and res["draft"] == "org/tiny-head" and max(res["accept_lengths"]) > 1


def test_revision_flag(offline, capsys):
    code = main(["generate", "--model", "org/tiny", "--revision", REV2, "--draft", "none", "--prompt-ids", PROMPT,
                 "--max-new-tokens", "2", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["target"] == f"org/tiny@{REV2}"
    assert main(["generate", "--model", "org/tiny", "--revision", "nope", "--draft", "none",
                 "--prompt-ids", PROMPT]) == 3
    assert main(["generate", "--revision", "v1", "--prompt-ids", PROMPT]) == 2
    assert "--revision v1 needs a Hugging Face Hub id --target ORG/NAME" in capsys.readouterr().err


def test_download_dir_is_the_cache(hub, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # empty: only --download-dir has the model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("AERIE_DOWNLOAD_DIR", "")  # recorded: --download-dir sets it, the test restores it
    argv = ["generate", "--model", "org/tiny", "--draft", "none", "--prompt-ids", PROMPT, "--max-new-tokens", "2"]
    assert main(argv) == 3
    assert main([*argv, "--download-dir", str(hub[0])]) == 0


def test_a_model_that_cannot_be_had_exits_3(offline, capsys, tmp_path):
    code = main(["generate", "--model", "org/absent", "--prompt-ids", PROMPT])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1
    assert "model org/absent is neither a local path nor in the Hugging Face cache" in err
    assert "HF_HUB_OFFLINE or AERIE_OFFLINE is set" in err
    code = main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", PROMPT])
    assert code == 3 and f"model path {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    code = main(["generate", "--model", "org/tiny", "--draft", "org/no-head", "--prompt-ids", PROMPT])
    assert code == 3 and "draft head org/no-head is neither" in capsys.readouterr().err


def test_resolve_model_never_downloads_offline(offline):
    with pytest.raises(ModelUnavailable, match="HF_HUB_OFFLINE"):
        resolve_model("org/absent@v2/x.gguf")


def test_a_client_finds_a_served_hub_id_in_its_cache(offline):
    """`aerie generate --coordinator` against `aerie serve org/tiny`: GetInfo names the Hub id; the
    tokenizer source is the local cache's copy, never a download."""
    from services.model.hub import cached
    from services.rpc.coordinator_client import served_tokenizer_source

    assert served_tokenizer_source(None, "org/tiny", "a:1") == "org/tiny"
    assert cached("org/tiny").endswith(REV1)
    assert cached("org/absent") is None and cached("not a hub id") is None


def test_one_gguf_file_of_a_repository(offline, tmp_path):
    source = tmp_path / "gguf-repo"
    source.mkdir()
    (source / "model.Q8_0.gguf").write_bytes(b"GGUF not really")
    from tests.hub_cache import add_to_hub_cache as add

    add(offline[0], "org/gg", source, REV2)
    assert resolve_model("org/gg/model.Q8_0.gguf").endswith(f"snapshots/{REV2}/model.Q8_0.gguf")
    with pytest.raises(ModelUnavailable, match="org/gg/other.gguf is neither a local path"):
        resolve_model("org/gg/other.gguf")


def test_downloads_take_one_weight_layout_and_name_what_failed(tmp_path, monkeypatch, capsys):
    """The download path, with huggingface_hub's snapshot_download replaced (no network here): the
    first try takes safetensors; a repository without them is fetched again for .bin; Hub errors
    become ModelUnavailable naming the fix."""
    import httpx2
    import huggingface_hub as hf
    from huggingface_hub import errors

    monkeypatch.setenv("AERIE_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("AERIE_DOWNLOAD_DIR", "")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    calls = []

    def fake(repo, **kw):
        calls.append((repo, kw.get("allow_patterns"), kw.get("local_files_only", False), kw.get("token")))
        if kw.get("local_files_only"):
            raise errors.LocalEntryNotFoundError("not cached")
        return str(snapshot)

    monkeypatch.setattr(hf, "snapshot_download", fake)
    assert resolve_model("org/bin-only") == str(snapshot)
    assert [c[2] for c in calls] == [True, False, False]  # the cache, then safetensors, then .bin
    assert "*.safetensors" in calls[1][1] and "*.bin" in calls[2][1] and calls[1][3] == "hf_test"
    assert "downloading model org/bin-only from the Hugging Face Hub" in capsys.readouterr().err

    response = httpx2.Response(403, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/gated"))

    def gated(repo, **kw):
        if kw.get("local_files_only"):
            raise errors.LocalEntryNotFoundError("not cached")
        raise errors.GatedRepoError("gated", response=response)

    monkeypatch.setattr(hf, "snapshot_download", gated)
    with pytest.raises(ModelUnavailable, match="org/gated is gated on the Hugging Face Hub: accept its license"):
        resolve_model("org/gated")
