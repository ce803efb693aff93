"""Chat messages -> Qwen3-Omni thinker inputs (ChatML ids with expanded audio placeholders + mel features)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from pipeline.api import Message

INPUT_SAMPLE_RATE = 16000
N_FFT = 400  # the STFT window; its reflect padding needs more input than half of it


@dataclass(slots=True)
class EncodedPrompt:
    input_ids: list[int]
    input_features: torch.Tensor | None = None  # [num_audios, mel, frames]
    feature_mask: torch.Tensor | None = None  # [num_audios, frames]
    message_tokens: list[int] | None = None  # tokens of each message, then of the assistant header

    @property
    def audio_lengths(self) -> torch.Tensor | None:
        return None if self.feature_mask is None else self.feature_mask.sum(-1)


class PromptEncoder:
    """Renders ChatML the way Qwen3-Omni's template does: each audio part becomes
    <|audio_start|> + one <|audio_pad|> per encoder output frame + <|audio_end|>."""

    def __init__(self, tokenizer, n_window: int, num_mel_bins: int):
        self.tokenizer = tokenizer
        self.im_start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")  # each message starts with it
        self.n_window = n_window
        self.features = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=INPUT_SAMPLE_RATE,
                                                hop_length=160, n_fft=N_FFT, return_attention_mask=True)

    def encode(self, messages: list[Message]) -> EncodedPrompt:
        audios = [p["audio"] for m in messages if not isinstance(m["content"], str)
                  for p in m["content"] if p["type"] == "audio"]
        feats = mask = None
        audio_tokens: list[int] = []
        if audios:
            out = self.features([_at_least_one_window(a) for a in audios], sampling_rate=INPUT_SAMPLE_RATE,
                                return_attention_mask=True, padding="longest", truncation=False,
                                return_tensors="pt")
            feats, mask = out.input_features, out.attention_mask
            audio_tokens = [int(_get_feat_extract_output_lengths(n, self.n_window)) for n in mask.sum(-1)]
        text = self._render(messages, iter(audio_tokens))
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        starts = [i for i, t in enumerate(ids) if t == self.im_start_id] + [len(ids)]
        return EncodedPrompt(input_ids=ids, input_features=feats, feature_mask=mask,
                             message_tokens=[b - a for a, b in zip(starts, starts[1:])])

    @staticmethod
    def _render(messages: list[Message], audio_tokens) -> str:
        out = []
        for m in messages:
            content = m["content"]
            if not isinstance(content, str):
                content = "".join(
                    p["text"] if p["type"] == "text"
                    else "<|audio_start|>" + "<|audio_pad|>" * next(audio_tokens) + "<|audio_end|>"
                    for p in content)
            out.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
        out.append("<|im_start|>assistant\n")
        return "".join(out)


def _at_least_one_window(audio) -> np.ndarray:
    """Audio shorter than one STFT window (25 ms), zero-padded to it: the feature extractor fails on less."""
    audio = np.asarray(audio, dtype=np.float32)
    return np.pad(audio, (0, max(0, N_FFT - audio.size)))
