"""The stage graph as data: a model package declares its stages in order (`StageGraph`), and the engine,
the replica pools and the workers build and route by it without knowing the model.

Each node says how its stage is built, what its outputs mean to the client (text tokens, audio,
usage), which request field holds its sampling overrides, and how many tokens the stage puts in
front of the request's prompt. Requests that want audio run through every stage; text-only ones
stop after the first, whose finish reason and token count are the request's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.stage.request import Output, StageRequest


@dataclass(slots=True)
class StageParts:
    """A stage's pieces, built from the config and the models: the scheduler, the runner, and how an
    upstream chunk (`on_input`) or the upstream's end (`on_input_done(stage, request)`) is applied."""

    scheduler: Any
    runner: Any
    on_input: Callable[[StageRequest, Any], None] | None = None
    on_input_done: Callable[[Any, StageRequest], None] | None = None


@dataclass(slots=True, frozen=True)
class StageNode:
    name: str
    build: Callable[[Any, Any], StageParts]  # (EngineConfig, models) -> the stage's pieces
    to_client: Callable[[Output], tuple | None] = lambda out: None  # ("tokens", [ids]) | ("audio", pcm16) | None
    counts_audio_frames: bool = False  # each payload it hands on is one frame of the reply's audio (usage)
    sampling_field: str | None = None  # the OmniRequest field with this stage's sampling overrides
    prefix_tokens: int = 0  # tokens this stage adds to the request's prompt (for the context check)
    needs_kv: bool = True  # holds a KV slot per request (counted in /health's slots)


@dataclass(slots=True, frozen=True)
class StageGraph:
    nodes: tuple[StageNode, ...]
    # (models, cfg, request, encoded prompt, voice, sampling params per stage) -> the request in each stage
    new_requests: Callable[..., dict[str, StageRequest]]

    def node(self, name: str) -> StageNode:
        return next(n for n in self.nodes if n.name == name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    @property
    def has_audio_output(self) -> bool:
        return len(self.nodes) > 1

    def path(self, wants_audio: bool) -> tuple[str, ...]:
        """The stages a request runs through."""
        return self.names if wants_audio else self.names[:1]

    def next_stage(self, name: str, wants_audio: bool) -> str | None:
        path = self.path(wants_audio)
        i = path.index(name)
        return path[i + 1] if i + 1 < len(path) else None
