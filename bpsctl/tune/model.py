"""The traffic model under its earlier name: :mod:`bpsctl.model` holds it (the launchers and
the engine plan with it, so it sits below them); these names stay importable from here
because the design notes list ``bpsctl.tune.model`` among the stable interfaces."""
from ..model import (
    GOODPUT_SHARE,
    Layout,
    ServerGuess,
    goodput_bytes_s,
    group_shares,
    guess_servers,
    job_shares,
    optimal_shares,
    plan_layout,
    pure_round_factor,
    round_seconds,
    summation_split,
)

__all__ = ["GOODPUT_SHARE", "Layout", "ServerGuess", "goodput_bytes_s", "group_shares",
           "guess_servers", "job_shares", "optimal_shares", "plan_layout", "pure_round_factor",
           "round_seconds", "summation_split"]
