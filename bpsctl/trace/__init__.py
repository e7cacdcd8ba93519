"""Reading the engine's traces (``bpsctl trace DIR``): merge, summary, picture."""
