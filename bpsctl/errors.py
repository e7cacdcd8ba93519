"""bpsctl's one error family: every error a user can meet carries the exit code it ends with.

The CLI catches :class:`BpsctlError` in one place (``cliutil.cli_errors``), prints its message
and exits with its ``exit_code``: 2 for a usage or configuration error (the user must change
what they typed or wrote), 1 for a failure at run time (a process, host or network failed).
Each subsystem keeps its own subclass so that callers can still tell them apart.
"""
from __future__ import annotations


class BpsctlError(Exception):
    """An error whose message names what is wrong and how to fix it."""

    exit_code: int = 1


class UsageError(BpsctlError):
    """What the user typed or wrote cannot be used (flags, config files, hosts files)."""

    exit_code = 2


__all__ = ["BpsctlError", "UsageError"]
