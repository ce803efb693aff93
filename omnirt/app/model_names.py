"""The names a request may give the served model: its own (`--served-model-name`, else the model) and the
deploy profile's `model_aliases`, names or fnmatch patterns such as OpenAI's `gpt-realtime*`, so that code
written for OpenAI's realtime and audio models runs unchanged. One rule for every route that checks a model
name (Realtime connect and `session.update`, client secrets, chat completions) and for `GET /v1/models`.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

# OpenAI's realtime and audio models (the openai SDK's names for them): what `GET /v1/models` lists of the
# aliases' patterns, which cannot be listed themselves
OPENAI_MODELS = (
    "gpt-realtime", "gpt-realtime-2025-08-28", "gpt-realtime-1.5", "gpt-realtime-2", "gpt-realtime-2.1",
    "gpt-realtime-2.1-mini", "gpt-realtime-mini", "gpt-realtime-mini-2025-10-06", "gpt-realtime-mini-2025-12-15",
    "gpt-4o-realtime-preview", "gpt-4o-realtime-preview-2024-10-01", "gpt-4o-realtime-preview-2024-12-17",
    "gpt-4o-realtime-preview-2025-06-03", "gpt-4o-mini-realtime-preview", "gpt-4o-mini-realtime-preview-2024-12-17",
    "gpt-audio", "gpt-audio-2025-08-28", "gpt-audio-1.5", "gpt-audio-mini", "gpt-audio-mini-2025-10-06",
    "gpt-audio-mini-2025-12-15", "gpt-4o-audio-preview", "gpt-4o-audio-preview-2024-10-01",
    "gpt-4o-audio-preview-2024-12-17", "gpt-4o-audio-preview-2025-06-03", "gpt-4o-mini-audio-preview",
    "gpt-4o-mini-audio-preview-2024-12-17",
)


def is_alias(name: str, aliases: tuple[str, ...]) -> bool:
    """Whether `name` is one of the aliases or matches one of their patterns (case-insensitive)."""
    return any(fnmatchcase(name.lower(), alias) for alias in aliases)


def served_model(name: str, served: tuple[str, ...], aliases: tuple[str, ...]) -> str | None:
    """The served model a request naming `name` gets (an alias gets the first served name); None: none."""
    if name in served:
        return name
    return served[0] if is_alias(name, aliases) else None


def listed_models(served: tuple[str, ...], aliases: tuple[str, ...]) -> list[str]:
    """What `GET /v1/models` lists: the served names, then each alias that is a plain name, then OpenAI's
    models the patterns cover."""
    plain = [a for a in aliases if not any(c in a for c in "*?[")]
    names = [*served, *plain, *(m for m in OPENAI_MODELS if is_alias(m, aliases))]
    return list(dict.fromkeys(names))
