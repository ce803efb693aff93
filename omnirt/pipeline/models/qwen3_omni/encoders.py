"""The Thinker's audio and vision encoders over a prefill step's new requests: one encoder call per modality
for the whole step, each prompt's audios (images) from index `firsts[i]` on (those inside a prefix taken from a
resident slot are not encoded again: the slot kept their rows)."""

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


def encode_audio(thinker, device: torch.device, prompts: list[EncodedPrompt], firsts: list[int]
                 ) -> list[torch.Tensor | None]:
    """Per prompt, the token rows [n, H] of its audios from index `firsts[i]` on (None without any)."""
    todo = [(p, k) for p, k in zip(prompts, firsts) if _has_more(p.input_features, k)]
    if not todo:
        return [None] * len(prompts)
    frames = max(p.input_features.shape[-1] for p, _ in todo)
    features = torch.cat([torch.nn.functional.pad(p.input_features[k:], (0, frames - p.input_features.shape[-1]))
                          for p, k in todo]).to(device, thinker.dtype)
    mask = torch.cat([torch.nn.functional.pad(p.feature_mask[k:], (0, frames - p.feature_mask.shape[-1]))
                      for p, k in todo]).to(device)
    rows = thinker.model.get_audio_features(features, mask, return_dict=True).last_hidden_state
    parts = iter(rows.split([sum(b - a for a, b in p.audio_spans[k:]) for p, k in todo]))
    return [next(parts) if _has_more(p.input_features, k) else None for p, k in zip(prompts, firsts)]


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
