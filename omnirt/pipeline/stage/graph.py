"""The stage graph as data: a model package declares its stages in order (`StageGraph`), and the engine,
the replica pools and the workers build and route by it without knowing the model.

Each node says how its stage is built, what its outputs mean to the client (text tokens, audio,
usage), which request field holds its sampling overrides, and how many tokens the stage puts in
front of the request's prompt. Requests that want audio run through every stage; text-only ones
stop after the first, whose finish reason and token count are the request's. `LoadedModels` is what a
model family's `load()` gives the engine: the graph, and what the engine asks of the model besides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from omnirt.pipeline.config import EngineConfig
from omnirt.pipeline.platform import Platform
from omnirt.pipeline.stage.grammar import Grammars
from omnirt.pipeline.stage.protocols import Runner, Scheduler, StageControl
from omnirt.pipeline.stage.request import StageRequest
from omnirt.pipeline.stage.sampling import SamplingParams
from omnirt.pipeline.stage.step import StageOutput


@dataclass(slots=True, frozen=True)
class TextTokens:
    """Text tokens of the reply, for the client (detokenised on the consumer's side)."""

    token_ids: list[int]


@dataclass(slots=True, frozen=True)
class AudioPcm:
    """Audio of the reply, for the client: mono little-endian int16 at the model's output rate."""

    pcm16: bytes


ClientOutput = TextTokens | AudioPcm  # what a stage's output means to the client (`StageNode.to_client`)


@dataclass(slots=True)
class StageParts:
    """A stage's pieces, built from the config and the models: the scheduler, the runner, and how an
    upstream chunk (`on_input`) or the upstream's end (`on_input_done(stage, request)`) is applied."""

    scheduler: Scheduler
    runner: Runner
    on_input: Callable[[StageRequest, Any], None] | None = None
    on_input_done: Callable[[StageControl, StageRequest], None] | None = None


def _nothing(out: StageOutput) -> None:
    return None


@dataclass(slots=True, frozen=True)
class StageNode:
    name: str
    build: Callable[[EngineConfig, LoadedModels], StageParts]  # the stage's pieces
    to_client: Callable[[StageOutput], ClientOutput | None] = _nothing
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


class Generated(NamedTuple):
    """A whole reply of the model's own reference implementation (transformers' `generate()`)."""

    token_ids: list[int]  # the reply's text tokens (its end marker left out)
    num_tokens: int  # tokens it sampled, the end marker included
    stopped: bool  # it ended at its end marker (else at its token limit)
    pcm16: bytes  # its audio (b"": none)
    num_frames: int  # codec frames behind that audio


class LoadedModels(Protocol):
    """What a model family's `load()` gives the engine (`omnirt/pipeline/models/`): the stage graph, the prompt encoder
    and the model's facts, its constrained decoding and tool calls, and its reference `generate()`."""

    graph: StageGraph
    # .encode(messages, tools) -> an encoded prompt (input_ids, message_tokens, ...); .encode_settled(messages,
    # tools) -> the prompt of a turn still being spoken, or None; .windows: its audio encoder's windows
    # (.window_samples, .lookahead_samples)
    encoder: Any
    voices: dict[str, int]  # voice name -> the model's speaker id
    tokenizer: Any  # .decode(token_ids, skip_special_tokens=...)
    grammars: Grammars | None
    platform: Platform

    @property
    def input_sample_rate(self) -> int: ...

    @property
    def output_sample_rate(self) -> int: ...

    def tool_parser(self) -> Any: ...

    def tool_call_spec(self, tools: list[dict], tool_choice: str | dict, parallel: bool) -> dict: ...

    def capture_cuda_graphs(self) -> None: ...

    def generate(self, prompt: Any, voice: str | None, params: dict[str, SamplingParams]) -> Generated: ...
