"""Codec chunk pacing on simulated clocks: a listener who starts playing at the first packet never runs dry
while the Talker keeps up overall, and a fast Talker's first packet waits for no more than the small first
chunk. The stage is simulated as the engine runs it: one decode at a time, a poll at every frame and after
every decode."""

from __future__ import annotations

import dataclasses

import pytest

from omnirt.pipeline.models.qwen3_omni.codec_stream import CodecStream
from omnirt.pipeline.models.qwen3_omni.pacing import AdaptivePacing, FixedChunks

FRAME_S = 0.08
INITIAL, MAX_FRAMES, MARGIN_S = 4, 25, 0.16


@dataclasses.dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Played:
    first_packet_s: float  # when the first packet reached the listener
    chunk_sizes: list[int]
    min_queued_s: float  # the least audio the listener had left when a packet arrived (< 0: it ran dry)


def paced(gaps: list[float], start_s: float = 0.3) -> list[float]:
    """Arrival times of frames that come `gaps` apart after the first at `start_s`."""
    times = [start_s]
    for gap in gaps:
        times.append(times[-1] + gap)
    return times


def play(pacing, arrivals: list[float], decode_s: float = 0.03) -> Played:
    """The stage fed frames at `arrivals`, decoding each chunk for `decode_s`; the listener plays from the
    first packet on."""
    clock = Clock()
    stream = CodecStream(25, pacing, FRAME_S, clock=clock)
    packets: list[tuple[float, int]] = []  # (arrival, index of its first frame)
    i, busy_until, decoding = 0, None, 0
    while i < len(arrivals) or busy_until is not None:
        if busy_until is not None and (i == len(arrivals) or busy_until <= arrivals[i]):
            clock.now, busy_until = busy_until, None
            packets.append((clock.now, stream.num_emitted))
            stream.advance(decoding)
        else:
            clock.now = arrivals[i]
            stream.add([0] * 16)
            i += 1
            stream.input_done = i == len(arrivals)
        if busy_until is None and stream.is_ready():
            decoding, busy_until = stream.next_window()[1], clock.now + decode_s
    assert stream.is_drained() and stream.num_emitted == len(arrivals)
    t0 = packets[0][0]
    return Played(t0, stream.chunk_sizes, min(t0 + first * FRAME_S - t for t, first in packets[1:]))


def adaptive() -> AdaptivePacing:
    return AdaptivePacing(INITIAL, MAX_FRAMES, FRAME_S, MARGIN_S)


def ramp() -> FixedChunks:
    return FixedChunks(INITIAL, MAX_FRAMES, ramp=True)


FAST = paced([FRAME_S / 4] * 149)  # RTF 0.25
REAL_TIME = paced([FRAME_S] * 149)  # RTF 1.0
SLOW_START = paced([1.5 * FRAME_S] * 12 + [FRAME_S / 4] * 137)  # RTF 1.5 for 12 frames, then 0.25: 0.4 overall


@pytest.mark.parametrize("arrivals", [FAST, REAL_TIME, SLOW_START], ids=["fast", "real-time", "slow-start"])
def test_adaptive_pacing_never_lets_the_listener_run_dry_while_the_talker_keeps_up(arrivals):
    played = play(adaptive(), arrivals)
    assert played.min_queued_s >= 0
    assert sum(played.chunk_sizes) == len(arrivals) and max(played.chunk_sizes) <= MAX_FRAMES


def test_the_fixed_ramp_runs_dry_where_adaptive_pacing_does_not():
    """The failure the adaptive pacing removes: after a slow start, and at real time, the doubling ramp asks for
    more frames per chunk than the Talker has made by the time the listener needs them."""
    assert play(ramp(), SLOW_START).min_queued_s < 0
    assert play(ramp(), REAL_TIME).min_queued_s < 0
    assert play(ramp(), FAST).min_queued_s >= 0


def test_a_fast_talkers_first_packet_waits_only_for_the_small_first_chunk():
    played = play(adaptive(), FAST, decode_s=0.03)
    assert played.chunk_sizes[0] == INITIAL
    assert played.first_packet_s == pytest.approx(FAST[INITIAL - 1] + 0.03)
    assert played.first_packet_s == play(ramp(), FAST, decode_s=0.03).first_packet_s


def test_a_fast_talker_gets_chunks_that_grow_to_the_full_size():
    """Each chunk goes as late as is safe, so the chunks grow by about 1 / RTF each (4 times here) up to the
    full size: no more windows (re-decoded contexts) than the doubling ramp's."""
    sizes = play(adaptive(), FAST).chunk_sizes
    assert sizes[2] > 2 * sizes[1] and sizes.count(MAX_FRAMES) >= len(sizes) // 2
    assert len(sizes) <= len(play(ramp(), FAST).chunk_sizes) + 1


def test_a_slow_start_delays_the_first_chunk_for_lead_instead_of_stalling_later():
    played = play(adaptive(), SLOW_START)
    assert played.chunk_sizes[0] > INITIAL
    assert played.first_packet_s > play(ramp(), SLOW_START).first_packet_s


def test_a_talker_slower_than_real_time_throughout_waits_at_most_one_full_chunk():
    """No lead survives a Talker that never keeps up; the first chunk then waits for a full chunk, no longer."""
    assert play(adaptive(), paced([2 * FRAME_S] * 60)).chunk_sizes[0] == MAX_FRAMES


@pytest.mark.parametrize("arrivals", [FAST, REAL_TIME, SLOW_START], ids=["fast", "real-time", "slow-start"])
def test_slow_decodes_do_not_run_the_listener_dry(arrivals):
    assert play(adaptive(), arrivals, decode_s=0.2).min_queued_s >= 0


def test_decode_time_is_measured_and_kept_in_reserve():
    """A chunk that took long from its decision to its emission makes the next go earlier: two decode times
    (one step that may be running, and its own) are kept in reserve beyond the margin."""
    def after_first_chunk(decode_s: float) -> AdaptivePacing:
        pacing = adaptive()
        for i in range(5):
            pacing.on_frame(i * 0.02)
        pacing.on_sent(0.1, 0.1 + decode_s, INITIAL)
        return pacing

    lead_s = MARGIN_S + 0.1  # beyond the margin by more than the next frame's wait (0.02 s)
    assert after_first_chunk(0.01).frames_to_send(0.2, lead_s, 2, False) == 0
    assert after_first_chunk(0.2).frames_to_send(0.2, lead_s, 2, False) == 2


def test_decisions_are_kept_for_the_log(caplog):
    pacing = adaptive()
    with caplog.at_level("INFO", logger="omnirt.pipeline.models.qwen3_omni.codec_stream"):
        play(pacing, FAST)
    assert pacing.reasons[0] == "first" and pacing.reasons[-1] == "end" and "due" in pacing.reasons
    assert len(pacing.reasons) == pacing.num_chunks
    assert "adaptive pacing: first,due," in caplog.text and "least audio queued at a chunk" in caplog.text


def test_a_requests_first_chunk_larger_than_the_steady_chunk_is_honoured():
    """`initial_codec_chunk_frames` of a request may ask for more than `codec_chunk_frames`: the first chunk
    holds that many, the later ones at most the steady size."""
    sizes = play(AdaptivePacing(40, MAX_FRAMES, FRAME_S, MARGIN_S), FAST).chunk_sizes
    assert sizes[0] == 40 and max(sizes[1:]) <= MAX_FRAMES
