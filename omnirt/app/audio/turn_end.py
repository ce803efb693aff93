"""`semantic_vad`: whether the user has finished speaking, from the words and their melody, not the silence alone.

Silero (`omnirt/app/audio/vad.py`) still finds speech and pauses; at a short pause (a *candidate*: the eagerness's
`candidate_pause_ms` of silence after speech) the turn's last 8 s go to Smart Turn v3.2 (pipecat-ai/smart-turn,
BSD-2-Clause: a Whisper-encoder classifier, ONNX, 8.7 MB, vendored in `omnirt/app/audio/data/` with its licence and
checked against its sha256 at load). Its probability that the turn is complete ends the turn when it reaches the
eagerness's `threshold`; otherwise the turn goes on, and ends anyway once the pause has lasted the eagerness's
`max_pause_ms` (OpenAI's documented maximum timeouts: 8 s / 4 s / 2 s for low / medium / high; auto is medium).
Speech resuming within the pause makes the next pause a candidate again.

`TurnEndBatcher` evaluates the candidates of every session of the process together: one onnxruntime call per
round for all sessions with a pause pending, on a thread of its own (a call costs ~45 ms of a CPU core per
candidate, the features ~4 ms of it, and a batch saves little: it must not share Silero's thread, whose windows are
due every 32 ms). onnxruntime spreads a call over up to `MAX_THREADS` cores.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
from dataclasses import dataclass

import numpy as np

from omnirt.app.audio.log_mel import fit, log_mel
from omnirt.app.audio.rounds import Rounds

MODEL_FILE = "smart-turn-v3.2-cpu.onnx"
MODEL_SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"
EAGERNESS_LEVELS = ("low", "medium", "high", "auto")
MAX_THREADS = 4  # onnxruntime's threads for one call (at most the CPU count): ~45 ms a pause on one core, ~25 on two


@dataclass(slots=True, frozen=True)
class Eagerness:
    """How eagerly a pause ends the turn: Smart Turn's probability that is enough, the pause after which it is
    asked, and the pause that ends the turn whatever it said."""

    threshold: float
    candidate_pause_ms: int
    max_pause_ms: int


EAGERNESS = {"low": Eagerness(0.8, 300, 8000), "medium": Eagerness(0.5, 200, 4000),
             "high": Eagerness(0.3, 200, 2000)}


@dataclass(slots=True, frozen=True)
class SemanticVadConfig:
    """OpenAI's `turn_detection: {type: "semantic_vad", ...}` with its defaults. Silero's side (threshold, prefix
    padding) keeps server_vad's defaults; `silence_duration_ms` is the eagerness's longest pause."""

    eagerness: str = "auto"
    create_response: bool = True
    interrupt_response: bool = True
    threshold: float = 0.5  # Silero's speech threshold, as server_vad's default
    prefix_padding_ms: int = 300

    def __post_init__(self):
        if self.eagerness not in EAGERNESS_LEVELS:
            raise ValueError(f"eagerness must be one of {', '.join(EAGERNESS_LEVELS)}")

    @property
    def level(self) -> Eagerness:
        return EAGERNESS["medium" if self.eagerness == "auto" else self.eagerness]

    @property
    def silence_duration_ms(self) -> int:
        return self.level.max_pause_ms

    @property
    def candidate_pause_ms(self) -> int:
        return self.level.candidate_pause_ms

    @property
    def prefix_padding_samples(self) -> int:
        return self.prefix_padding_ms * 16000 // 1000


class SmartTurn:
    """Smart Turn v3.2 over onnxruntime: a batch of turns' audio -> the probability that each is complete."""

    def __init__(self):
        import onnxruntime  # loaded with the model, once a session first needs it

        model = (importlib.resources.files("omnirt.app.audio") / "data" / MODEL_FILE).read_bytes()
        if hashlib.sha256(model).hexdigest() != MODEL_SHA256:
            raise RuntimeError(f"omnirt/app/audio/data/{MODEL_FILE} is not the pinned Smart Turn v3.2 model (sha256)")
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = min(MAX_THREADS, os.cpu_count() or 1), 1
        self.session = onnxruntime.InferenceSession(model, opts, providers=["CPUExecutionProvider"])

    def complete_probability(self, turns: list[np.ndarray]) -> np.ndarray:
        """Each turn's 16 kHz audio (the last 8 s count) -> P(the speaker has finished), [B]: one model call. The
        features are made a turn at a time (a turn's STFT in float64 is ~5 MB; 64 at once would be ~330 MB)."""
        features = np.concatenate([log_mel(fit(t)[None]) for t in turns])
        return self.session.run(None, {"input_features": features})[0][:, 0]


@dataclass(slots=True, eq=False)
class _Job:
    audio: np.ndarray
    probability: float | None = None

    def is_pending(self) -> bool:
        return self.probability is None

    def result(self) -> float:
        return self.probability


class TurnEndBatcher:
    """The process's end-of-turn model: `await complete_probability(audio)` from any session; one model call per
    round for every session whose pause is pending."""

    def __init__(self):
        self._model: SmartTurn | None = None  # loaded on first use
        self._rounds = Rounds(self._round, "omnirt-turn-end")
        self.num_calls = self.num_turns = 0

    async def complete_probability(self, audio: np.ndarray) -> float:
        return await self._rounds.submit(_Job(audio))

    def _round(self, jobs: list[_Job]) -> None:
        if self._model is None:
            self._model = SmartTurn()
        probs = self._model.complete_probability([j.audio for j in jobs])
        self.num_calls += 1
        self.num_turns += len(jobs)
        for job, p in zip(jobs, probs):
            job.probability = float(p)
