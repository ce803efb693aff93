"""Chat messages -> Qwen3-Omni thinker inputs (ChatML ids with expanded audio placeholders + mel features),
and the prompt's cache key: what a resident KV prefix must equal to be reused."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from pipeline.api import Message
from pipeline.prefix_cache import common_prefix

INPUT_SAMPLE_RATE = 16000
N_FFT = 400  # the STFT window; its reflect padding needs more input than half of it


@dataclass(slots=True)
class EncodedPrompt:
    input_ids: list[int]
    input_features: torch.Tensor | None = None  # [num_audios, mel, frames]
    feature_mask: torch.Tensor | None = None  # [num_audios, frames]
    message_tokens: list[int] | None = None  # tokens of each message, then of the assistant header
    audio_spans: tuple[tuple[int, int], ...] = ()  # [start, end) of each audio's placeholder tokens, in order
    # int64 per position, as bytes: the token id, or at an audio placeholder a digest of that audio's
    # features (negative, so never a token id). Two prompts whose keys agree on positions [0, n) have the
    # same KV there.
    cache_key: bytes = b""

    @property
    def audio_lengths(self) -> torch.Tensor | None:
        return None if self.feature_mask is None else self.feature_mask.sum(-1)


@dataclass(slots=True, frozen=True)
class PromptKey:
    """A prompt's cache key (`EncodedPrompt.cache_key`), or a prefix of it, and its request's salt. Kept as
    bytes, it crosses to a stage's worker process inline, as the token ids do (an array would go through
    the transport's data ring)."""

    salt: str | None
    data: bytes

    def __len__(self) -> int:
        return len(self.data) // 8

    @property
    def keys(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.int64)

    def common(self, other: PromptKey) -> int:
        """Leading positions on which the two prompts agree (none across salts)."""
        return common_prefix(self.keys, other.keys) if self.salt == other.salt else 0

    def head(self, n: int, then: np.ndarray | None = None) -> PromptKey:
        """The key of its first `n` positions, followed by the keys `then` (token ids)."""
        more = b"" if then is None else then.astype(np.int64).tobytes()
        return PromptKey(self.salt, self.data[:8 * n] + more)


class PromptEncoder:
    """Renders ChatML the way Qwen3-Omni's template does: each audio part becomes
    <|audio_start|> + one <|audio_pad|> per encoder output frame + <|audio_end|>."""

    def __init__(self, tokenizer, n_window: int, num_mel_bins: int):
        self.tokenizer = tokenizer
        self.im_start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")  # each message starts with it
        self.audio_id = tokenizer.convert_tokens_to_ids("<|audio_pad|>")
        self.n_window = n_window
        self.features = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=INPUT_SAMPLE_RATE,
                                                hop_length=160, n_fft=N_FFT, return_attention_mask=True)

    def encode(self, messages: list[Message], tools: list[dict] | None = None) -> EncodedPrompt:
        messages = with_tools(messages, tools or [])
        audios = [p["audio"] for m in messages if not isinstance(m["content"], str)
                  for p in m["content"] if p["type"] == "audio"]
        feats = mask = None
        audio_tokens: list[int] = []
        if audios:
            feats, mask = self._features(audios)
            audio_tokens = [int(_get_feat_extract_output_lengths(n, self.n_window)) for n in mask.sum(-1)]
        text = self._render(messages, iter(audio_tokens))
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        starts = [i for i, t in enumerate(ids) if t == self.im_start_id] + [len(ids)]
        spans = _runs(ids, self.audio_id)
        return EncodedPrompt(input_ids=ids, input_features=feats, feature_mask=mask,
                             message_tokens=[b - a for a, b in zip(starts, starts[1:])], audio_spans=spans,
                             cache_key=_cache_key(ids, spans, feats, mask))

    def _features(self, audios: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel features [n, mel, frames] and their mask, each audio extracted alone and padded after: an
        audio's features (so its tokens, and the cache key) never depend on the other audios of the prompt."""
        outs = [self.features(_at_least_one_window(a), sampling_rate=INPUT_SAMPLE_RATE, return_attention_mask=True,
                              padding="longest", truncation=False, return_tensors="pt") for a in audios]
        frames = max(o.input_features.shape[-1] for o in outs)
        feats = torch.cat([torch.nn.functional.pad(o.input_features, (0, frames - o.input_features.shape[-1]))
                           for o in outs])
        mask = torch.cat([torch.nn.functional.pad(o.attention_mask, (0, frames - o.attention_mask.shape[-1]))
                          for o in outs])
        return feats, mask

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


TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call>")


def with_tools(messages: list[Message], tools: list[dict]) -> list[Message]:
    """Tools, calls and results as Qwen3-Omni's released chat template renders them: the tool list in the
    system turn, each assistant call as a <tool_call> block after its text, and consecutive tool results
    as <tool_response> blocks of one user turn. (The checkpoint's template can replace this function.)"""
    out: list[Message] = []
    if tools:
        first = messages[0] if messages and messages[0]["role"] == "system" else None
        head = _text(first["content"]) + "\n\n" if first else ""
        listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        out.append({"role": "system", "content": head + TOOLS_HEAD + listed + TOOLS_TAIL})
        messages = messages[1:] if first else messages
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{_text(m['content'])}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [f'<tool_call>\n{{"name": "{c["name"]}", "arguments": {c["arguments"]}}}\n</tool_call>'
                     for c in m["tool_calls"]]
            content = _text(m["content"])
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        else:
            out.append(m)
    return out


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _at_least_one_window(audio) -> np.ndarray:
    """Audio shorter than one STFT window (25 ms), zero-padded to it: the feature extractor fails on less."""
    audio = np.asarray(audio, dtype=np.float32)
    return np.pad(audio, (0, max(0, N_FFT - audio.size)))


def _runs(ids: list[int], token: int) -> tuple[tuple[int, int], ...]:
    """[start, end) of each run of `token` in `ids`."""
    runs, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    return tuple(runs)


def _cache_key(ids: list[int], spans, feats: torch.Tensor | None, mask: torch.Tensor | None) -> bytes:
    """The token ids, each audio's placeholders replaced by a digest of that audio's own features."""
    key = np.asarray(ids, dtype=np.int64)
    for i, (start, end) in enumerate(spans[:0 if feats is None else len(feats)]):
        frames = feats[i, :, : int(mask[i].sum())].contiguous().numpy()
        digest = hashlib.blake2b(frames.tobytes(), digest_size=8, person=b"omnirt-audio")
        digest.update(np.int64(frames.shape[-1]).tobytes())
        key[start:end] = -1 - (int.from_bytes(digest.digest(), "little") >> 2)
    return key.tobytes()
