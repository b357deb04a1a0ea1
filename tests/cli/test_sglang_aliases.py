"""SGLang's tree flag names map onto aerie's (services/spec/tree_flags.py), in `aerie generate`,
`aerie up`, `aerie bench` and `aerie drafter`."""

import argparse

import pytest

from aerie_cli.flags import tree_values
from aerie_cli.main import build_parser
from drafter_svc.config import add_flags as add_drafter_flags


REQUIRED = {"generate": ["--prompt", "hi"], "bench": ["--prompts", "p.jsonl"]}


def parse(command, *argv):
    return build_parser().parse_args([command, *REQUIRED.get(command, []), *argv])


@pytest.mark.parametrize("command", ["generate", "up", "bench"])
def test_aliases_set_the_tree(command):
    args = parse(command, "--speculative-eagle-topk", "4", "--speculative-num-steps", "4",
                 "--speculative-num-draft-tokens", "16")
    assert tree_values(args) == (4, 3, 16)  # num_steps counts draft levels: depth 3 = 4 levels
    assert tree_values(parse(command, "--tree-top-k", "4", "--tree-depth", "3", "--tree-tokens", "16")) == (4, 3, 16)


def test_left_out_aliases_leave_the_defaults():
    assert tree_values(parse("generate")) == tree_values(parse("generate", "--tree-depth", str(tree_values(parse("generate"))[1])))


def test_drafter_aliases():
    p = argparse.ArgumentParser()
    add_drafter_flags(p)
    args = p.parse_args(["--speculative-num-steps", "6", "--speculative-eagle-topk", "10",
                         "--speculative-num-draft-tokens", "60"])
    assert (args.tree_top_k, args.tree_depth, args.tree_tokens) == (10, 5, 60)


def test_num_steps_below_two_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse("generate", "--speculative-num-steps", "1")
    assert e.value.code == 2
    assert "must be >= 2 (aerie's --tree-depth >= 1); got 1" in capsys.readouterr().err
