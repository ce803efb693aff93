"""Find and load Qwen3-Omni weights: the built-in tiny model, a local folder or HF-cache id (offline),
or the real architecture with random weights (`load_format="dummy"`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from omnirt.pipeline.models.qwen3_omni import released
from omnirt.pipeline.models.qwen3_omni.fp8_weights import apply_scales, fp8_block, read_scales
from omnirt.pipeline.models.qwen3_omni.tiny import ensure_tiny_model, init_talker_experts
from omnirt.pipeline.types import ModelNotFoundError

log = logging.getLogger(__name__)


def resolve_model_path(model: str) -> Path:
    """`tiny`, a local folder, or a hub id already in the HF cache; never downloads."""
    if model == "tiny":
        return ensure_tiny_model()
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as exc:
        raise ModelNotFoundError(
            f"model {model!r} is neither 'tiny', a local folder, nor in the HF cache "
            f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}); omnirt never downloads weights") from exc


PARTS = ("thinker", "talker", "code2wav")  # the submodules of Qwen3OmniMoeForConditionalGeneration
SLOW_CPU_BUILD_PARAMS = 1_000_000_000  # random weights of this many parameters take minutes to fill on a CPU


def load_hf_model(model: str, load_format: str, dtype: torch.dtype, device: torch.device,
                  moe_backend: str = "eager", parts: frozenset[str] = frozenset(PARTS)):
    """Returns (Qwen3OmniMoeForConditionalGeneration in eval mode, tokenizer, the folder the tokenizer and the
    prompt configuration come from: the checkpoint's, or the tiny model's for dummy weights of the released
    architecture without a checkpoint). Only the
    submodules in `parts` hold weights on `device`; the others are left on the meta device (no memory).
    A checkpoint is read whole into host memory (memory-mapped safetensors), then pared down."""
    if load_format == "dummy":
        hf, tokenizer, path = _dummy(model, dtype, device, parts)
    else:
        path = resolve_model_path(model)
        tokenizer = _tokenizer(path)
        log.info("loading weights from %s (%s)", path, "+".join(p for p in PARTS if p in parts))
        block = fp8_block(path)
        hf = _from_checkpoint(path, dtype, block is not None)
        _keep_parts(hf, parts, device)
        fix_config(hf.config)
        if block is not None:
            _fp8_weights(hf, path, block)
    hf.eval()
    if moe_backend != "eager":
        hf.set_experts_implementation(moe_backend)
    _fix_talker_audio_config(hf)
    return hf, tokenizer, path


def _from_checkpoint(path: Path, dtype: torch.dtype, is_fp8: bool):
    """The checkpoint's model; an FP8 one without transformers' quantizer (it needs kernels from the hub): its
    fp8 values cast to `dtype`, the scales read afterwards (`_fp8_weights`)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    if not is_fp8:
        return Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=dtype, local_files_only=True)
    config = Qwen3OmniMoeConfig.from_pretrained(path, local_files_only=True)
    del config.quantization_config
    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, config=config, dtype=dtype,
                                                                 local_files_only=True)


def _fp8_weights(hf, path: Path, block: int) -> None:
    """An FP8 checkpoint's scales applied: its quantised layers FP8 again, as it stores them."""
    num_experts, num_dense = apply_scales(hf, read_scales(path), block)
    log.info("fp8 checkpoint (blocks of %d): %d experts modules and %d linear layers in FP8", block, num_experts,
             num_dense)


def _keep_parts(hf, parts: frozenset[str], device: torch.device) -> None:
    """Move `parts` to the device and the rest to the meta device, except the Thinker's token embedding
    table (host memory), three rows of which the Talker reads."""
    for part in PARTS:
        module = getattr(hf, part, None)
        if module is None:
            continue
        if part in parts:
            module.to(device)
            continue
        table = module.get_input_embeddings().weight.data if part == "thinker" else None
        module.to("meta")
        if table is not None:
            module.get_input_embeddings().weight = torch.nn.Parameter(table, requires_grad=False)


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def warn_if_slow(hf, parts: frozenset[str], dtype: torch.dtype, device: torch.device) -> None:
    """Before a dummy build that takes minutes, say so: billions of random weights filled on a CPU (the released
    model's three stages are 35 B parameters). `hf` is the model on the meta device, its sizes known, no memory."""
    num_params = sum(p.numel() for part in PARTS if part in parts and hasattr(hf, part)
                     for p in getattr(hf, part).parameters())
    if torch.device(device).type != "cpu" or num_params < SLOW_CPU_BUILD_PARAMS:
        return
    log.warning("dummy weights: filling %.1f B parameters with random values on the CPU takes minutes and %.0f GiB "
                "of host memory (%s); --model tiny serves the same architecture at a toy size in seconds",
                num_params / 1e9, num_params * dtype.itemsize / 2**30, str(dtype).removeprefix("torch."))


def _dummy(model: str, dtype: torch.dtype, device: torch.device, parts: frozenset[str]):
    """The real architecture with random weights: from a checkpoint's config when one is at hand, else
    (for the released model's names) from the built-in architecture with the tiny tokenizer's ids."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    try:
        path = resolve_model_path(model)
        tokenizer = _tokenizer(path)
        config = fix_config(Qwen3OmniMoeConfig.from_pretrained(path, local_files_only=True))
    except ModelNotFoundError:
        if model not in released.ALIASES:
            raise
        path = ensure_tiny_model()
        tokenizer = _tokenizer(path)
        config = released.released_config(tokenizer)
    log.info("dummy weights: building %s (%s) with random weights on %s", model, "+".join(sorted(parts)), device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # sub-models are built without the dtype argument: make it the default
    try:
        with torch.device("meta"):
            hf = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=dtype)
        warn_if_slow(hf, parts, dtype, device)
        # seeded, so that every start builds the same random weights (runs compare on the same near-ties)
        cuda = [device] if torch.device(device).type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.device(device):
            torch.manual_seed(0)
            for part in PARTS:
                if part in parts and hasattr(hf, part):
                    setattr(hf, part, type(getattr(hf, part))._from_config(getattr(config, f"{part}_config"),
                                                                           dtype=dtype))
            if "talker" in parts and hasattr(hf, "talker"):
                init_talker_experts(hf.talker)
    finally:
        torch.set_default_dtype(default)
    return hf, tokenizer, path


def fix_config(config):
    """Fill the fields the modeling code needs but the config classes do not declare (reference §3)."""
    talker = config.talker_config
    if getattr(talker.text_config, "shared_expert_intermediate_size", None) is None:
        talker.text_config.shared_expert_intermediate_size = talker.text_config.moe_intermediate_size * 2
    if getattr(talker, "spatial_merge_size", None) is None:
        talker.spatial_merge_size = config.thinker_config.vision_config.spatial_merge_size
    if not isinstance(talker.speaker_id, dict) or not talker.speaker_id:
        raise ValueError("config: talker_config.speaker_id must map voice names to codec ids")
    return config


def _fix_talker_audio_config(hf) -> None:
    """Upstream bug: image+audio prompts make the talker's rope index read `audio_config` it lacks."""
    if hasattr(hf, "talker") and not hasattr(hf.talker.config, "audio_config"):
        hf.talker.config.audio_config = hf.config.thinker_config.audio_config
