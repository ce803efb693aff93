"""What GET /metrics (`omnirt.app.server`) shows in Prometheus' text format: requests and sessions by state,
per-stage queue depths and batch sizes (read from the engine at scrape time), when each stage first served
a request, audio TTFP and RTF histograms, underruns, errors by type, and one structured log line per
finished request. One registry per app: no global state. With `--api-workers` every worker's figures are
summed (`omnirt.app.ops.worker_link`), the process_* ones labelled by `worker` instead, as the front end's load is
(`omnirt_front_end_*{worker}`: each process's own); the engine's come once."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily

from omnirt.app.audio.playback import PlaybackClock, pcm16_seconds
from omnirt.app.errors import error_type
from omnirt.pipeline.api import FIRST_OUTPUT_BUCKETS_S, AudioChunk, Event, Finished, StageStats

log = logging.getLogger("omnirt.requests")


class Metrics:
    def __init__(self, engine):
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omnirt_requests", "Requests by endpoint and final state "
                                "(stop, length, abort, error, rejected)", ["endpoint", "state"], registry=r)
        self.active = Gauge("omnirt_requests_active", "Requests being served", ["endpoint"], registry=r)
        self.sessions = Counter("omnirt_sessions", "Realtime sessions by transport and how they ended: closed "
                                "(by the client), timeout, shutdown (by the server's drain), failed, refused (at "
                                "connect), policy (input audio too fast), slow_client (took no events)",
                                ["transport", "state"], registry=r)
        self.sessions_active = Gauge("omnirt_sessions_active", "Open realtime sessions", ["transport"], registry=r)
        self.errors = Counter("omnirt_errors", "Errors by type (OpenAI error type or stream error code)", ["type"],
                              registry=r)
        self.ttfp = Histogram("omnirt_audio_ttfp_seconds", "Request to first audio packet", registry=r,
                              buckets=(.05, .1, .2, .3, .5, .75, 1, 1.5, 2, 3, 5, 10, 30))
        self.rtf = Histogram("omnirt_audio_rtf", "Time to the last audio packet / audio duration", registry=r,
                             buckets=(.05, .1, .2, .3, .5, .75, 1, 1.5, 2, 5, 10))
        self.underruns = Counter("omnirt_audio_underruns", "Playback stalls >= 100 ms while audio was owed",
                                 registry=r)
        self.mic_dropped = Counter("omnirt_webrtc_input_dropped_seconds", "WebRTC microphone audio dropped because "
                                   "its session fell more than --webrtc-max-input-lag-s behind", registry=r)
        self.http = Counter("omnirt_http_responses", "HTTP responses by status code", ["code"], registry=r)
        self.key_requests = Counter("omnirt_key_requests", "HTTP requests and Realtime session starts let in, by API "
                                    "key id", ["key"], registry=r)
        self.key_limited = Counter("omnirt_key_limited", "Refused by a limit of their API key, by key id and limit "
                                   "(requests_per_minute, max_requests, max_sessions)", ["key", "limit"], registry=r)
        self.key_active = Gauge("omnirt_key_active", "In flight by API key id: HTTP requests, open Realtime sessions",
                                ["key", "kind"], registry=r)
        ProcessCollector(registry=r)  # this (API) process's CPU and memory: `omnirt bench realtime` reads it
        self.engine_registry = CollectorRegistry()  # the engine's figures: the same in every API worker
        self.engine_registry.register(EngineCollector(engine))

    def watch_vad(self, vad) -> None:
        """Export the process's `VadBatcher` counts: windows evaluated and the model calls they took."""
        self.registry.register(VadCollector(vad))

    def watch_load(self, load, worker: int) -> None:
        """Export the process's front-end load (`omnirt.app.ops.front_end_load.FrontEndLoad`), labelled by API worker:
        a load balancer reads each worker's, never a sum."""
        self.registry.register(FrontEndCollector(load, str(worker)))

    def render(self) -> bytes:
        return self.render_local() + generate_latest(self.engine_registry)

    def render_local(self) -> bytes:
        """This process's own figures, without the engine's (what an API worker adds to the merged /metrics)."""
        return generate_latest(self.registry)

    async def observe(self, events: AsyncIterator[Event], endpoint: str, started: float,
                      ids: dict[str, str | None]) -> AsyncIterator[Event]:
        """Pass a request's events through, recording TTFP, RTF, underruns and its final state (logged with
        `ids`: the request id, the API key's id, and the session id of a Realtime response)."""
        clock, state, fin, rate = PlaybackClock(), "abort", None, self.engine.info().output_sample_rate
        self.active.labels(endpoint).inc()
        try:
            async for ev in events:
                if isinstance(ev, AudioChunk):
                    clock.on_packet(time.monotonic(), pcm16_seconds(ev.pcm16, rate))
                elif isinstance(ev, Finished):
                    fin, state = ev, ev.finish_reason
                yield ev
        finally:
            self.active.labels(endpoint).dec()
            self._record(clock, state, fin, endpoint, started,
                         ids)
            await events.aclose()

    def _record(self, clock: PlaybackClock, state: str, fin: Finished | None, endpoint: str, started: float,
                ids: dict) -> None:
        self.requests.labels(endpoint, state).inc()
        if fin is not None and fin.error:
            self.errors.labels("generation_failed" if state == "error" else "aborted_by_server").inc()
        extra = {**ids, "finish_reason": state, "error": fin.error if fin else None}
        if clock.num_packets:
            ttfp, rtf = clock.first_at - started, (clock.last_at - started) / max(clock.audio_s, 1e-6)
            self.ttfp.observe(ttfp)
            self.rtf.observe(rtf)
            self.underruns.inc(clock.num_underruns)
            extra.update(ttfp_ms=round(ttfp * 1000, 1), audio_s=round(clock.audio_s, 3), rtf=round(rtf, 3))
        log.info("request finished", extra=extra)


class EngineCollector:
    """Reads the engine's stats snapshot when scraped (no work on the step loops)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        depth = GaugeMetricFamily("omnirt_stage_queue_depth", "Requests per stage by place", labels=["stage", "queue"])
        slots = GaugeMetricFamily("omnirt_stage_free_slots", "Free KV slots per stage", labels=["stage"])
        for st in stats.stages:
            if st.running is not None:  # in-process stages; replica pools report on /health
                depth.add_metric([st.name, "running"], st.running)
                depth.add_metric([st.name, "waiting"], st.waiting)
            depth.add_metric([st.name, "admission_waiting"], st.admission_waiting)
            slots.add_metric([st.name], st.free_slots)
        yield depth
        yield slots
        yield _batch_histogram([st for st in stats.stages if st.batch_size_counts is not None])
        yield _step_seconds([st for st in stats.stages if st.busy_s is not None])
        yield from _step_kinds([st for st in stats.stages if st.decode_steps is not None])
        yield from _allocator(stats.allocator)
        yield from _prefix_reuse([st for st in stats.stages if st.prefill_tokens is not None and st.slots])
        yield from _waits([st for st in stats.stages if st.first_steps is not None])
        yield _first_outputs([st for st in stats.stages if st.first_output_counts is not None])
        refused = GaugeMetricFamily("omnirt_admission_refused", "Requests refused because a stage was full "
                                    "(since start)")
        refused.add_metric([], stats.admission_refused)
        yield refused


def _batch_histogram(stages: list[StageStats]) -> HistogramMetricFamily:
    """A bucket per batch size (1..max_num_seqs), so that a bench's p90 rows a step is exact, not a bucket's bound."""
    h = HistogramMetricFamily("omnirt_stage_batch_size", "Requests per step, by stage", labels=["stage"])
    for stage in stages:
        counts = stage.batch_size_counts
        running = list(itertools.accumulate(counts))
        buckets = [(str(float(b)), running[b]) for b in range(1, len(counts))] + [("+Inf", running[-1])]
        h.add_metric([stage.name], buckets, sum_value=sum(size * n for size, n in enumerate(counts)))
    return h


def _first_outputs(stages: list[StageStats]) -> HistogramMetricFamily:
    """Where a first packet's time goes: each stage's first output for a request, from its submission."""
    h = HistogramMetricFamily("omnirt_stage_first_output_seconds", "Seconds from a request's submission to the "
                              "engine until its first output from a stage (first token, frame, PCM)", labels=["stage"])
    for st in stages:
        running = list(itertools.accumulate(st.first_output_counts))
        buckets = [(str(b), n) for b, n in zip(FIRST_OUTPUT_BUCKETS_S, running)] + [("+Inf", running[-1])]
        h.add_metric([st.name], buckets, sum_value=st.first_output_s)
    return h


def _step_seconds(stages: list[StageStats]) -> CounterMetricFamily:
    """Where a stage's step time goes: host work (Python, launches) vs waiting for the device."""
    c = CounterMetricFamily("omnirt_stage_step_seconds", "Seconds inside steps, by stage and part",
                            labels=["stage", "part"])
    for stage in stages:
        c.add_metric([stage.name, "host"], stage.busy_s - stage.device_wait_s)
        c.add_metric([stage.name, "device_wait"], stage.device_wait_s)
    return c


def _step_kinds(stages: list[StageStats]):
    """Steps and their seconds by kind: a slow point tells slow prefill chunks from slow decode steps."""
    steps = CounterMetricFamily("omnirt_stage_steps", "Steps by stage and kind (prefill: a step of prompt "
                                "chunks; decode)", labels=["stage", "kind"])
    seconds = CounterMetricFamily("omnirt_stage_kind_seconds", "Seconds inside steps, by stage and kind",
                                  labels=["stage", "kind"])
    for st in stages:
        num_steps = sum(st.batch_size_counts or [])
        steps.add_metric([st.name, "prefill"], num_steps - st.decode_steps)
        steps.add_metric([st.name, "decode"], st.decode_steps)
        seconds.add_metric([st.name, "prefill"], st.busy_s - st.decode_busy_s)
        seconds.add_metric([st.name, "decode"], st.decode_busy_s)
    yield from (steps, seconds)


def _allocator(counters: dict[str, int]):
    """The engine process's device allocator (none on the CPU): retries and device allocations while serving
    stall every stage thread."""
    if not counters:
        return
    yield CounterMetricFamily("omnirt_device_alloc_retries", "Allocations the device allocator retried after "
                              "freeing its cache (each synchronises the device)", value=counters["alloc_retries"])
    yield CounterMetricFamily("omnirt_device_allocs", "Device memory allocations (cudaMalloc) by the allocator",
                              value=counters["device_allocs"])
    yield GaugeMetricFamily("omnirt_device_reserved_bytes", "Device memory the allocator holds",
                            value=counters["reserved_bytes"])


def _prefix_reuse(stages: list[StageStats]):
    """Prompt tokens prefilled against those reused from resident slots, and what the resident slots hold."""
    tokens = CounterMetricFamily("omnirt_stage_prefill_tokens", "Prompt tokens by stage: computed by prefill "
                                 "steps, or reused from a resident slot's KV (prefix reuse)",
                                 labels=["stage", "source"])
    resident = GaugeMetricFamily("omnirt_stage_resident_slots", "KV slots holding an ended request's prefix for "
                                 "reuse (counted as free: given up when a slot is needed)", labels=["stage"])
    held = GaugeMetricFamily("omnirt_stage_resident_bytes", "Memory resident slots keep beyond the KV cache",
                             labels=["stage"])
    offloaded = GaugeMetricFamily("omnirt_stage_offloaded_prefixes", "Resident slots' prefixes given up for a "
                                  "slot and kept in host memory (kv_offload_gib)", labels=["stage"])
    offloaded_bytes = GaugeMetricFamily("omnirt_stage_offloaded_bytes", "Host memory those prefixes take",
                                        labels=["stage"])
    restored = CounterMetricFamily("omnirt_stage_restored_tokens", "Prompt tokens copied back into a slot from "
                                   "host memory (counted in the cached ones)", labels=["stage"])
    placed = CounterMetricFamily("omnirt_stage_placements", "Requests by how they got their KV slot: fresh (no "
                                 "prefix to reuse), taken_over or copied (a resident prefix), restored (from host "
                                 "memory)", labels=["stage", "how"])
    given_up = CounterMetricFamily("omnirt_stage_given_up_slots", "Resident slots given up for another request "
                                   "(their prefix kept in host memory only with kv_offload_gib)", labels=["stage"])
    for st in stages:
        for how, n in (st.placements or {}).items():
            placed.add_metric([st.name, how], n)
        given_up.add_metric([st.name], st.given_up)
        tokens.add_metric([st.name, "computed"], st.prefill_tokens)
        tokens.add_metric([st.name, "cached"], st.cached_tokens)
        resident.add_metric([st.name], st.resident_slots)
        held.add_metric([st.name], st.resident_bytes)
        offloaded.add_metric([st.name], st.offloaded)
        offloaded_bytes.add_metric([st.name], st.offloaded_bytes)
        restored.add_metric([st.name], st.restored_tokens)
    yield from (tokens, resident, held, offloaded, offloaded_bytes, restored, placed, given_up)


def _waits(stages: list[StageStats]):
    """How long runnable requests waited for a step (the first-packet priority's effect, and its aging bound)."""
    first = SummaryMetricFamily("omnirt_stage_first_step_wait_steps", "Steps of a stage a request could have run "
                                "in before its first one there (a slot, or a place in a full step)", labels=["stage"])
    longest = GaugeMetricFamily("omnirt_stage_max_wait_steps", "The most steps a runnable request waited between "
                                "two of its steps (since start)", labels=["stage"])
    deferred = CounterMetricFamily("omnirt_stage_deferred_rows", "Runnable requests holding a slot that a step had "
                                   "no room for (rows or token budget)", labels=["stage"])
    for st in stages:
        first.add_metric([st.name], st.first_steps, st.first_wait_steps)
        longest.add_metric([st.name], st.max_wait_steps)
        deferred.add_metric([st.name], st.deferred_rows)
    yield from (first, longest, deferred)


class StatusCounter:
    """Counts every HTTP response by status, and errors by OpenAI type (pure ASGI, sees 401/413 too)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                code = message["status"]
                self.metrics.http.labels(str(code)).inc()
                if code >= 400:
                    self.metrics.errors.labels(error_type(code)).inc()
            await send(message)

        return await self.app(scope, receive, counting_send)


class VadCollector:
    def __init__(self, vad):
        self.vad = vad

    def collect(self):
        yield CounterMetricFamily("omnirt_vad_windows", "32 ms windows of input audio the server VAD evaluated, "
                                  "all sessions", value=self.vad.num_windows)
        yield CounterMetricFamily("omnirt_vad_model_calls", "Batched VAD model calls (windows / calls: the mean "
                                  "number of sessions per call)", value=self.vad.num_calls)
        yield CounterMetricFamily("omnirt_vad_windows_silent", "32 ms windows 60 dB or more below full scale: "
                                  "silence without a VAD model call, all sessions", value=self.vad.num_silent)
        yield CounterMetricFamily("omnirt_turn_end_pauses", "Pauses semantic_vad asked its end-of-turn model "
                                  "about, all sessions", value=self.vad.turn_end.num_turns)
        yield CounterMetricFamily("omnirt_turn_end_model_calls", "Batched end-of-turn model calls (pauses / calls: "
                                  "the mean number of sessions per call)", value=self.vad.turn_end.num_calls)
        yield CounterMetricFamily("omnirt_denoise_chunks", "Input audio chunks noise reduction denoised, all "
                                  "sessions", value=self.vad.denoise.num_chunks)


class FrontEndCollector:
    def __init__(self, load, worker: str):
        self.load, self.worker = load, worker

    def collect(self):
        figures = self.load.figures()
        for name, text, value in (
                ("loop_lag_seconds", "How late the API process's event loop runs its callbacks (smoothed)",
                 figures.loop_lag_ms / 1000),
                ("vad_backlog_seconds", "How long the oldest audio waiting for the batched VAD has waited (smoothed)",
                 figures.vad_backlog_ms / 1000),
                ("vad_waiting", "Sessions whose audio waits for the batched VAD now", figures.vad_waiting),
                ("admitting", "1 while new Realtime sessions are let in, 0 while the front end's load refuses them "
                 "(the deploy profile's front_end limits)", float(figures.is_admitting))):
            gauge = GaugeMetricFamily(f"omnirt_front_end_{name}", text, labels=["worker"])
            gauge.add_metric([self.worker], value)
            yield gauge
