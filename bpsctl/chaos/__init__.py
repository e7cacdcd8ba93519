"""Chaos: faults injected into a running emulated cluster on a seeded schedule (docs/chaos.md)."""

#: the directory `bpsctl chaos` gives every worker of the job it runs, where a script records
#: its steps for the checker (bpsctl.chaos.job.Recorder)
CHAOS_DIR = "BPSCTL_CHAOS_DIR"
