"""On PYTHONPATH only for a GPU server whose environment has SWITCH_MS (the GPU driver's `server_env=SWITCH_MS=0.2`):
every interpreter of the server, the engine core's included, runs with that GIL switch interval instead of 5 ms."""
import os
import sys

if os.environ.get("SWITCH_MS"):
    sys.setswitchinterval(float(os.environ["SWITCH_MS"]) / 1000)
