"""omnirt: a realtime voice-agent server for omni models.

`omnirt.app` is the API process (transports, protocols, sessions; never tensors), `omnirt.pipeline` the engine
(tensors; never HTTP), `omnirt.loadtest` the benchmarks behind `omnirt bench`. The browser demo (`web/`) and the
deploy profiles (`deploy/`) ship inside the package, so that an installed wheel serves what a checkout does.
"""
