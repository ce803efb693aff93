"""Qwen3-Omni loaded: the weights, the stage models built from a config, the prompt encoder and the stage graph
(`OmniModels`, what the engine gets from `load()`).

A process loads only the stages it runs (`stages`): a Code2Wav replica holds neither the Thinker
nor the Talker on its device, and captures only its own CUDA graphs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from omnirt.pipeline.config import EngineConfig, StageConfig
from omnirt.pipeline.kernels.attention import attend_in_place
from omnirt.pipeline.kernels.fp8 import BLOCK as FP8_BLOCK
from omnirt.pipeline.kernels.fp8 import use_dequantized_experts
from omnirt.pipeline.kernels.moe import use_fused_experts
from omnirt.pipeline.kernels.triton_runtime import available
from omnirt.pipeline.models.qwen3_omni import fp8_weights
from omnirt.pipeline.models.qwen3_omni.code2wav import Code2WavModel, frame_buckets
from omnirt.pipeline.models.qwen3_omni.generate import generate
from omnirt.pipeline.models.qwen3_omni.graph import build_graph
from omnirt.pipeline.models.qwen3_omni.memory import stage_memory
from omnirt.pipeline.models.qwen3_omni.prompt import PromptEncoder
from omnirt.pipeline.models.qwen3_omni.stages import CODE2WAV, TALKER, THINKER
from omnirt.pipeline.models.qwen3_omni.talker import TalkerModel
from omnirt.pipeline.models.qwen3_omni.thinker import ThinkerModel
from omnirt.pipeline.models.qwen3_omni.tool_calls import CALL_START, ToolCallParser, tool_call_spec
from omnirt.pipeline.models.qwen3_omni.weights import load_hf_model
from omnirt.pipeline.platform import Platform
from omnirt.pipeline.stage.grammar import Grammars
from omnirt.pipeline.stage.graph import Generated, StageGraph
from omnirt.pipeline.stage.kv_cache import SlotKVCache
from omnirt.pipeline.stage.memory_plan import MemoryPlan, log_capture, log_plan, plan_memory
from omnirt.pipeline.stage.sampling import SamplingParams

log = logging.getLogger(__name__)
AUTO_FP8_SHARE = 0.5  # quantization auto: FP8 decoders where the weights would take more of the device than this
OUTPUT_SAMPLE_RATE = 24000
WARM_IMAGE_SIDE = 64  # pixels: the encoders' warm-up image, 128 x 64 (a few merged patches)


@dataclass(slots=True)
class OmniModels:
    encoder: PromptEncoder
    thinker: ThinkerModel | None  # None: not loaded in this process (or, for the speech stages, no speech)
    talker: TalkerModel | None
    code2wav: Code2WavModel | None
    voices: dict[str, int]  # voice name -> speaker id
    tokenizer: object
    kv_bytes: dict[str, int]
    hf: object  # the transformers model itself (`generate` drives its own generate())
    platform: Platform
    plan: MemoryPlan | None = None  # how the KV caches were sized (omnirt/pipeline/stage/memory_plan.py)
    graph: StageGraph | None = None  # the stages and what crosses between them (set by load_models)
    output_sample_rate: int = OUTPUT_SAMPLE_RATE
    grammars: Grammars | None = None  # compiles the Thinker's constraints (its tokenizer and vocabulary)
    tool_parser: Callable[[], ToolCallParser] = ToolCallParser  # the model's tool calls, out of its text
    tool_call_spec: Callable[..., dict] = tool_call_spec  # the grammar that forces them

    @property
    def input_sample_rate(self) -> int:
        """The rate the checkpoint's feature extractor takes audio at."""
        return self.encoder.sample_rate

    def capture_cuda_graphs(self) -> None:
        """Capture the steps of every stage loaded here whose profile allows graphs (no-op otherwise), and
        log what that took against the memory plan's estimate."""
        device = self.platform.device(0)
        free_before, _ = self.platform.mem_get_info(device)
        for name, model in zip((THINKER, TALKER, CODE2WAV), (self.thinker, self.talker, self.code2wav), strict=True):
            if model is not None:
                free, started = self.platform.mem_get_info(device)[0], time.perf_counter()
                model.capture_cuda_graphs()
                if self.platform.supports_graphs:
                    log.info("%s: graphs captured in %.1f s, %.2f GiB of device memory", name,
                             time.perf_counter() - started, (free - self.platform.mem_get_info(device)[0]) / 2**30)
        if self.thinker is not None and self.platform.supports_graphs:
            self.warm_encoders()
        if self.plan is not None and self.platform.supports_graphs:
            log_capture(self.plan, free_before, self.platform.mem_get_info(device)[0])

    def warm_encoders(self) -> None:
        """The Thinker's audio and vision encoders, once each on a second of silence and a small white image.
        They run eagerly, and their first call on a device set up what later calls reuse: on an H200 the first
        voice turn of a fresh server took a 752 ms prefill step, the next ones 40-60 ms."""
        started = time.perf_counter()
        image = np.full((2 * WARM_IMAGE_SIDE, WARM_IMAGE_SIDE, 3), 255, np.uint8)
        prompt = self.encoder.encode([{"role": "user", "content": [
            {"type": "audio", "audio": np.zeros(self.input_sample_rate, np.float32)},
            {"type": "image", "image": image}]}])
        self.thinker.warm_encoders(prompt)
        self.platform.synchronize()
        log.info("thinker: audio and vision encoders warmed in %.2f s", time.perf_counter() - started)

    def generate(self, prompt, voice: str | None, params: dict[str, SamplingParams]) -> Generated:
        """transformers' own generate() of the whole reply (the reference engine's baseline)."""
        return generate(self, prompt, voice, params)


def _kv_for(stack_config, num_slots: int, max_len: int, platform: Platform, dtype: torch.dtype,
            in_place: bool, sc: StageConfig | None = None) -> SlotKVCache:
    """The slot cache of one decoder stack; `in_place` also points the stack's attention at it; `sc`: the stage
    whose requests own the slots (None: a cache of one batch's rows, with no resident prefixes to offload)."""
    c = stack_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if in_place:
        attend_in_place(c)
    host_bytes = int(sc.kv_offload_gib * 2**30) if sc is not None and sc.prefix_caching else 0
    return SlotKVCache(c.num_hidden_layers, num_slots, c.num_key_value_heads, max_len, head_dim, dtype,
                       platform.device(0), in_place, host_bytes)


def _in_place(attention: str, platform: Platform) -> bool:
    """Whether attention reads the slot cache in place (Triton) rather than a dense copy per layer."""
    if attention == "auto":
        return platform.supports_graphs and available()
    if attention == "slots" and not available():
        raise ValueError("attention: slots needs Triton (pip install triton; on the CPU also TRITON_INTERPRET=1)")
    return attention == "slots"


def _experts(backend: str, platform: Platform, quantization: str = "none") -> str:
    """The transformers experts implementation for `moe_backend` (auto: the fused Triton kernels where graphs
    run and Triton imports, 1.5-2x faster than grouped_mm at decode batches on the H200; eager otherwise). FP8
    experts run on the fused kernels, or dequantised where those would be eager (the CPU)."""
    if backend == "auto":
        backend = "triton" if platform.supports_graphs and available() else (
            "grouped_mm" if platform.supports_graphs and quantization == "none" else "eager")
    if quantization == "fp8" and backend not in ("triton", "eager"):
        raise ValueError(f"moe_backend: {backend} cannot read FP8 experts (triton or eager do)")
    if backend == "triton":
        if not available():
            raise ValueError("moe_backend: triton needs Triton "
                             "(pip install triton; on the CPU also TRITON_INTERPRET=1)")
        return use_fused_experts()
    return use_dequantized_experts() if quantization == "fp8" else backend


def _quantization(setting: str, weights: int, platform: Platform) -> str:
    """The decoders' precision for `weights` bytes in the engine's dtype: "fp8" as set, or with "auto" where they
    would take more than `AUTO_FP8_SHARE` of the device (an 80 GB GPU: the bf16 model leaves too little for KV
    caches and graphs), else the engine's dtype ("none"). A checkpoint published in FP8 is FP8 whatever this says."""
    if setting != "auto":
        return setting
    _, total = platform.mem_get_info()
    choice = "fp8" if weights > AUTO_FP8_SHARE * total else "none"
    log.info("quantization auto: %.1f GiB of weights on a %.0f GiB device -> %s", weights / 2**30, total / 2**30,
             choice)
    return choice


def load_models(cfg: EngineConfig, platform: Platform, stages: tuple[str, ...]) -> OmniModels:
    """The models of `stages` (the others are not loaded), the prompt encoder, and the stage graph."""
    dtype = getattr(torch, cfg.dtype)
    device = platform.device(0)
    in_place = _in_place(cfg.attention, platform)
    hf, tokenizer, path = load_hf_model(
        cfg.model, cfg.load_format, dtype, device, "eager", frozenset(stages),
        lambda weights: FP8_BLOCK if _quantization(cfg.quantization, weights, platform) == "fp8" else None)
    quantization = "fp8" if fp8_weights.is_fp8(hf) else "none"
    moe = _experts(cfg.moe_backend, platform, quantization)
    if quantization == "fp8":  # the linear layers through the Triton kernel where the experts are the fused ones
        fp8_weights.set_fused(hf, moe == use_fused_experts())
    if moe != "eager":
        hf.set_experts_implementation(moe)
    # grouped_mm captures in bf16; other dtypes fall back to a kernel that reads group sizes on the host
    graph_moe = "batched_mm" if moe == "grouped_mm" and dtype != torch.bfloat16 else None
    log.info("weights of %s: %.2f GiB on %s, %.2f GiB at most while loading (%s, experts: %s%s, attention: %s, "
             "compile: %s)", "+".join(stages), platform.memory_allocated(device) / 2**30, device,
             platform.max_memory_allocated(device) / 2**30, cfg.dtype, moe,
             " in fp8" if quantization == "fp8" else "", "slots" if in_place else "dense", cfg.compile)
    hc = hf.config
    plan = memory_plan(hf, cfg, stages, platform)
    encoder = PromptEncoder.from_checkpoint(path, tokenizer, hc.thinker_config)
    thinker = talker = code2wav = None
    kv_bytes = {}
    if THINKER in stages:
        th_cfg = cfg.stage(THINKER)
        th_kv = _kv_for(hc.thinker_config.text_config, plan.num_slots[THINKER], th_cfg.max_model_len, platform,
                        dtype, in_place, th_cfg)
        thinker = ThinkerModel(hf.thinker, hc, th_kv, platform, th_cfg.max_num_seqs, th_cfg.enforce_eager, graph_moe,
                               cfg.compiles(THINKER, platform.supports_graphs),
                               tokenizer.convert_tokens_to_ids(CALL_START), th_cfg.compiled_prefill,
                               th_cfg.prefill_graph_tokens)
        kv_bytes[THINKER] = thinker.kv.num_bytes
    has_talker = getattr(hf, "has_talker", False)
    if has_talker and TALKER in stages:
        tk_cfg = cfg.stage(TALKER)
        tkc = hc.talker_config
        # the code predictor's cache holds one batch: its rows are the batch's, not the requests' slots
        predictor_kv = _kv_for(tkc.code_predictor_config, tk_cfg.max_num_seqs, tkc.num_code_groups, platform, dtype,
                               in_place)
        talker_kv = _kv_for(tkc.text_config, plan.num_slots[TALKER], tk_cfg.max_model_len, platform, dtype, in_place,
                            tk_cfg)
        talker = TalkerModel(hf.talker, hc, talker_kv, predictor_kv, _special_rows(hf, device), platform,
                             tk_cfg.max_num_seqs, tk_cfg.enforce_eager, graph_moe,
                             cfg.compiles(TALKER, platform.supports_graphs), tk_cfg.compiled_prefill,
                             tk_cfg.prefill_graph_tokens)
        kv_bytes[TALKER] = talker.kv.num_bytes + predictor_kv.num_bytes
    if has_talker and CODE2WAV in stages:
        if cfg.conv_backend == "triton" and not available():
            raise ValueError("conv_backend triton needs Triton "
                             "(pip install triton; on the CPU also TRITON_INTERPRET=1)")
        cc, c2w_cfg = cfg.connector, cfg.stage(CODE2WAV)
        code2wav = Code2WavModel(hf.code2wav, device, platform, c2w_cfg.enforce_eager, c2w_cfg.max_num_seqs,
                                 frame_buckets(cc.initial_codec_chunk_frames, cc.codec_chunk_frames,
                                               cc.codec_left_context_frames), cfg.conv_backend,
                                 cfg.compiles(CODE2WAV, platform.supports_graphs))
        log.info("code2wav: convolutions %s, compiled %s, graphs %s (batches up to %d)", cfg.conv_backend,
                 "yes" if code2wav.is_compiled else "no",
                 "on" if code2wav.cuda_graphs.enabled else "off", c2w_cfg.max_num_seqs)
        if cc.codec_left_context_frames < code2wav.receptive_field_frames:
            log.info("code2wav: %d frames of left context, the vocoder's receptive field is %d: streamed audio "
                     "approximates the one-shot decode (docs/architecture.md, Parity)",
                     cc.codec_left_context_frames, code2wav.receptive_field_frames)
    voices = {k.lower(): v for k, v in hc.talker_config.speaker_id.items()} if has_talker else {}
    host = {THINKER: thinker and thinker.kv.host, TALKER: talker and talker.kv.host}
    for stage, n in kv_bytes.items():
        tier = host[stage]
        log.info("%s KV cache: %.1f MiB allocated, %d slots%s", stage, n / 2**20, plan.num_slots[stage],
                 f", a host tier of {tier.max_bytes / 2**30:g} GiB behind them" if tier else "")
    log.info("device memory after load: %.2f GiB allocated", platform.memory_allocated(device) / 2**30)
    models = OmniModels(encoder, thinker, talker, code2wav, voices, tokenizer, kv_bytes, hf, platform, plan,
                        grammars=Grammars(tokenizer, hc.thinker_config.text_config.vocab_size,
                                          [hc.im_end_token_id]))
    models.graph = build_graph(hc, has_talker)
    return models


def memory_plan(hf, cfg: EngineConfig, stages: tuple[str, ...], platform: Platform) -> MemoryPlan:
    """The KV slots per stage from the device's memory after the weights (ProfileError when they cannot fit).
    The stages of a process run on its device 0, the current one."""
    platform.empty_cache()
    free, total = platform.mem_get_info()
    plan = plan_memory(stage_memory(hf, cfg, stages, platform.supports_graphs), free, total,
                       cfg.gpu_memory_utilization, platform.device_name(0))
    log_plan(plan)
    return plan


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
