"""bpsctl: launch, benchmark and tune data-parallel training around an embedded parameter server.

Its modules are layered, each importing only from its own layer and those below; the order is
written down, and checked, in tests/test_layers.py (``LAYERS``).
"""
__version__ = "0.1.0"
