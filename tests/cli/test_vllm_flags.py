"""vLLM's and SGLang's flag names map onto aerie's (aerie_cli/spec_flags.py, flags.py, up.py), a
refused one exits 2 naming it, and the exit codes tell usage, model and server failures apart."""

import argparse
import os
import socket
import stat

import grpc
import pytest

from aerie_cli import exit_codes
from aerie_cli.flags import finish_model_flags, tree_values
from aerie_cli.main import build_parser, main
from coordinator.up import api_key, role_flags
from services.errors import CapacityExceeded, CheckpointError, InvalidRequest, ModelUnavailable, Unreachable
from services.rpc.config import ConfigError
from services.rpc.coordinator_client import RemoteError
from verifier_svc.config import add_flags as add_verifier_flags

REQUIRED = {"generate": ["--prompt-ids", "1"], "bench": ["--prompts", "p.jsonl"]}


def parse(command, *argv):
    args = build_parser().parse_args([command, *REQUIRED.get(command, []), *argv])
    finish_model_flags(args)
    return args


@pytest.mark.parametrize("command", ["generate", "up", "serve", "bench"])
@pytest.mark.parametrize("given,dtype", [("auto", None), ("bfloat16", "bf16"), ("bf16", "bf16"),
                                         ("float32", "fp32"), ("float", "fp32"), ("int8", "int8"),
                                         ("float16", "fp16"), ("half", "fp16"), ("fp16", "fp16")])
def test_dtype_names(command, given, dtype):
    assert parse(command, "--dtype", given).dtype == dtype  # None: the device's default


@pytest.mark.parametrize("given,message", [("fp64", "must be auto, bfloat16 (bf16), float16 (fp16, half), float32 "
                                                   "(fp32) or int8; got 'fp64'")])
def test_refused_dtypes(capsys, given, message):
    with pytest.raises(SystemExit) as e:
        parse("generate", "--dtype", given)
    assert e.value.code == 2 and message in capsys.readouterr().err
    p = argparse.ArgumentParser()
    add_verifier_flags(p)  # the services take the same names
    assert p.parse_args(["--dtype", "bfloat16"]).dtype == "bf16"
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", given])


@pytest.mark.parametrize("argv,draft", [
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "H"], "H"),
    (["--speculative-algorithm", "eagle3", "--speculative-draft-model", "H"], "H"),
    (["--speculative-draft-model-path", "org/h", "--speculative-draft-model-revision", "v2"], "org/h@v2"),
    (["--speculative-algorithm", "NGRAM"], "sam"),
    (["--speculative-algorithm", "NONE"], "none"),
    (["--speculative-algorithm", "EAGLE"], "eagle"),  # the default model's shipped head
    (["--speculative-config", '{"method": "eagle3", "model": "H"}'], "H"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'], "sam"),
    (["--speculative-config", '{"method": "suffix"}'], "sam"),
    (["--speculative-accept-threshold-single", "1", "--speculative-accept-threshold-acc", "1.0",
      "--speculative-attention-mode", "decode", "--speculative-draft-load-format", "pt"], None),
])
def test_speculative_flags_set_the_draft(argv, draft):
    assert parse("generate", *argv).draft == draft
    assert parse("serve", *argv).draft == draft


def test_vllm_num_speculative_tokens_is_the_tree_depth():
    args = parse("up", "--speculative-config", '{"method": "eagle", "model": "H", "num_speculative_tokens": 5}')
    assert (args.draft, tree_values(args)) == ("H", (None, 4, None))  # 5 levels = depth 4 (tree_flags.py)


REFUSED = [
    (["--speculative-algorithm", "NEXTN"], "NEXTN (a model's own multi-token-prediction layers) is not implemented"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "D"], "STANDALONE (a small draft LLM)"),
    (["--speculative-accept-threshold-acc", "0.5"], "must be 1.0: aerie verifies losslessly"),
    (["--speculative-token-map", "m.pt"], "--speculative-token-map is not supported"),
    (["--speculative-draft-model-quantization", "fp8"], "--speculative-draft-model-quantization is not supported"),
    (["--speculative-moe-runner-backend", "triton"], "--speculative-moe-runner-backend must be auto"),
    (["--speculative-config", '{"method": "eagle", "model": "H", "max_model_len": 9}'],
     "--speculative-config keys ['max_model_len'] are not supported"),
    (["--speculative-config", '{"method": "medusa"}'], "--speculative-config method must be one of"),
    (["--speculative-config", "eagle"], "--speculative-config must be a JSON object"),
    (["--speculative-config", '{"model": "H", "draft_tensor_parallel_size": 2}'], "draft_tensor_parallel_size must be 1"),
    (["--speculative-config", '{"model": "H"}', "--speculative-algorithm", "EAGLE"], "not both"),
    (["--draft", "none", "--speculative-algorithm", "EAGLE"], "give --draft none or the --speculative-* flags, not both"),
    (["--model", "M", "--speculative-algorithm", "EAGLE"], "needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "H"], "takes no draft model"),
    (["--speculative-algorithm", "MEDUSA"], "must be one of EAGLE, EAGLE3"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: `aerie generate` loads the target in this process"),
    (["-tp", "0"], "--tensor-parallel-size must be >= 1; got 0"),
]


@pytest.mark.parametrize("argv,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_refused_flags_exit_2_naming_them(capsys, argv, message):
    try:
        code = main(["generate", "--prompt-ids", "1", *argv])
    except SystemExit as e:  # refused by argparse (a flag's type)
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_serve_takes_vllm_names():
    args = parse("serve", "org/m", "--port", "9000", "--grpc-port", "0", "--tensor-parallel-size", "2",
                 "--max-num-seqs", "8", "--kv-budget-mb", "512", "--log-level", "WARNING")
    assert (args.target, args.http_port, args.port, args.tp) == ("org/m", 9000, 0, 2)
    assert role_flags(args, "verifier") == ["--log-level", "WARNING", "--max-sequences", "8", "--kv-budget-mb", "512.0"]
    assert role_flags(args, "drafter") == ["--log-level", "WARNING", "--max-sequences", "8"]
    assert "--served-model-name" not in role_flags(args, "coordinator")  # `aerie serve` fills it in cmd_serve
    named = parse("serve", "org/x", "--served-model-name", "m")
    assert (named.served_model_name, named.target) == (["m"], "org/x")
    assert role_flags(named, "coordinator")[-2:] == ["--served-model-name", "m"]
    assert parse("serve", "--model", "org/m").target == "org/m"
    assert parse("serve").http_port == 8000 and parse("serve").port == 50051  # vLLM's HTTP port, aerie's gRPC
    up = parse("up", "--port", "1", "--http-port", "2", "--tp", "2", "--max-running-requests", "4")
    assert (up.port, up.http_port, up.tp, up.max_num_seqs) == (1, 2, 2, 4)  # aerie up keeps its names


def test_serve_refuses_two_models(capsys):
    assert main(["serve", "a/b", "--model", "c/d"]) == 2
    assert "two models given: MODEL a/b and --model c/d" in capsys.readouterr().err


def test_api_key_goes_to_a_private_file(tmp_path, monkeypatch):
    monkeypatch.delenv("AERIE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = argparse.Namespace(api_key=None, api_key_file=None)
    assert api_key(args, tmp_path) == {}
    monkeypatch.setenv("VLLM_API_KEY", "sk-1-0123456789abcdef")
    env = api_key(args, tmp_path)
    path = env["AERIE_API_TOKENS_FILE"]
    # the key as identity "default", and the HTTP gateway's own token (generated per run) as "gateway"
    own = env["AERIE_API_TOKEN"]
    assert len(own) >= 32 and own != "sk-1-0123456789abcdef"
    assert open(path).read() == f"default sk-1-0123456789abcdef\ngateway {own}\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    (tmp_path / "k").write_text("sk-2-0123456789abcdef\n")
    env = api_key(argparse.Namespace(api_key=None, api_key_file=str(tmp_path / "k")), tmp_path)
    assert open(path).read() == f"default sk-2-0123456789abcdef\ngateway {env['AERIE_API_TOKEN']}\n"


@pytest.mark.parametrize("error,code", [
    (InvalidRequest("x"), 2), (ConfigError("x"), 2), (CheckpointError("x"), 2), (ModelUnavailable("x"), 3),
    (Unreachable("x"), 4), (RemoteError(grpc.StatusCode.UNAVAILABLE, "x"), 4),
    (RemoteError(grpc.StatusCode.DEADLINE_EXCEEDED, "x"), 4), (RemoteError(grpc.StatusCode.INVALID_ARGUMENT, "x"), 2),
    (RemoteError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x"), 1), (CapacityExceeded("x"), 1), (KeyboardInterrupt(), 130),
])
def test_exit_codes(error, code):
    assert exit_codes.exit_code(error) == code


def test_a_refused_connection_exits_4(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["generate", "--coordinator", f"127.0.0.1:{port}", "--prompt-ids", "1", "--resume-s", "0"]) == 4
    assert capsys.readouterr().err.startswith("aerie: error: ")


def test_docs_list_the_exit_codes():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    for name in ("OK", "FAILED", "USAGE", "MODEL_UNAVAILABLE", "UNREACHABLE", "INTERRUPTED"):
        assert f"| {getattr(exit_codes, name)} |" in text, name


def test_up_splits_the_kv_share_over_the_verifiers_of_one_host(monkeypatch):
    """Several verifiers under one `aerie up` each take AERIE_KV_BUDGET_SHARE / M of the memory free at
    their start (together at most the share); one verifier, or an explicit --kv-budget-mb, is left as given."""
    monkeypatch.delenv("AERIE_KV_BUDGET_SHARE", raising=False)
    assert role_flags(parse("up", "--verifiers", "4"), "verifier") == ["--kv-budget-share", "0.125"]
    assert role_flags(parse("up"), "verifier") == []
    monkeypatch.setenv("AERIE_KV_BUDGET_SHARE", "0.8")
    assert role_flags(parse("up", "--verifiers", "2"), "verifier") == ["--kv-budget-share", "0.4"]
    assert role_flags(parse("up", "--verifiers", "2", "--kv-budget-mb", "256"), "verifier") == \
        ["--kv-budget-mb", "256.0"]


def test_overlap_flag_reaches_the_coordinators_and_its_config():
    from coordinator.config import CoordinatorConfig, ConfigError, overlap_mode
    from services.rpc.config import ServiceConfig

    assert "--overlap" not in role_flags(parse("up"), "coordinator")  # default: AERIE_OVERLAP, else off
    for mode in ("on", "always", "off"):
        assert role_flags(parse("up", "--overlap", mode), "coordinator")[-2:] == ["--overlap", mode]
        assert "--overlap" not in role_flags(parse("up", "--overlap", mode), "verifier")
    assert [overlap_mode(v) for v in ("1", "0", "true", "ALWAYS")] == ["on", "off", "on", "always"]
    with pytest.raises(SystemExit):
        parse("up", "--overlap", "sometimes")
    with pytest.raises(ConfigError, match="overlap must be one of off, on, always; got 'sometimes'"):
        CoordinatorConfig(ServiceConfig(), verifiers=("127.0.0.1:1",), overlap="sometimes")


def test_plain_run_flag_reaches_the_coordinators_and_its_config(monkeypatch):
    from coordinator.config import CoordinatorConfig, ConfigError, add_flags, from_args
    from services.rpc.config import ServiceConfig

    assert "--plain-run" not in role_flags(parse("up"), "coordinator")  # default: AERIE_PLAIN_RUN, else 16
    assert role_flags(parse("up", "--plain-run", "0"), "coordinator")[-2:] == ["--plain-run", "0"]
    assert "--plain-run" not in role_flags(parse("up", "--plain-run", "8"), "verifier")

    def coordinator_config(*argv):
        p = argparse.ArgumentParser()
        add_flags(p)
        return from_args(p.parse_args(["--verifiers", "127.0.0.1:1", *argv]))

    monkeypatch.delenv("AERIE_PLAIN_RUN", raising=False)
    assert coordinator_config().plain_run == 16
    assert coordinator_config("--plain-run", "4").plain_run == 4
    monkeypatch.setenv("AERIE_PLAIN_RUN", "0")
    assert coordinator_config().plain_run == 0
    for bad in (-1, 65):
        with pytest.raises(ConfigError, match=f"plain_run must be in \\[0, 64\\] \\(0 = off\\); got {bad}"):
            CoordinatorConfig(ServiceConfig(), verifiers=("127.0.0.1:1",), plain_run=bad)


def test_drafters_none_means_no_drafter_pool(monkeypatch):
    """`--drafters none` (AERIE_DRAFTERS=none): no drafter pool even with discovery; an empty list keeps
    the pool of drafters registered in Redis."""
    from coordinator.config import add_flags, from_args

    def coordinator_config(*argv):
        p = argparse.ArgumentParser()
        add_flags(p)
        return from_args(p.parse_args(["--verifiers", "127.0.0.1:1", *argv]))

    monkeypatch.delenv("AERIE_DRAFTERS", raising=False)
    none = coordinator_config("--drafters", "none")
    assert (none.drafters, none.drafter_pool) == ((), False)
    empty = coordinator_config()
    assert (empty.drafters, empty.drafter_pool) == ((), True)
    some = coordinator_config("--drafters", "127.0.0.1:2")
    assert (some.drafters, some.drafter_pool) == (("127.0.0.1:2",), True)
    monkeypatch.setenv("AERIE_DRAFTERS", "None")
    assert coordinator_config().drafter_pool is False
    from coordinator.up import pool_flags  # what `aerie up` passes its coordinators

    assert pool_flags(["h:1"], [], False) == ["--verifiers", "h:1", "--drafters", "none"]
    assert pool_flags(["h:1"], ["h:2", "h:3"], True) == ["--verifiers", "h:1", "--drafters", "h:2,h:3", "--retrieval"]

def test_float16_runs_on_cuda_only(capsys):
    """float16 is accepted by name (vLLM's --dtype half) and refused on the CPU before anything loads:
    mapped to nothing else, since that would change the numbers asked for."""
    from services.device import check_dtype
    from services.engine.local import DTYPES

    check_dtype("fp16", "cuda:0")  # no GPU needed to accept it there
    with pytest.raises(InvalidRequest, match=r"--dtype float16 runs on CUDA only \(this device: cpu\)"):
        check_dtype("fp16", "cpu")
    import torch

    assert DTYPES["fp16"] is torch.float16
    assert main(["generate", "--prompt-ids", "1", "--dtype", "half", "--device", "cpu"]) == 2
    assert "--dtype float16 runs on CUDA only" in capsys.readouterr().err
    assert main(["serve", "--dtype", "float16", "--device", "cpu"]) == 2  # before Redis or any service starts
    assert "--dtype float16 runs on CUDA only" in capsys.readouterr().err


def test_serve_forwards_max_model_len_and_gpu_memory_utilization():
    args = parse("serve", "org/m", "--max-model-len", "2048", "--gpu-memory-utilization", "0.85")
    assert role_flags(args, "verifier") == ["--max-model-len", "2048", "--gpu-memory-utilization", "0.85"]
    assert role_flags(args, "drafter") == [] and "--max-model-len" not in role_flags(args, "coordinator")
    p = argparse.ArgumentParser()
    add_verifier_flags(p)
    assert p.parse_args(["--max-model-len", "2048", "--gpu-memory-utilization", "0.85"]).max_model_len == 2048


def test_serve_forwards_the_queue_bounds():
    args = parse("serve", "org/m", "--max-num-seqs", "4", "--max-queued-requests", "16", "--queue-timeout-s", "30")
    assert role_flags(args, "coordinator") == ["--max-sequences", "4", "--direct-drafts", "1",
                                               "--max-queued-requests", "16", "--queue-timeout-s", "30"]


def test_without_max_num_seqs_the_coordinators_queue_at_what_the_pools_hold(monkeypatch):
    """The verifiers and drafters hold 64 sequences each by default: the coordinators admit that many
    (split between them) and queue the rest, instead of a full verifier refusing them."""
    monkeypatch.delenv("AERIE_MAX_SEQUENCES", raising=False)
    monkeypatch.delenv("AERIE_DIRECT_DRAFTS", raising=False)
    direct = ["--direct-drafts", "1"]  # (aerie up's default: test_aerie_up_asks_for_direct_drafts)
    assert role_flags(parse("serve", "org/m"), "coordinator") == ["--max-sequences", "64", *direct]
    assert role_flags(parse("up", "--verifiers", "3", "--drafters", "2", "--coordinators", "2"),
                      "coordinator") == ["--max-sequences", "64", *direct]  # 64 x min(3, 2) / 2
    assert role_flags(parse("up", "--verifiers", "2", "--drafters", "0"), "coordinator") == [
        "--max-sequences", "128", *direct]
    assert "--max-sequences" not in role_flags(parse("serve", "org/m"), "verifier")  # its own default
    monkeypatch.setenv("AERIE_MAX_SEQUENCES", "10")  # every service's, as the user set it
    assert role_flags(parse("serve", "org/m"), "coordinator") == direct


def test_aerie_up_asks_for_direct_drafts(monkeypatch):
    """`aerie up`/`serve` start their coordinators with direct drafts (the processes share a host):
    --no-direct-drafts or AERIE_DIRECT_DRAFTS=0 turn them off, a bad value is named."""
    from coordinator.up import direct_drafts

    monkeypatch.delenv("AERIE_DIRECT_DRAFTS", raising=False)
    assert direct_drafts(parse("up")) and direct_drafts(parse("serve", "org/m", "--direct-drafts"))
    assert not direct_drafts(parse("up", "--no-direct-drafts"))
    monkeypatch.setenv("AERIE_DIRECT_DRAFTS", "0")
    assert not direct_drafts(parse("up")) and direct_drafts(parse("up", "--direct-drafts"))
    assert "--direct-drafts" in role_flags(parse("up"), "coordinator") and "--direct-drafts" not in role_flags(
        parse("up"), "verifier")
    monkeypatch.setenv("AERIE_DIRECT_DRAFTS", "maybe")
    with pytest.raises(ConfigError, match="AERIE_DIRECT_DRAFTS must be 1 or 0; got 'maybe'"):
        direct_drafts(parse("up"))


def test_several_served_model_names():
    args = parse("serve", "org/m", "--served-model-name", "a", "b", "--served-model-name", "c")
    assert role_flags(args, "coordinator")[-4:] == ["--served-model-name", "a", "b", "c"]
    up = parse("up", "--served-model-name", "a", "b")  # aerie up has no MODEL to swallow: the default model
    assert up.served_model_name == ["a", "b"] and up.target is None
    from coordinator import config as coordinator_config

    p = argparse.ArgumentParser()
    coordinator_config.add_flags(p)
    config = coordinator_config.from_args(p.parse_args(["--verifiers", "h:1", "--served-model-name", "a", "b"]))
    assert (config.served_model_name, config.model_aliases) == ("a", ("b",))
    with pytest.raises(ConfigError, match="distinct non-empty names"):
        coordinator_config.from_args(p.parse_args(["--verifiers", "h:1", "--served-model-name", "a", "a"]))


def test_served_names_from_the_environment(monkeypatch):
    from coordinator import config as coordinator_config

    monkeypatch.setenv("AERIE_SERVED_MODEL_NAME", "a, b")
    p = argparse.ArgumentParser()
    coordinator_config.add_flags(p)
    config = coordinator_config.from_args(p.parse_args(["--verifiers", "h:1"]))
    assert (config.served_model_name, config.model_aliases) == ("a", ("b",))


def test_serve_refuses_a_model_swallowed_as_a_served_name(capsys):
    """vLLM's --served-model-name takes several values, so `--served-model-name m org/x` names two models
    and serves none given: refused, saying how to write it."""
    assert main(["serve", "--served-model-name", "m", "org/x"]) == 2
    err = capsys.readouterr().err
    assert "--served-model-name took m org/x as names and no MODEL is given; put MODEL first" in err
    args = parse("serve", "--served-model-name", "a", "--served-model-name", "b")  # repeated: the default model
    assert args.served_model_name == ["a", "b"] and args.target is None


def test_overlap_makes_the_drafters_reserve_the_ahead_rows(monkeypatch):
    """`aerie up --overlap on|always` (or AERIE_OVERLAP) gives its drafters --ahead-branches 2: their
    draft KV reserves the ahead tree's rows (services/spec/ahead_tree.py); off, none."""
    monkeypatch.delenv("AERIE_OVERLAP", raising=False)
    monkeypatch.delenv("AERIE_AHEAD_BRANCHES", raising=False)
    assert "--ahead-branches" not in role_flags(parse("up"), "drafter")
    assert role_flags(parse("up", "--overlap", "always"), "drafter")[-2:] == ["--ahead-branches", "2"]
    assert "--ahead-branches" not in role_flags(parse("up", "--overlap", "on"), "coordinator")
    monkeypatch.setenv("AERIE_OVERLAP", "1")
    assert role_flags(parse("up"), "drafter")[-2:] == ["--ahead-branches", "2"]
    assert "--ahead-branches" not in role_flags(parse("up", "--overlap", "off"), "drafter")
    monkeypatch.setenv("AERIE_AHEAD_BRANCHES", "1")  # the drafters read their own setting
    assert "--ahead-branches" not in role_flags(parse("up"), "drafter")
