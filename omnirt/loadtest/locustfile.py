"""omnirt load test: `locust -f omnirt/loadtest/locustfile.py --host http://127.0.0.1:8091` (or `make loadtest`).

Users: ChatAudioUser (streaming chat completions with spoken input and audio output) and RealtimeUser
(a WebSocket Realtime session). RealtimeUser is dropped at start, with a message, when the server has
no /v1/realtime. Another user is one more module here. Every request event is also kept unrounded
(`--raw-samples PREFIX` -> PREFIX_samples.csv and PREFIX_summary.json with exact percentiles)."""

from __future__ import annotations

import logging

from locust import events

from omnirt.loadtest.chat_user import ChatAudioUser
from omnirt.loadtest.realtime_user import RealtimeUser, realtime_available
from omnirt.loadtest.samples import RawSamples

__all__ = ["ChatAudioUser", "RealtimeUser"]
log = logging.getLogger("omnirt.loadtest")


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    parser.add_argument("--raw-samples", default="docs/loadtest/omnirt", help="prefix of the raw sample files")


@events.init.add_listener
def _init(environment, **_) -> None:
    environment.raw_samples = RawSamples(environment, environment.parsed_options.raw_samples)
    if RealtimeUser in environment.user_classes:
        ok, why = realtime_available(environment.host)
        if not ok:
            log.warning("skipping RealtimeUser: %s has no /v1/realtime (%s)", environment.host, why)
            environment.user_classes[:] = [u for u in environment.user_classes if u is not RealtimeUser]
            if not environment.user_classes:
                raise SystemExit("omnirt loadtest: no user class left to run")
