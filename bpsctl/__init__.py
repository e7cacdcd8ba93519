"""bpsctl: launch, benchmark and tune data-parallel training around an embedded parameter server."""
__version__ = "0.1.0"
