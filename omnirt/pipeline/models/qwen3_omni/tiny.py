"""The built-in tiny Qwen3-Omni: random weights, a self-made tokenizer, every component present.

It exists so that the whole pipeline (audio encoder, thinker MoE, talker MoE + code predictor,
code2wav with the real x1920 upsampling and 16 codebooks) runs on a CPU in seconds. It is built
deterministically (fixed seed) on first use into a cache folder and then loaded through the same
`from_pretrained` path as a real checkpoint. The tokenizer is NOT Qwen's: it is a byte-level BPE
trained here on inline text, with the Qwen-Omni special tokens appended in Qwen's order. Its prompt
configuration is the released model's: the chat template and the feature extractor's settings.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from omnirt.pipeline.models.qwen3_omni import released

log = logging.getLogger(__name__)

TINY_VERSION = "v4"  # the released chat template, feature extractor and image processor, the Talker experts
# initialised; the tool and think markers plain added tokens, as in Qwen's tokenizer
SEED = 1234

# Qwen-Omni special tokens in the order the real vocabulary has them (151643.. there).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
]
NAMED_TOKENS = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}
_TRAINING_TEXT = ["system", "user", "assistant"] * 10 + [
    "Hello, how are you today? I am a tiny test model that speaks.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "What is in this audio clip? It sounds like someone talking about the weather.",
    "You are a helpful voice assistant. Answer briefly and clearly.",
    "Tell me a long story about a dragon, a castle and a brave knight.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ! ? : ; - ' \"",
] * 20
# Qwen's released tokenizer adds these as non-special tokens: decoded text keeps them (its tool-call parser reads it)
TEXT_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
VOICES = ("chelsie", "ethan", "aiden")
CODEBOOK = 64


def tiny_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the tiny model lives; `OMNIRT_CACHE` or ~/.cache/omnirt."""
    root = Path(cache_dir or os.environ.get("OMNIRT_CACHE") or Path.home() / ".cache" / "omnirt")
    return root / f"tiny-{TINY_VERSION}"


def ensure_tiny_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build the tiny checkpoint once (atomically, so concurrent servers do not race) and return its path."""
    target = tiny_model_dir(cache_dir)
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the tiny model into %s (first use)", target)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        _build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(out: Path) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    tok = build_tokenizer()
    config = tiny_config(tok)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = Qwen3OmniMoeForConditionalGeneration(config)
        init_talker_experts(model.talker)
        _audible_code2wav(model.code2wav)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _save_prompt_config(out)
    (out / "omnirt.json").write_text(json.dumps({"tiny_version": TINY_VERSION, "seed": SEED}))


def _save_prompt_config(out: Path) -> None:
    """What the released checkpoint prompts with: its chat template (chat_template.json), and its feature extractor
    and image processor, which share one preprocessor_config.json there."""
    from transformers import WhisperFeatureExtractor

    (out / "chat_template.json").write_text(json.dumps({"chat_template": released.CHAT_TEMPLATE.read_text()}))
    features = WhisperFeatureExtractor(**released.FEATURE_EXTRACTOR).to_dict()
    config = {**features, **released.IMAGE_PROCESSOR, "processor_class": "Qwen3OmniMoeProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def init_talker_experts(talker: torch.nn.Module, std: float | None = None) -> None:
    """transformers leaves the Talker's fused expert weights as allocated (uninitialised memory: a build that
    differs run to run, NaN at times); they get the init every other weight gets (normal, std 0.02). Used
    for the tiny model's build and for `--load-format dummy`. `talker`: the Talker, or a part of it with `std`."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerTextExperts

    for module in talker.modules():
        if isinstance(module, Qwen3OmniMoeTalkerTextExperts):
            for param in module.parameters():
                torch.nn.init.normal_(param, std=std or talker.config.initializer_range)


def _audible_code2wav(code2wav: torch.nn.Module) -> None:
    """HF's init (std 0.02) gives |wav| ~ 2e-6; PyTorch's default conv/linear init gives |wav| ~ 0.3."""
    for module in code2wav.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d, torch.nn.Linear)):
            module.reset_parameters()


def build_tokenizer():
    """A byte-level BPE trained in-process (no downloads), wrapped as a Qwen2Tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=512 - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    bpe.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    model_json = json.loads(bpe.to_str())["model"]
    vocab = dict(model_json["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model_json["merges"]]
    base = len(vocab)
    vocab.update({t: base + i for i, t in enumerate(SPECIAL_TOKENS)})
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=NAMED_TOKENS,
    )
    tok.add_tokens([AddedToken(t, special=t not in TEXT_MARKERS, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tiny_config(tok):
    """A tiny config that satisfies every consistency constraint of the real one (see reference §5.1)."""
    from transformers import Qwen3OmniMoeConfig

    def tid(t: str) -> int:
        return tok.convert_tokens_to_ids(t)

    def word(w: str) -> int:
        ids = tok.encode(w, add_special_tokens=False)
        assert len(ids) == 1, f"{w!r} must be a single token"
        return ids[0]

    hidden, layers, head_dim = 64, 2, 16
    rope_m = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "interleaved": True}
    mm_ids = dict(
        audio_token_id=tid("<|audio_pad|>"), image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"), audio_start_token_id=tid("<|audio_start|>"),
        audio_end_token_id=tid("<|audio_end|>"), vision_start_token_id=tid("<|vision_start|>"),
        position_id_per_seconds=13, seconds_per_chunk=2,
    )
    moe = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, moe_intermediate_size=32,
               num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096,
               rope_parameters=rope_m)
    band = CODEBOOK  # codec specials live in the suppressed band [vocab-1024, vocab), like 2148.. in the real model
    return Qwen3OmniMoeConfig(
        thinker_config=dict(
            audio_config=dict(d_model=hidden, encoder_layers=layers, encoder_attention_heads=4,
                              encoder_ffn_dim=2 * hidden, num_mel_bins=128, downsample_hidden_size=16,
                              output_dim=hidden, n_window=50, n_window_infer=800, max_source_positions=1500),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                               spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                               num_position_embeddings=64, deepstack_visual_indexes=[0]),
            text_config=dict(vocab_size=len(tok), **moe),
            vision_end_token_id=tid("<|vision_end|>"), user_token_id=word("user"), **mm_ids,
        ),
        talker_config=dict(
            text_config=dict(vocab_size=CODEBOOK + 1024, shared_expert_intermediate_size=hidden, **moe),
            code_predictor_config=dict(
                vocab_size=CODEBOOK, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, num_code_groups=16,
                max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
            accept_hidden_layer=1, thinker_hidden_size=hidden, num_code_groups=16, spatial_merge_size=2,
            codec_pad_id=band + 100, codec_bos_id=band + 101, codec_eos_token_id=band + 102,
            codec_nothink_id=band + 107, codec_think_bos_id=band + 108, codec_think_eos_id=band + 109,
            speaker_id={v: band + 253 + i for i, v in enumerate(VOICES)}, **mm_ids,
        ),
        code2wav_config=dict(
            codebook_size=CODEBOOK, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=4, sliding_window=72, num_quantizers=16,
            upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
            max_position_embeddings=8000, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        im_start_token_id=tid("<|im_start|>"), im_end_token_id=tid("<|im_end|>"),
        tts_pad_token_id=tid("<tts_pad>"), tts_bos_token_id=tid("<tts_text_bos>"),
        tts_eos_token_id=tid("<tts_text_eod>"), system_token_id=word("system"), user_token_id=word("user"),
        assistant_token_id=word("assistant"), enable_audio_output=True,
    )
