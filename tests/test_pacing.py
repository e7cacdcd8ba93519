"""Pacing by share (engine/pacing.py): what a worker may have in flight."""
from __future__ import annotations

from bpsctl.engine.pacing import credit_for, unequal

MiB = 1 << 20
#: the mixed layout of 4 worker hosts and 2 CPU hosts: each worker host sums 0.1, each CPU
#: host 0.3
MIXED = [0.1, 0.1, 0.1, 0.1, 0.3, 0.3]


def test_equal_shares_and_spares_keep_the_whole_credit():
    assert not unequal([0.25] * 4)
    assert not unequal([0.25, 0.25, 0.25, 0.25, 0.0])          # a spare holds nothing
    assert not unequal([0.255, 0.25, 0.25, 0.245])             # rounding
    assert not unequal([1.0])
    assert credit_for([0.25] * 4 + [0.0], 64 * MiB, 6 * MiB) == 64 * MiB


def test_unequal_shares_bound_the_bytes_in_flight_by_the_pacing_window():
    assert unequal(MIXED)
    assert credit_for(MIXED, 64 * MiB, 6 * MiB) == 6 * MiB
    assert credit_for(MIXED, 4 * MiB, 6 * MiB) == 4 * MiB        # a smaller credit still binds
    assert credit_for(MIXED, 64 * MiB, 6 * MiB, pacing=False) == 64 * MiB


def test_tune_measures_unpaced_only_a_mixed_layout_with_pacing_on():
    from bpsctl.config import Config
    from bpsctl.tune.api import paced
    model = {"cpu_share": 0.6}
    assert paced(None, model, Config()) and paced(0.6, model, Config())
    assert not paced(0.0, model, Config()) and not paced(1.0, model, Config())
    assert not paced(0.6, None, Config())                   # servers of one kind only
    assert not paced(0.6, model, Config(pacing=False))
