"""The draft-vocabulary ranking and its file (services/model/draft_vocab.py)."""

import pytest
import torch

from services.errors import CheckpointError
from services.model import draft_vocab


def test_worked_example_from_the_docstring():
    counts = torch.tensor([5, 0, 9, 5, 1])
    assert draft_vocab.ranking(counts).tolist() == [2, 0, 3, 4, 1]
    used = draft_vocab.select(counts, 3)
    assert used.tolist() == [0, 2, 3]
    d2t, t2d = draft_vocab.d2t_t2d(used, 5)
    assert d2t.tolist() == [0, 1, 1]
    assert t2d.tolist() == [True, False, True, True, False]
    assert (torch.arange(3) + d2t).tolist() == used.tolist()  # draft id -> target id


def test_ties_go_to_the_lower_id_whatever_the_order():
    counts = torch.zeros(1000, dtype=torch.long)
    counts[[900, 5, 700, 3]] = 7
    assert draft_vocab.select(counts, 2).tolist() == [3, 5]
    assert draft_vocab.select(counts, 6).tolist() == [0, 1, 3, 5, 700, 900]


def test_counts_round_trip_and_bad_files(tmp_path):
    counts = torch.randint(0, 100, (64,))
    draft_vocab.save_counts(tmp_path, counts)
    assert torch.equal(draft_vocab.load_counts(tmp_path, 64), counts)
    assert draft_vocab.load_counts(tmp_path / "nothing-here", 64) is None
    with pytest.raises(CheckpointError, match="vocabulary has 65 tokens"):
        draft_vocab.load_counts(tmp_path, 65)
    (tmp_path / draft_vocab.COUNTS_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable token-count file"):
        draft_vocab.load_counts(tmp_path, 64)
    with pytest.raises(ValueError, match=r"in \[1, 64\]; got 65"):
        draft_vocab.select(counts, 65)
