"""The Thinker's audio and vision encoders over a prefill step's new requests: one encoder call per modality
for the whole step, each prompt's audios (images) from where a prefix taken from a resident slot ends (the slot
kept the rows before it): from the first audio (image) not wholly inside it, and within that audio from its first
encoder window not wholly inside it (a speculative prefill's prefix ends inside the audio still being spoken;
the encoder's windows are independent of each other: `audio_windows.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.modeling_utils import AttentionInterface
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
    get_audio_cu_seqlens,
)

from omnirt.pipeline.models.qwen3_omni.prompt import EncodedPrompt


@dataclass(slots=True)
class VisualRows:
    """A prompt's image rows from its first encoded image on: what goes into the embeddings at its placeholders,
    and the deepstack rows that the first decoder layers add to their output there."""

    positions: torch.Tensor  # [V] prompt positions of the placeholders (host)
    embeds: torch.Tensor  # [V, H]
    deepstack: torch.Tensor  # [num_deepstack_layers, V, H]

# the audio encoder's attention: each window of each audio is its own call, of a length new to the process as often
# as not, and cuDNN's attention (SDPA's first choice on an H100) spent ~1 ms of host time on each such call, 32 a
# window: 222 of the 266 ms that 7 spoken turns' first prefill step took (docs/benchmarks.md, "What bounds capacity")
ENCODER_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    features = torch.cat([_from(p.input_features, s, frames) for p, s in todo])
    mask = torch.cat([_from(p.feature_mask, s, frames) for p, s in todo])
    rows = audio_tower_rows(thinker.model.audio_tower, features, mask, device, thinker.dtype)
    parts = iter(rows.split([sum(b - a for a, b in p.audio_spans[s.first:]) - s.skip_tokens for p, s in todo]))
    return [next(parts) if _has_more(p.input_features, s.first) else None for p, s in zip(prompts, starts)]


def audio_tower_rows(tower, features: torch.Tensor, mask: torch.Tensor, device: torch.device, dtype: torch.dtype,
                     one_call: bool | None = None) -> torch.Tensor:
    """The audio encoder's rows [tokens, H] for `features` [audios, mel, frames] and `mask` [audios, frames] (host
    tensors), as transformers' `get_audio_features` computes them (bit for bit on the CPU), with every length worked
    out on the host. With `one_call` (the default off the CPU where there is more than one window) each layer attends
    over all the windows in one call (`AudioWindows`); otherwise per window, as transformers does, on flash or
    memory-efficient kernels (not cuDNN's: `ENCODER_ATTENTION`). One window alone gains nothing from the padded batch
    and pays for its gathers (on an H100, rows ready after 15.2 against 12.8 ms for a 1.4 s utterance; for 8
    utterances 29.7 against 29.0 ms idle, 79.6 against 83.3 ms beside a busy stream: docs/benchmarks.md).

    Why: given device tensors, transformers' encoder reads their lengths back to the host about 45 times a call
    (the chunking, the valid positions, the attention windows, and each of its 32 layers' window split), and each
    read waits for the device to finish the encoder's work so far. The encoder takes these precomputed values
    (`padded_feature`, `chunk_lengths`, `valid_indices`, `cu_seqlens`, `max_seqlen`); with the windows' bounds
    left on the host, its layers split by them without asking the device."""
    lens = mask.sum(-1)
    packed = features.permute(0, 2, 1)[mask.bool()]  # [frames of all audios, mel]
    chunk = 2 * tower.n_window
    chunk_lengths = torch.tensor([min(chunk, n - a) for n in lens.tolist() for a in range(0, n, chunk)])
    padded = torch.nn.utils.rnn.pad_sequence(packed.split(chunk_lengths.tolist()), batch_first=True).transpose(1, 2)
    after_cnn = _get_feat_extract_output_lengths(chunk_lengths, tower.n_window)
    valid = (torch.arange(int(after_cnn.max())) < after_cnn[:, None]).flatten().nonzero().squeeze(-1)
    cu_seqlens = get_audio_cu_seqlens(chunk_lengths, lens, tower.n_window_infer, tower.n_window)
    one_call = attends_in_one_call(device, len(cu_seqlens) - 1) if one_call is None else one_call
    flash = "flash" in (tower.config._attn_implementation or "")  # flash attention reads the bounds on the device
    bounds = AudioWindows.of(cu_seqlens, device) if one_call else cu_seqlens.to(device) if flash else cu_seqlens
    with sdpa_kernel(ENCODER_ATTENTION), _attention(tower, AudioWindows.NAME if one_call else None):
        return tower(padded_feature=padded.to(device, dtype), chunk_lengths=chunk_lengths,
                     valid_indices=valid.to(device), cu_seqlens=bounds,
                     max_seqlen=int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), return_dict=True).last_hidden_state


def attends_in_one_call(device: torch.device, num_windows: int) -> bool:
    """The default of `audio_tower_rows`: one call a layer for several windows on an accelerator (the CPU keeps
    transformers' path, bit for bit)."""
    return device.type != "cpu" and num_windows > 1


@dataclass(slots=True, frozen=True)
class AudioWindows:
    """The audio encoder's attention windows as one padded batch [windows, longest window], so that each layer
    attends in one call: one window a call (transformers' way with SDPA) is ~5 kernel launches a window, 32 layers
    a spoken turn's window, and host time is what a prefill step with speech in it waits on.

    It stands in for `cu_seqlens` in the encoder's call: an attention implementation whose name holds "flash" gets the
    windows' bounds whole (transformers' varlen branch), and `attend` is that implementation."""

    NAME = "omnirt_flash_windows"  # "flash": transformers' varlen branch; the kernels are SDPA's

    gather: torch.Tensor  # [W, L] the token at each padded position (padding: token 0, masked)
    keep: torch.Tensor  # [W, 1, 1, L] a real token (the keys a window's queries attend to)
    scatter: torch.Tensor  # [tokens] each token's position in the flattened [W * L] batch

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, device: torch.device) -> AudioWindows:
        """From the windows' bounds (host), moved to `device` once for every layer."""
        starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
        offsets = torch.arange(int(lengths.max()))
        real = offsets < lengths[:, None]
        gather = torch.where(real, starts[:, None] + offsets, 0)
        return cls(gather.to(device), real[:, None, None].to(device), real.flatten().nonzero().squeeze(-1).to(device))

    @staticmethod
    def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
               scaling: float | None = None, dropout: float = 0.0, cu_seq_lens_q: AudioWindows | None = None,
               **_) -> tuple[torch.Tensor, None]:
        """transformers' attention interface: [1, heads, tokens, head_dim] in, [tokens, heads, head_dim] out."""
        w = cu_seq_lens_q
        q, k, v = (t[0][:, w.gather].transpose(0, 1) for t in (query, key, value))  # [W, heads, L, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=w.keep, scale=scaling)
        return out.transpose(1, 2).flatten(0, 1)[w.scatter], None


AttentionInterface.register(AudioWindows.NAME, AudioWindows.attend)


@contextlib.contextmanager
def _attention(tower, name: str | None) -> Iterator[None]:
    """The encoder's attention implementation `name` for one call (None: its own); the module stays transformers'
    everywhere else (the reference engine and the parity tests call it as transformers does)."""
    if name is None:
        yield
        return
    config, own = tower.config, tower.config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = own


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
