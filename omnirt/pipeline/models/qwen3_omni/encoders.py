"""The Thinker's audio and vision encoders over a prefill step's new requests: one encoder call per modality
for the whole step, each prompt's audios (images) from where a prefix taken from a resident slot ends (the slot
kept the rows before it): from the first audio (image) not wholly inside it, and within that audio from its first
encoder window not wholly inside it (a speculative prefill's prefix ends inside the audio still being spoken;
the encoder's windows are independent of each other: `audio_windows.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnirt.pipeline.models.qwen3_omni.prompt import EncodedPrompt


@dataclass(slots=True)
class VisualRows:
    """A prompt's image rows from its first encoded image on: what goes into the embeddings at its placeholders,
    and the deepstack rows that the first decoder layers add to their output there."""

    positions: torch.Tensor  # [V] prompt positions of the placeholders (host)
    embeds: torch.Tensor  # [V, H]
    deepstack: torch.Tensor  # [num_deepstack_layers, V, H]


def num_encoded(spans: tuple[tuple[int, int], ...], num_cached: int) -> int:
    """How many of the spans lie wholly inside the first `num_cached` positions (their rows are cached)."""
    return sum(end <= num_cached for _, end in spans)


@dataclass(slots=True, frozen=True)
class AudioStart:
    """Where a prompt's audio rows still to encode begin: audio `first`, from its frame `skip_frames` (its
    `skip_tokens` placeholders before it lie in whole encoder windows inside the cached prefix)."""

    first: int = 0
    skip_frames: int = 0
    skip_tokens: int = 0

    @classmethod
    def after(cls, prompt: EncodedPrompt, num_cached: int, window_frames: int, window_tokens: int) -> AudioStart:
        first = num_encoded(prompt.audio_spans, num_cached)
        if first == len(prompt.audio_spans):
            return cls(first)
        windows = max(0, num_cached - prompt.audio_spans[first][0]) // window_tokens
        return cls(first, windows * window_frames, windows * window_tokens)


def encode_audio(thinker, device: torch.device, prompts: list[EncodedPrompt], starts: list[AudioStart]
                 ) -> list[torch.Tensor | None]:
    """Per prompt, the token rows [n, H] of its audios from `starts[i]` on (None without any)."""
    todo = [(p, s) for p, s in zip(prompts, starts) if _has_more(p.input_features, s.first)]
    if not todo:
        return [None] * len(prompts)
    frames = max(p.input_features.shape[-1] for p, _ in todo)
    features = torch.cat([_from(p.input_features, s, frames) for p, s in todo]).to(device, thinker.dtype)
    mask = torch.cat([_from(p.feature_mask, s, frames) for p, s in todo]).to(device)
    rows = thinker.model.get_audio_features(features, mask, return_dict=True).last_hidden_state
    parts = iter(rows.split([sum(b - a for a, b in p.audio_spans[s.first:]) - s.skip_tokens for p, s in todo]))
    return [next(parts) if _has_more(p.input_features, s.first) else None for p, s in zip(prompts, starts)]


def _from(per_audio: torch.Tensor, start: AudioStart, frames: int) -> torch.Tensor:
    """Audios `start.first`.. of [audios, ..., frames] features (or mask), the first without its
    `start.skip_frames` leading frames, each padded after to `frames`."""
    out = per_audio[start.first:]
    if start.skip_frames:
        out = torch.cat([torch.nn.functional.pad(out[:1, ..., start.skip_frames:], (0, start.skip_frames)), out[1:]])
    return torch.nn.functional.pad(out, (0, frames - out.shape[-1]))


def encode_images(thinker, device: torch.device, prompts: list[EncodedPrompt], firsts: list[int]
                  ) -> list[VisualRows | None]:
    """Per prompt, the rows of its images from index `firsts[i]` on (None without any), from one call of the
    vision encoder (`get_image_features`: the merged patches, and each deepstack layer's)."""
    todo = [(p, k) for p, k in zip(prompts, firsts) if _has_more(p.image_grid_thw, k)]
    if not todo:
        return [None] * len(prompts)
    inputs = [p.image_pixels(k) for p, k in todo]
    pixel_values = torch.cat([v for v, _ in inputs]).to(device)
    grid = torch.cat([g for _, g in inputs]).to(device)
    out = thinker.model.get_image_features(pixel_values, grid, return_dict=True)
    embeds, deepstack = iter(out.pooler_output), [iter(layer) for layer in out.deepstack_features]

    def rows(p: EncodedPrompt, k: int) -> VisualRows:
        n = len(p.image_grid_thw) - k
        at = torch.cat([torch.arange(a, b) for a, b in p.image_spans[k:]])
        return VisualRows(at, torch.cat([next(embeds) for _ in range(n)]),
                          torch.stack([torch.cat([next(layer) for _ in range(n)]) for layer in deepstack]))

    done = iter([rows(p, k) for p, k in todo])
    return [next(done) if _has_more(p.image_grid_thw, k) else None for p, k in zip(prompts, firsts)]


def _has_more(items: torch.Tensor | None, first: int) -> bool:
    return items is not None and first < len(items)
