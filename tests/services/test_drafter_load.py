"""drafter_svc/load.py: the drafter's load as one sequence sees it, on an explicit clock."""

import pytest

from drafter_svc.load import DrafterLoad


def test_load_counts_other_sequences_batches_inside_the_window():
    now = [10.0]
    load = DrafterLoad(window_s=2.0, clock=lambda: now[0])
    assert load.busy("a") == 0.0  # idle
    load.ran(8.5, 9.0, {"a"})  # a's own batch: no load for a
    load.ran(9.0, 10.0, {"a", "b"})  # shared with b: load for both
    load.ran(7.0, 8.5, {"b"})  # half a second of it inside the window [8, 10]
    assert load.busy("a") == pytest.approx((1.0 + 0.5) / 2.0)
    assert load.busy("b") == pytest.approx((0.5 + 1.0) / 2.0)
    assert load.busy("c") == pytest.approx(1.0)  # everything is someone else's: saturated (capped)
    now[0] = 13.0  # the window moved past every batch
    assert load.busy("c") == 0.0
    with pytest.raises(ValueError, match="window_s"):
        DrafterLoad(window_s=0)
