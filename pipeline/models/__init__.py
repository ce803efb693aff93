"""The one place that knows Qwen3-Omni: load weights and build the stage models from a config.

A process loads only the stages it runs (`stages`): a Code2Wav replica holds neither the Thinker
nor the Talker on its device, and captures only its own graphs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pipeline.attention import attend_in_place
from pipeline.config import STAGE_NAMES, EngineConfig
from pipeline.graph import StageGraph
from pipeline.kv_cache import SlotKVCache
from pipeline.models.loader import ModelNotFoundError, load_hf_model
from pipeline.models.qwen3_omni.code2wav import Code2WavModel, CodecWindow, frame_buckets
from pipeline.models.qwen3_omni.prompt import INPUT_SAMPLE_RATE, EncodedPrompt, PromptEncoder
from pipeline.models.qwen3_omni.talker import TalkerModel, TalkerState
from pipeline.models.qwen3_omni.thinker import ThinkerModel, ThinkerRows, ThinkerState
from pipeline.moe import use_fused_experts
from pipeline.platform import Platform
from pipeline.triton_runtime import available

__all__ = ["OmniModels", "load_models", "ModelNotFoundError", "CodecWindow", "EncodedPrompt", "TalkerState",
           "ThinkerRows", "ThinkerState", "OUTPUT_SAMPLE_RATE"]

log = logging.getLogger(__name__)
OUTPUT_SAMPLE_RATE = 24000


@dataclass(slots=True)
class OmniModels:
    encoder: PromptEncoder
    thinker: ThinkerModel | None  # None: not loaded in this process (or, for the speech stages, no speech)
    talker: TalkerModel | None
    code2wav: Code2WavModel | None
    voices: dict[str, int]  # voice name -> speaker id
    tokenizer: object
    kv_bytes: dict[str, int]
    hf: object  # the transformers model itself (the reference engine drives its generate())
    platform: Platform
    graph: StageGraph | None = None  # the stages and what crosses between them (set by load_models)
    input_sample_rate: int = INPUT_SAMPLE_RATE
    output_sample_rate: int = OUTPUT_SAMPLE_RATE

    def capture_graphs(self) -> None:
        """Capture the steps of every stage loaded here whose profile allows graphs (no-op otherwise)."""
        for model in (self.thinker, self.talker, self.code2wav):
            if model is not None:
                model.capture_graphs()

    def decode_text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _kv_for(stack_config, stage_cfg, platform: Platform, dtype: torch.dtype, in_place: bool,
            max_len: int | None = None) -> SlotKVCache:
    """The slot cache of one decoder stack; `in_place` also points the stack's attention at it."""
    c = stack_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if in_place:
        attend_in_place(c)
    return SlotKVCache(c.num_hidden_layers, stage_cfg.max_num_seqs, c.num_key_value_heads,
                       max_len or stage_cfg.max_model_len, head_dim, dtype, platform.device(0), in_place)


def _in_place(attention: str, platform: Platform) -> bool:
    """Whether attention reads the slot cache in place (Triton) rather than a dense copy per layer."""
    if attention == "auto":
        return platform.supports_graphs and available()
    if attention == "slots" and not available():
        raise ValueError("--attention slots needs Triton (pip install triton; on the CPU also TRITON_INTERPRET=1)")
    return attention == "slots"


def _experts(backend: str, platform: Platform) -> str:
    """The transformers experts implementation for `--moe-backend` (auto: the fused Triton kernels where graphs
    run and Triton imports, 1.5-2x faster than grouped_mm at decode batches on the H200; eager otherwise)."""
    if backend == "auto":
        backend = "triton" if platform.supports_graphs and available() else (
            "grouped_mm" if platform.supports_graphs else "eager")
    if backend == "triton":
        if not available():
            raise ValueError("--moe-backend triton needs Triton "
                             "(pip install triton; on the CPU also TRITON_INTERPRET=1)")
        return use_fused_experts()
    return backend


def load_models(cfg: EngineConfig, platform: Platform, stages: tuple[str, ...] = STAGE_NAMES) -> OmniModels:
    """The models of `stages` (the others are not loaded), the prompt encoder, and the stage graph."""
    from pipeline.models.qwen3_omni.graph import build_graph  # it builds stages, which import this package

    dtype = getattr(torch, cfg.dtype)
    device = platform.device(0)
    moe = _experts(cfg.moe_backend, platform)
    # grouped_mm captures in bf16; other dtypes fall back to a kernel that reads group sizes on the host
    graph_moe = "batched_mm" if moe == "grouped_mm" and dtype != torch.bfloat16 else None
    in_place = _in_place(cfg.attention, platform)
    hf, tokenizer, _ = load_hf_model(cfg.model, cfg.load_format, dtype, device, moe, frozenset(stages))
    log.info("weights of %s: %.2f GiB on %s (%s, experts: %s, attention: %s, compile: %s)", "+".join(stages),
             platform.memory_allocated(device) / 2**30, device, cfg.dtype, moe, "slots" if in_place else "dense",
             cfg.compile)
    hc = hf.config
    audio = hc.thinker_config.audio_config
    encoder = PromptEncoder(tokenizer, audio.n_window, audio.num_mel_bins)
    thinker = talker = code2wav = None
    kv_bytes = {}
    if "thinker" in stages:
        th_cfg = cfg.stage("thinker")
        th_kv = _kv_for(hc.thinker_config.text_config, th_cfg, platform, dtype, in_place)
        thinker = ThinkerModel(hf.thinker, hc, th_kv, platform, th_cfg.enforce_eager, graph_moe,
                               cfg.compiles("thinker", platform.supports_graphs))
        kv_bytes["thinker"] = thinker.kv.num_bytes
    has_talker = getattr(hf, "has_talker", False)
    if has_talker and "talker" in stages:
        tk_cfg = cfg.stage("talker")
        tkc = hc.talker_config
        predictor_kv = _kv_for(tkc.code_predictor_config, tk_cfg, platform, dtype, in_place, tkc.num_code_groups)
        talker = TalkerModel(hf.talker, hc, _kv_for(tkc.text_config, tk_cfg, platform, dtype, in_place), predictor_kv,
                             _special_rows(hf, device), platform, tk_cfg.enforce_eager, graph_moe,
                             cfg.compiles("talker", platform.supports_graphs))
        kv_bytes["talker"] = talker.kv.num_bytes + predictor_kv.num_bytes
    if has_talker and "code2wav" in stages:
        cc, c2w_cfg = cfg.connector, cfg.stage("code2wav")
        code2wav = Code2WavModel(hf.code2wav, device, platform, c2w_cfg.enforce_eager, c2w_cfg.max_num_seqs,
                                 frame_buckets(cc.initial_codec_chunk_frames, cc.codec_chunk_frames,
                                               cc.codec_left_context_frames))
        if cc.codec_left_context_frames < code2wav.receptive_field_frames:
            log.info("code2wav: %d frames of left context, the vocoder's receptive field is %d: streamed audio "
                     "approximates the one-shot decode (docs/architecture.md, Parity)",
                     cc.codec_left_context_frames, code2wav.receptive_field_frames)
    voices = {k.lower(): v for k, v in hc.talker_config.speaker_id.items()} if has_talker else {}
    for stage, n in kv_bytes.items():
        log.info("%s KV cache: %.1f MiB", stage, n / 2**20)
    log.info("device memory after load: %.2f GiB allocated", platform.memory_allocated(device) / 2**30)
    models = OmniModels(encoder, thinker, talker, code2wav, voices, tokenizer, kv_bytes, hf, platform)
    models.graph = build_graph(hc, has_talker)
    return models


def _special_rows(hf, device: torch.device) -> torch.Tensor:
    """Thinker embeddings of tts_bos, tts_eos, tts_pad: the Talker's text-track markers. With dummy weights
    and no Thinker in this process the table is not materialised: random rows, as the weights are."""
    c = hf.config
    table = hf.thinker.get_input_embeddings().weight
    ids = [c.tts_bos_token_id, c.tts_eos_token_id, c.tts_pad_token_id]
    if table.is_meta:
        return torch.randn(len(ids), table.shape[1], dtype=table.dtype, device=device) * 0.02
    with torch.inference_mode():
        return table[ids].to(device)
