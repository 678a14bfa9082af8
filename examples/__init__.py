"""Examples that use weight-bridge; each runs as a script (python examples/NAME.py --help)."""
