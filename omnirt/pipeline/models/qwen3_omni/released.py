"""The released Qwen3-Omni-30B-A3B-Instruct architecture, for `--load-format dummy` without a checkpoint.

Sizes are the released config's (transcribed in the project's reference notes); token ids are taken
from the tokenizer in use, so the built-in tokenizer can drive the real-size graph. Random weights
give meaningless text and audio, but every step costs what it costs with the real weights.
"""

from __future__ import annotations

from pathlib import Path

ALIASES = ("qwen3-omni-30b-a3b", "Qwen/Qwen3-Omni-30B-A3B-Instruct")

# The released checkpoint's chat template (its chat_template.json), which the tiny model ships so that tests render
# prompts as the released model is prompted. The hub file could not be fetched here; the text is assembled from
# public copies: everything but the `tools` branch from github.com/kyr0/qwen3-omni-vllm-docker, chat-template.jinja2
# at commit 051f7ba7aa30c9e036692b3ee2563e8d91f09103, a copy of the released template whose author reworked its
# `tools` branch (github.com/QwenLM/Qwen3-Omni/issues/41); that branch as released, quoted in the issue (the system
# message goes in as `messages[0].content + '\n\n'`), is Qwen3's own and restored here. Not byte-compared with
# the hub file: a real checkpoint always renders with its own file.
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
# The released preprocessor_config.json's feature extractor: Whisper log-mel, 128 bins, 16 kHz, 10 ms hop, 25 ms
# window (the project's reference notes on Qwen3-Omni).
FEATURE_EXTRACTOR = dict(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400, chunk_length=300,
                         padding_value=0.0, return_attention_mask=True)
# The released preprocessor_config.json's image processor (Qwen2VLImageProcessor; omnirt runs its PIL twin,
# Qwen2VLImageProcessorPil): 16 px patches, 2 frames per temporal patch, 2x2 patches merged per token, 3136 to
# 12845056 pixels after resizing, mean and std 0.5. Not fetched from the hub here: the values are those of public
# notes on the hub files of Qwen/Qwen3-Omni-30B-A3B-Instruct (revision 26291f793822fb6be9555850f06dfe95f2d7e695,
# the same in the Thinking and Captioner repos) and, for mean and std, of a public annotated copy of that file.
IMAGE_PROCESSOR = dict(image_processor_type="Qwen2VLImageProcessor", patch_size=16, temporal_patch_size=2,
                       merge_size=2, min_pixels=3136, max_pixels=12845056, image_mean=[0.5, 0.5, 0.5],
                       image_std=[0.5, 0.5, 0.5])

_ROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20], "interleaved": True}
ARCHITECTURE = {
    "thinker": {
        "audio": dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                      num_mel_bins=128, max_source_positions=1500, n_window=50, n_window_infer=800,
                      conv_chunksize=500, downsample_hidden_size=480, output_dim=2048),
        "vision": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
                       deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
        "text": dict(vocab_size=152064, hidden_size=2048, intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=65536,
                     rope_parameters=_ROPE),
    },
    "talker": {
        "text": dict(vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20,
                     num_attention_heads=16, num_key_value_heads=2, head_dim=128, moe_intermediate_size=384,
                     num_experts=128, num_experts_per_tok=6, norm_topk_prob=True, shared_expert_intermediate_size=768,
                     max_position_embeddings=65536, rope_parameters=_ROPE),
        "predictor": dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_code_groups=16,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "codec": dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_nothink_id=2155,
                      codec_think_bos_id=2156, codec_think_eos_id=2157,
                      speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303}),
    },
    "code2wav": dict(codebook_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=16, sliding_window=72, num_quantizers=16,
                     upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=1536,
                     max_position_embeddings=8000, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}


def released_config(tok):
    """The released architecture with every token id taken from `tok`."""
    from transformers import Qwen3OmniMoeConfig

    def tid(t: str) -> int:
        return tok.convert_tokens_to_ids(t)

    def word(w: str) -> int:
        return tok.encode(w, add_special_tokens=False)[0]

    a = ARCHITECTURE
    mm = dict(audio_token_id=tid("<|audio_pad|>"), image_token_id=tid("<|image_pad|>"),
              video_token_id=tid("<|video_pad|>"), audio_start_token_id=tid("<|audio_start|>"),
              audio_end_token_id=tid("<|audio_end|>"), vision_start_token_id=tid("<|vision_start|>"),
              position_id_per_seconds=13, seconds_per_chunk=2)
    return Qwen3OmniMoeConfig(
        thinker_config=dict(audio_config=a["thinker"]["audio"], vision_config=a["thinker"]["vision"],
                            text_config=a["thinker"]["text"], vision_end_token_id=tid("<|vision_end|>"),
                            user_token_id=word("user"), **mm),
        talker_config=dict(text_config=a["talker"]["text"], code_predictor_config=a["talker"]["predictor"],
                           accept_hidden_layer=24, thinker_hidden_size=2048, num_code_groups=16, spatial_merge_size=2,
                           **a["talker"]["codec"], **mm),
        code2wav_config=a["code2wav"],
        im_start_token_id=tid("<|im_start|>"), im_end_token_id=tid("<|im_end|>"), tts_pad_token_id=tid("<tts_pad>"),
        tts_bos_token_id=tid("<tts_text_bos>"), tts_eos_token_id=tid("<tts_text_eod>"), system_token_id=word("system"),
        user_token_id=word("user"), assistant_token_id=word("assistant"), enable_audio_output=True,
    )
