"""Chaos: faults injected into a running emulated cluster on a seeded schedule (docs/chaos.md)."""
