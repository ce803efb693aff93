"""Chat messages -> Qwen3-Omni thinker inputs (the checkpoint's chat template, audio and image placeholders
expanded as its processor does, mel features from its feature extractor, pixel patches from its image processor),
and the prompt's cache key: what a resident KV prefix must equal to be reused."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnirt.pipeline.models.qwen3_omni import images as vision
from omnirt.pipeline.models.qwen3_omni.audio_windows import AudioWindows
from omnirt.pipeline.stage.prefix_cache import common_prefix_bytes
from omnirt.pipeline.types import Message, RequestError

log = logging.getLogger(__name__)


class PromptConfigError(ValueError):
    """The checkpoint lacks (or has a wrong) chat template or preprocessor config."""


@dataclass(slots=True)
class EncodedPrompt:
    input_ids: list[int]
    input_features: torch.Tensor | None = None  # [num_audios, mel, frames]
    feature_mask: torch.Tensor | None = None  # [num_audios, frames]
    message_tokens: list[int] | None = None  # tokens of each message, then of the assistant header
    audio_spans: tuple[tuple[int, int], ...] = ()  # [start, end) of each audio's placeholder tokens, in order
    pixel_values: torch.Tensor | None = None  # [patches, C*T*P*P] of every image, in order
    image_grid_thw: torch.Tensor | None = None  # [num_images, 3]
    image_spans: tuple[tuple[int, int], ...] = ()  # [start, end) of each image's placeholder tokens, in order
    # int64 per position, as bytes: the token id, or at an audio (image) placeholder a digest of the features of
    # that audio's encoder window (`audio_windows.py`; the image's pixels; negative, so never a token id). Two
    # prompts whose keys agree on positions [0, n) have the same KV there.
    cache_key: bytes = b""
    lists_tools: bool = False  # the prompt offers tools: a tool call's marker then starts a call, not text

    @property
    def num_audio_tokens(self) -> int:
        return sum(end - start for start, end in self.audio_spans)

    @property
    def num_image_tokens(self) -> int:
        return sum(end - start for start, end in self.image_spans)

    @property
    def audio_lengths(self) -> torch.Tensor | None:
        return None if self.feature_mask is None else self.feature_mask.sum(-1)

    def head(self, n: int, last_audio_frames: int) -> EncodedPrompt:
        """Its first `n` positions, which end inside its last audio, at `last_audio_frames` of its frames."""
        mask = self.feature_mask.clone()
        mask[-1, last_audio_frames:] = 0
        start = self.audio_spans[-1][0]
        return EncodedPrompt(self.input_ids[:n], self.input_features, mask, None,
                             (*self.audio_spans[:-1], (start, n)), self.pixel_values, self.image_grid_thw,
                             self.image_spans, self.cache_key[:8 * n])

    def image_pixels(self, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, grid_thw) of images `first`.. (the patch rows of each image follow each other)."""
        skip = int(self.image_grid_thw[:first].prod(-1).sum())
        return self.pixel_values[skip:], self.image_grid_thw[first:]


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
        return common_prefix_bytes(self.data, other.data, 8) if self.salt == other.salt else 0

    def head(self, n: int, then: np.ndarray | None = None) -> PromptKey:
        """The key of its first `n` positions, followed by the keys `then` (token ids)."""
        more = b"" if then is None else then.astype(np.int64).tobytes()
        return PromptKey(self.salt, self.data[:8 * n] + more)


FEATURE_CACHE_BYTES = 64 << 20  # about 10 minutes of audio as mel features


class LruCache:
    """A thread-safe LRU map of tuples, bounded by the bytes of the tensors they hold (prompts are encoded on worker
    threads). Extracting every audio of a conversation anew made each turn's encoding grow with the conversation
    (on the CPU, 2.8 ms for a first turn of 2 s, 8.3 ms at the fourth) on the engine core's interpreter."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.num_bytes = max_bytes, 0
        self._entries: OrderedDict[bytes, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> tuple | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: bytes, value: tuple) -> tuple:
        with self._lock:
            if key not in self._entries:
                self._entries[key] = value
                self.num_bytes += _nbytes(value)
            while self.num_bytes > self.max_bytes and len(self._entries) > 1:
                self.num_bytes -= _nbytes(self._entries.popitem(last=False)[1])
            return value

    def __len__(self) -> int:
        return len(self._entries)


def _nbytes(value: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in value if isinstance(t, torch.Tensor))


class PromptEncoder:
    """Renders messages the way the checkpoint's own processor (`Qwen3OmniMoeProcessor`) does: its chat
    template, then each <|audio_pad|> the template wrote expanded to one per encoder output frame, with the
    mel features from its feature extractor, and each <|image_pad|> to one per merged patch of its image, with
    the pixel patches from its image processor. `tools` (OpenAI function specs) and `tool` / assistant
    `tool_calls` messages go to the template as they are."""

    def __init__(self, tokenizer, chat_template: str, features: WhisperFeatureExtractor, windows: AudioWindows,
                 images: Qwen2VLImageProcessorPil):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.features = features
        self.windows = windows
        self.images = images
        self.im_start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")  # each message starts with it
        self.audio_token = tokenizer.audio_token
        self.audio_id = tokenizer.convert_tokens_to_ids(self.audio_token)
        self.image_token = tokenizer.image_token
        self.image_id = tokenizer.convert_tokens_to_ids(self.image_token)
        # each audio's features, by its samples: a conversation's prompt carries every earlier turn's audio again
        self.extracted = LruCache(FEATURE_CACHE_BYTES)

    @classmethod
    def from_checkpoint(cls, path: Path, tokenizer, thinker_config) -> PromptEncoder:
        """The checkpoint's own prompt processing: its chat template and `preprocessor_config.json` (the feature
        extractor and the image processor). A checkpoint without either, or whose settings disagree with its
        encoders, fails here, at load, rather than prompting the model in a made-up format."""
        audio_config, vision_config = thinker_config.audio_config, thinker_config.vision_config
        features = _feature_extractor(path)
        if features.feature_size != audio_config.num_mel_bins:
            raise PromptConfigError(f"{path / 'preprocessor_config.json'}: feature_size {features.feature_size} "
                                    f"!= the audio encoder's num_mel_bins {audio_config.num_mel_bins}")
        windows = AudioWindows(audio_config.n_window, audio_config.n_window_infer, features.hop_length,
                               features.n_fft)
        return cls(tokenizer, chat_template(path, tokenizer), features, windows, _image_processor(path, vision_config))

    @property
    def sample_rate(self) -> int:
        return self.features.sampling_rate

    def encode(self, messages: list[Message], tools: list[dict] | None = None) -> EncodedPrompt:
        if not messages:  # the released template (and transformers) render no prompt for no messages
            raise RequestError("there is nothing to answer: no messages (nor instructions)", "messages")
        audios, images = _parts(messages, "audio"), _parts(messages, "image")
        feats = mask = pixel_values = grid = None
        audio_digests: list[tuple[int, ...]] = []
        audio_tokens: list[int] = []
        image_tokens: list[int] = []
        if audios:
            feats, mask, audio_digests = self._features(audios)
            audio_tokens = [self.windows.num_tokens(int(n)) for n in mask.sum(-1)]
        if images:
            pixel_values, grid = vision.pixels(self.images, images)
            image_tokens = vision.num_tokens(grid, self.images.merge_size)
        text = self._render(messages, tools)
        text = _expand(_expand(text, self.audio_token, audio_tokens, "audio"), self.image_token, image_tokens, "image")
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        starts = [i for i, t in enumerate(ids) if t == self.im_start_id] + [len(ids)]
        audio_spans, image_spans = _runs(ids, self.audio_id), _runs(ids, self.image_id)
        digests = self._window_digests(audio_spans, mask, audio_digests) + _image_digests(image_spans, pixel_values,
                                                                                         grid)
        return EncodedPrompt(input_ids=ids, input_features=feats, feature_mask=mask,
                             message_tokens=[b - a for a, b in zip(starts, starts[1:])], audio_spans=audio_spans,
                             pixel_values=pixel_values, image_grid_thw=grid, image_spans=image_spans,
                             cache_key=_cache_key(ids, digests), lists_tools=bool(tools))

    def _render(self, messages: list[Message], tools: list[dict] | None) -> str:
        """The template's text; audio and image parts go in without their data (the template only asks their
        type). Images only in user messages: the released template writes a system message's image as a turn of
        its own, which the Talker's positions (transformers' too) would then count wrongly."""
        for m in messages:
            if m["role"] != "user" and _parts([m], "image"):
                raise RequestError(f"a {m['role']} message cannot hold an image (only user messages can)", "messages")
        plain = [m if isinstance(m["content"], str) else
                 {**m, "content": [{"type": p["type"]} if p["type"] in ("audio", "image") else p
                                   for p in m["content"]]}
                 for m in messages]
        if tools:
            plain = _text_system_as_string(plain)
        try:
            return self.tokenizer.apply_chat_template(plain, tools=tools, chat_template=self.chat_template,
                                                      tokenize=False, add_generation_prompt=True)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            # e.g. the released template's `tools` branch takes only a string system message
            raise RequestError(f"the model's chat template cannot render these messages: {exc}", "messages") from exc

    def _features(self, audios: list) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, ...]]]:
        """Mel features [n, mel, frames], their mask and each audio's window digests, each audio extracted alone and
        padded after: an audio's features (so its tokens, and the cache key) never depend on the other audios of
        the prompt."""
        outs = [self._extracted(self._at_least_one_window(a)) for a in audios]
        frames = max(f.shape[-1] for f, _, _ in outs)
        feats = torch.cat([torch.nn.functional.pad(f, (0, frames - f.shape[-1])) for f, _, _ in outs])
        mask = torch.cat([torch.nn.functional.pad(m, (0, frames - m.shape[-1])) for _, m, _ in outs])
        return feats, mask, [d for _, _, d in outs]

    def _extracted(self, audio: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """One audio's features, mask ([1, mel, frames], [1, frames]) and window digests, from the cache if it was
        seen."""
        key = hashlib.blake2b(audio.tobytes(), digest_size=16).digest()
        hit = self.extracted.get(key)
        if hit is None:
            out = self.features(audio, sampling_rate=self.sample_rate, return_attention_mask=True, padding="longest",
                                truncation=False, return_tensors="pt")
            hit = self.extracted.put(key, (out.input_features, out.attention_mask,
                                           self.windows.digests(out.input_features[0],
                                                                int(out.attention_mask.sum()))))
        return hit

    def _window_digests(self, spans, mask: torch.Tensor | None, digests: list[tuple[int, ...]]
                        ) -> list[tuple[tuple[int, int], int]]:
        """Each audio encoder window's placeholder span and its digest."""
        out = []
        for (start, _), frames, windows in zip(spans, [] if mask is None else mask.sum(-1).tolist(), digests):
            for n, digest in zip(self.windows.token_counts(int(frames)), windows):
                out.append(((start, start + n), digest))
                start += n
        return out

    def encode_settled(self, messages: list[Message], tools: list[dict] | None = None) -> EncodedPrompt | None:
        """The prompt of a turn still being spoken: `messages` end with the audio heard so far, and the prompt
        stops after the last of its encoder windows that is settled (`AudioWindows.num_settled`), before the
        turn's closing tokens. None while no window is settled (or an image comes after the cut)."""
        audios = _parts(messages, "audio")
        if not audios:
            return None
        full = self.encode(messages, tools)
        frames = int(full.feature_mask[-1].sum())
        settled = self.windows.num_settled(np.asarray(audios[-1]).size)
        cut = full.audio_spans[-1][0] + sum(self.windows.token_counts(frames)[:settled])
        if settled == 0 or any(end > cut for _, end in full.image_spans):
            return None
        return full.head(cut, settled * self.windows.n_window_infer)

    def _at_least_one_window(self, audio) -> np.ndarray:
        """Audio shorter than one STFT window (25 ms), zero-padded to it: the feature extractor fails on less."""
        audio = np.asarray(audio, dtype=np.float32)
        return np.pad(audio, (0, max(0, self.features.n_fft - audio.size)))


def _parts(messages: list[Message], kind: str) -> list:
    """The data of every `kind` ("audio" or "image") part of the messages, in order."""
    return [p[kind] for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == kind]


def _expand(text: str, token: str, counts: list[int], what: str) -> str:
    """Each `token` placeholder the template wrote, repeated `counts[i]` times (its audio's encoder frames, its
    image's merged patches)."""
    pieces = text.split(token)
    if len(pieces) - 1 != len(counts):
        raise RequestError(f"the model's chat template wrote {len(pieces) - 1} {what} placeholders for the "
                           f"{len(counts)} {what} parts of these messages", "messages")
    return pieces[0] + "".join(token * n + rest for n, rest in zip(counts, pieces[1:]))


def _text_system_as_string(messages: list[Message]) -> list[Message]:
    """The released template's `tools` branch writes the system message as a string (`content + '\\n\\n'`): a
    system message of text parts alone (as OpenAI's clients may send it) goes in as their text, joined."""
    first = messages[0]
    if first["role"] != "system" or isinstance(first["content"], str):
        return messages
    if any(p["type"] != "text" for p in first["content"]):
        return messages
    return [{**first, "content": "".join(p["text"] for p in first["content"])}, *messages[1:]]


def chat_template(path: Path, tokenizer) -> str:
    """The checkpoint's chat template, where its processor would find it: `chat_template.json` (as the released
    checkpoint ships it), `chat_template.jinja`, then the tokenizer config's."""
    if (path / "chat_template.json").is_file():
        template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
    elif (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    else:
        template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise PromptConfigError(f"{path} has no chat template (chat_template.json, chat_template.jinja or "
                                "tokenizer_config.json's chat_template); omnirt renders prompts only with the "
                                "checkpoint's own template")
    log.info("chat template from %s", path)
    return template


def _feature_extractor(path: Path) -> WhisperFeatureExtractor:
    if not (path / "preprocessor_config.json").is_file():
        raise PromptConfigError(f"{path} has no preprocessor_config.json: the audio features' settings (mel bins, "
                                "sample rate, hop) come only from the checkpoint")
    return WhisperFeatureExtractor.from_pretrained(path, local_files_only=True)


def _image_processor(path: Path, vision_config) -> Qwen2VLImageProcessorPil:
    """The checkpoint's image processor; its patch layout must be the vision encoder's (a file without it would
    leave the class defaults, 14 px patches: rows of the wrong width for a 16 px encoder)."""
    processor = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    expected = {"patch_size": vision_config.patch_size, "temporal_patch_size": vision_config.temporal_patch_size,
                "merge_size": vision_config.spatial_merge_size}
    for key, value in expected.items():
        if getattr(processor, key) != value:
            raise PromptConfigError(f"{path / 'preprocessor_config.json'}: {key} {getattr(processor, key)} != the "
                                    f"vision encoder's {value}")
    return processor


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


def _image_digests(spans, pixel_values: torch.Tensor | None, grid: torch.Tensor | None
                   ) -> list[tuple[tuple[int, int], int]]:
    """Each image's span and a digest of its pixel patches and grid."""
    if pixel_values is None:
        return []
    rows = pixel_values.split(vision.patch_counts(grid))
    return [(span, _digest(r.contiguous().numpy(), g.numpy().astype(np.int64).tobytes(), b"omnirt-image"))
            for span, r, g in zip(spans, rows, grid)]


def _digest(data: np.ndarray, shape: bytes, person: bytes) -> int:
    """A negative int64 (never a token id) standing for `data`."""
    digest = hashlib.blake2b(data.tobytes(), digest_size=8, person=person)
    digest.update(shape)
    return -1 - (int.from_bytes(digest.digest(), "little") >> 2)


def _cache_key(ids: list[int], digests: list[tuple[tuple[int, int], int]]) -> bytes:
    """The token ids, each audio's or image's placeholders replaced by its digest."""
    key = np.asarray(ids, dtype=np.int64)
    for (start, end), digest in digests:
        key[start:end] = digest
    return key.tobytes()
