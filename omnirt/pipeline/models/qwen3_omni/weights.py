"""Find and load Qwen3-Omni weights: the built-in tiny model, a local folder or HF-cache id (offline),
or the real architecture with random weights (`load_format="dummy"`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from omnirt.pipeline.models.qwen3_omni import released
from omnirt.pipeline.models.qwen3_omni.fp8_weights import (
    QUANTISED_STACKS,
    apply_scales,
    fp8_block,
    quantize,
    quantize_layer,
    read_scales,
)
from omnirt.pipeline.models.qwen3_omni.memory import device_bytes
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
# Given the bytes the loaded parts' weights take in the engine's dtype: the block size to quantise the decoders to
# FP8 in as they reach the device, or None to keep the dtype
Fp8Choice = Callable[[int], "int | None"]


def load_hf_model(model: str, load_format: str, dtype: torch.dtype, device: torch.device,
                  moe_backend: str = "eager", parts: frozenset[str] = frozenset(PARTS), fp8: Fp8Choice | None = None):
    """Returns (Qwen3OmniMoeForConditionalGeneration in eval mode, tokenizer, the folder the tokenizer and the
    prompt configuration come from: the checkpoint's, or the tiny model's for dummy weights of the released
    architecture without a checkpoint). Only the
    submodules in `parts` hold weights on `device`; the others are left on the meta device (no memory).
    A checkpoint is read whole into host memory (memory-mapped safetensors), then pared down. Decoders in FP8
    (`fp8`'s choice, or an FP8 checkpoint's) reach the device in FP8, a layer at a time, so the device never holds
    the model in the engine's dtype: the released model's 65.7 GiB of bf16 load onto a 48 GB GPU as 34.9 GiB."""
    if load_format == "dummy":
        hf, tokenizer, path = _dummy(model, dtype, device, parts, fp8)
    else:
        path = resolve_model_path(model)
        tokenizer = _tokenizer(path)
        log.info("loading weights from %s (%s)", path, "+".join(p for p in PARTS if p in parts))
        block = fp8_block(path)
        hf = _from_checkpoint(path, dtype, block is not None)
        fix_config(hf.config)
        _drop_parts(hf, parts)
        if block is not None:
            _fp8_weights(hf, path, block)  # in host memory: they move to the device in FP8
        elif fp8 is not None and (block := fp8(before := parts_bytes(hf, parts))) is not None:
            _log_fp8(quantize(hf, block, device), block, before, hf, device, "quantised")
        for part in parts:
            if hasattr(hf, part):
                getattr(hf, part).to(device)
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


def _drop_parts(hf, parts: frozenset[str]) -> None:
    """Move the parts not in `parts` to the meta device (no memory), except the Thinker's token embedding table
    (host memory), three rows of which the Talker reads."""
    for part in PARTS:
        module = getattr(hf, part, None)
        if module is None or part in parts:
            continue
        table = module.get_input_embeddings().weight.data if part == "thinker" else None
        module.to("meta")
        if table is not None:
            module.get_input_embeddings().weight = torch.nn.Parameter(table, requires_grad=False)


def parts_bytes(hf, parts: frozenset[str]) -> int:
    """What the weights of `parts` take in their dtype, wherever they are (the meta device included)."""
    return sum(p.numel() * p.element_size() for part in PARTS if part in parts and hasattr(hf, part)
               for p in getattr(hf, part).parameters())


def _log_fp8(counts: tuple[int, int], block: int, before: int, hf, device: torch.device, how: str) -> None:
    log.info("fp8: %d experts modules and %d linear layers %s in blocks of %d, a layer at a time: weights %.2f GiB "
             "-> %.2f GiB on %s", *counts, how, block, before / 2**30, device_bytes(hf) / 2**30, device)


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


def _dummy(model: str, dtype: torch.dtype, device: torch.device, parts: frozenset[str], fp8: Fp8Choice | None):
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
        block = None if fp8 is None else fp8(before := parts_bytes(hf, parts))
        counts = (0, 0)
        # seeded, so that every start builds the same random weights (runs compare on the same near-ties)
        cuda = [device] if torch.device(device).type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.device(device):
            torch.manual_seed(0)
            for part in PARTS:
                if part in parts and hasattr(hf, part):
                    module, made = _dummy_part(part, getattr(hf, part), getattr(config, f"{part}_config"), dtype,
                                               device, block)
                    setattr(hf, part, module)
                    counts = (counts[0] + made[0], counts[1] + made[1])
            if "talker" in parts and hasattr(hf, "talker"):  # last, as before FP8: the same bf16 weights as ever
                init_talker_experts(hf.talker)
    finally:
        torch.set_default_dtype(default)
    if block is not None:
        _log_fp8(counts, block, before, hf, device, "built")
    return hf, tokenizer, path


# a part's decoder layers that FP8 quantises, by part
DECODER_STACKS = {part: name.removeprefix(f"{part}.") for name in QUANTISED_STACKS for part in PARTS
                  if name.startswith(f"{part}.")}


def _dummy_part(part: str, meta: torch.nn.Module, config, dtype: torch.dtype, device: torch.device,
                block: int | None) -> tuple[torch.nn.Module, tuple[int, int]]:
    """One part with random weights on `device`, and the (experts modules, linear layers) made FP8. With a
    `block`, the part is built without its decoder layers, which are then built one at a time (`meta`'s class),
    each initialised and quantised before the next."""
    stack = DECODER_STACKS.get(part) if block is not None else None
    module = _without_layers(type(meta), config, dtype) if stack else type(meta)._from_config(config, dtype=dtype)
    counts = (0, 0)
    if stack is not None:
        layers, text_model = module.get_submodule(stack), module.get_submodule(stack.rsplit(".", 1)[0])
        layer_class = type(meta.get_submodule(stack)[0])
        for index in range(config.text_config.num_hidden_layers):
            layer = layer_class(text_model.config, index)  # on `device`, its own init, then the model's (post_init)
            with torch.no_grad():
                for sub in layer.modules():
                    module._init_weights(sub)
            if part == "talker":
                init_talker_experts(layer, module.config.initializer_range)
            made = quantize_layer(layer, block)
            layers.append(layer)
            counts = (counts[0] + made[0], counts[1] + made[1])
    return module, counts


def _without_layers(cls, config, dtype: torch.dtype) -> torch.nn.Module:
    """A part built with no decoder layers (its text config's `num_hidden_layers` 0 while it is built)."""
    text = config.text_config
    num_layers, text.num_hidden_layers = text.num_hidden_layers, 0
    try:
        return cls._from_config(config, dtype=dtype)
    finally:
        text.num_hidden_layers = num_layers


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
