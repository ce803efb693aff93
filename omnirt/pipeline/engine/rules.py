"""The rules every engine applies to a request before it runs: its voice, the tools its prompt lists, the
grammar that constrains its reply, its sampling per stage, the context's limit and truncation; and the facts
an engine reports about itself (`EngineInfo`)."""

from __future__ import annotations

from omnirt.pipeline.config import EngineConfig
from omnirt.pipeline.stage.grammar import response_format_spec
from omnirt.pipeline.stage.graph import LoadedModels
from omnirt.pipeline.stage.sampling import SamplingError, SamplingParams, numerically_safe
from omnirt.pipeline.types import EngineInfo, FrontEndLimits, OmniRequest, RequestError, StageLimit


class RequestRules:
    """What every engine behind the API (the engine, the reference) applies to a request before it runs, and
    the facts it reports about itself. Engines hold one: they share it, not a base class."""

    def __init__(self, cfg: EngineConfig, models: LoadedModels):
        self.cfg, self.models = cfg, models

    @property
    def voices(self) -> list[str]:
        return sorted(self.models.voices)

    def info(self, kind: str) -> EngineInfo:
        graph = self.models.graph
        windows = self.models.encoder.windows
        limits = {n: StageLimit(self.cfg.stage(n).max_num_seqs, self.cfg.stage(n).max_waiting) for n in graph.names}
        return EngineInfo(self.cfg.model, tuple(self.voices), self.cfg.default_voice, self.cfg.system_prompt,
                          graph.has_audio_output, self.models.input_sample_rate,
                          self.models.output_sample_rate, limits, self.cfg.retry_after_s,
                          self.cfg.max_output_buffer_bytes, kind, self.cfg.platform, self.cfg.voice_aliases,
                          tuple(self.cfg.model_aliases),
                          FrontEndLimits(self.cfg.front_end.max_loop_lag_ms, self.cfg.front_end.max_vad_backlog_ms),
                          windows.window_samples, windows.lookahead_samples)

    def check_voice(self, req: OmniRequest) -> str | None:
        if not req.wants_audio:
            return None
        if not self.models.graph.has_audio_output:
            raise RequestError("this model has no audio output", "modalities")
        voice = (req.voice or self.cfg.default_voice).lower()
        voice = self.cfg.voice_aliases.get(voice, voice)
        if voice not in self.models.voices:
            aliases = f" (or {', '.join(self.cfg.voice_aliases)})" if self.cfg.voice_aliases else ""
            raise RequestError(f"unknown voice {req.voice!r}; available: {', '.join(self.voices)}{aliases}", "voice",
                               "invalid_voice")
        return voice

    @staticmethod
    def prompt_tools(req: OmniRequest) -> list[dict]:
        """The tools the prompt lists: none with tool_choice "none", so the model cannot call one."""
        return [] if req.tool_choice == "none" else req.tools

    @staticmethod
    def forces_calls(req: OmniRequest) -> bool:
        return bool(req.tools) and req.tool_choice not in ("auto", "none")

    def is_constrained(self, req: OmniRequest) -> bool:
        return self.forces_calls(req) or response_format_spec(req.response_format) is not None

    def constraint_spec(self, req: OmniRequest) -> dict | None:
        """The grammar the reply must follow: forced tool calls, else the response format, else none."""
        if self.forces_calls(req):
            return self.models.tool_call_spec(req.tools, req.tool_choice, req.parallel_tool_calls)
        return response_format_spec(req.response_format)

    def all_params(self, req: OmniRequest, num_prompt: int) -> dict[str, SamplingParams]:
        """Sampling parameters per stage on the request's path; RequestError if one cannot be served."""
        out = {}
        for name in self.models.graph.path(req.wants_audio):
            node = self.models.graph.node(name)
            if node.sampling_field is not None:
                params = self.params(name, getattr(req, node.sampling_field), num_prompt + node.prefix_tokens)
                out[name] = params.merged(forced=tuple(req.forced[name])) if name in req.forced else params
        return out

    def prompt_limit(self, req: OmniRequest) -> int:
        """The longest prompt every stage on the request's path can take and still have its output budget:
        the requested (or default) max_tokens, at most a quarter of the stage's context."""
        limits = []
        for name in self.models.graph.path(req.wants_audio):
            node, cfg = self.models.graph.node(name), self.cfg.stage(name)
            if node.sampling_field is not None:
                wanted = getattr(req, node.sampling_field).get("max_tokens")
                budget = wanted if isinstance(wanted, int) and wanted > 0 else \
                    cfg.default_sampling_params.get("max_tokens", SamplingParams().max_tokens)
                limits.append(cfg.max_model_len - node.prefix_tokens - min(budget, cfg.max_model_len // 4))
        return min(limits)

    def truncated(self, req: OmniRequest, message_tokens: list[int] | None) -> tuple[list[dict], int]:
        """The messages to encode, and how many of the oldest conversation messages (after the leading
        system ones) they leave out so that the prompt fits `req.truncation` of the room left for them;
        never the last message (a prompt whose last message alone does not fit fails as without truncation)."""
        first = _num_leading_system(req.messages)
        if message_tokens is None or len(message_tokens) != len(req.messages) + 1:
            return req.messages, 0  # the rendering's message boundaries are not known: no truncation
        limit = self.prompt_limit(req)
        if sum(message_tokens) <= limit:
            return req.messages, 0
        fixed = sum(message_tokens[:first]) + message_tokens[-1]  # instructions and the assistant header
        target, conversation = req.truncation * (limit - fixed), message_tokens[first:-1]
        dropped, kept = 0, sum(conversation)
        while kept > target and dropped < len(conversation) - 1:
            kept -= conversation[dropped]
            dropped += 1
        return req.messages[:first] + req.messages[first + dropped:], dropped

    def params(self, stage: str, overrides: dict, num_prompt: int) -> SamplingParams:
        cfg = self.cfg.stage(stage)
        room = cfg.max_model_len - num_prompt
        if room < 1:
            raise RequestError(f"the prompt is {num_prompt} tokens; the {stage} context holds "
                               f"{cfg.max_model_len}", "messages", "context_length_exceeded")
        try:
            if "forced" in overrides:  # the engine's own (teacher forcing), not a client's
                raise TypeError("forced is not a sampling parameter")
            params = SamplingParams(**cfg.default_sampling_params).merged(**overrides)
        except (AssertionError, TypeError) as exc:
            raise RequestError(f"bad sampling parameters: {exc}", "sampling") from exc
        try:
            params = numerically_safe(params)
        except SamplingError as exc:
            raise RequestError(str(exc), exc.param) from exc
        return params.merged(max_tokens=min(params.max_tokens, room))


def _num_leading_system(messages: list[dict]) -> int:
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    return n
