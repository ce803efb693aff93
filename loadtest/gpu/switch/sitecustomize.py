"""On PYTHONPATH for a GPU bench only (ab_builds.sh with SWITCH_MS): every interpreter of the server, the engine
core's included, runs with that GIL switch interval instead of Python's 5 ms."""
import os
import sys

if os.environ.get("SWITCH_MS"):
    sys.setswitchinterval(float(os.environ["SWITCH_MS"]) / 1000)
