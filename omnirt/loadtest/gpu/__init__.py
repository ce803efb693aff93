"""The GPU measurements: one driver (`python3 -m omnirt.loadtest.gpu SCENARIO`, the scenarios in `scenarios.py`) and the
in-process checks it runs (diag, the kernel and parity checks)."""
