"""Which of Qwen3-Omni's weights are FP8 (`omnirt.pipeline.kernels.fp8`): the Thinker's and the Talker's decoders,
their experts and their attention and shared-expert projections (`DENSE`). Everything else (routers, norms,
embeddings and LM heads, the encoders, the code predictor, Code2Wav) keeps the engine's dtype.

They are FP8 either quantised as they load (`quantize`), or as a checkpoint published in FP8 stores them
(`quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [B, B]}`, each quantised layer's
`<layer>.weight` in float8_e4m3fn beside `<layer>.weight_scale_inv`, one float32 per B x B block). transformers loads
such a checkpoint without its quantizer (which needs kernels from the hub) as the fp8 values cast to the engine's
dtype, exactly, and the scales unread; `apply_scales` makes those layers FP8 again with the checkpoint's own values
and scales.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from omnirt.pipeline.kernels.fp8 import FP8, Fp8Linear, hold, is_quantized, quantize_experts

log = logging.getLogger(__name__)

SCALE_SUFFIX = ".weight_scale_inv"
# the checkpoint's decoder stacks -> their module in Qwen3OmniMoeForConditionalGeneration
STACKS = {"thinker.model.layers": "thinker.model.language_model.layers", "talker.model.layers": "talker.model.layers",
          "talker.code_predictor.model.layers": "talker.code_predictor.model.layers"}
DENSE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
QUANTISED_STACKS = ("thinker.model.language_model.layers", "talker.model.layers")  # what `quantize` quantises
_KEY = re.compile(r"^(?P<stack>.+?\.layers)\.(?P<layer>\d+)\.(?P<rest>.+)" + re.escape(SCALE_SUFFIX) + "$")
_EXPERT = re.compile(r"^mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj$")


class Fp8CheckpointError(ValueError):
    pass


def fp8_block(path: Path) -> int | None:
    """The block size of an FP8 checkpoint's scales; None for a checkpoint that is not FP8."""
    config = json.loads((path / "config.json").read_text())
    quant = config.get("quantization_config")
    if not quant:
        return None
    block = quant.get("weight_block_size") or []
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3" or len(block) != 2 \
            or block[0] != block[1]:
        raise Fp8CheckpointError(f"{path}: quantization_config {quant} is not one omnirt reads (quant_method fp8, "
                                 "fmt e4m3, square weight_block_size)")
    return int(block[0])


def read_scales(path: Path) -> dict[str, torch.Tensor]:
    """Every `*.weight_scale_inv` of the checkpoint's safetensors files, by key."""
    from safetensors import safe_open

    scales = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            scales.update({k: f.get_tensor(k) for k in f.keys() if k.endswith(SCALE_SUFFIX)})
    return scales


def quantize(hf: torch.nn.Module, block: int, device: torch.device | None = None) -> tuple[int, int]:
    """Quantise the loaded decoders' experts and `DENSE` layers (parts on the meta device are skipped); returns
    (experts modules, linear layers). Each layer's copy in the engine's dtype is freed as it goes; with `device`,
    each layer moves there just before it is quantised, so the device holds one such copy at most."""
    num_experts = num_dense = 0
    for layer in _loaded_layers(hf):
        if device is not None:
            layer.to(device)
        experts, dense = quantize_layer(layer, block)
        num_experts, num_dense = num_experts + experts, num_dense + dense
    return num_experts, num_dense


def quantize_layer(layer: torch.nn.Module, block: int) -> tuple[int, int]:
    """One decoder layer's experts and `DENSE` layers in FP8; returns (experts modules, linear layers)."""
    num_experts = num_dense = 0
    experts = getattr(layer.mlp, "experts", None)
    if experts is not None and not is_quantized(experts):
        quantize_experts(experts, block)
        num_experts += 1
    for name in DENSE:
        linear = _find(layer, name)
        if isinstance(linear, torch.nn.Linear):
            layer.set_submodule(name, Fp8Linear.quantized(linear, block))
            num_dense += 1
    return num_experts, num_dense


def _loaded_layers(hf: torch.nn.Module) -> list[torch.nn.Module]:
    layers = []
    for name in QUANTISED_STACKS:
        stack = _find(hf, name)
        if stack is not None:
            layers += [layer for layer in stack if not next(layer.parameters()).is_meta]
    return layers


def _find(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def is_fp8(hf: torch.nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) or is_quantized(m) for m in hf.modules())


def set_fused(hf: torch.nn.Module, fused: bool) -> None:
    """FP8 linear layers through the Triton kernel (where the fused experts run) or widened."""
    for module in hf.modules():
        if isinstance(module, Fp8Linear):
            module.fused = fused


def apply_scales(hf: torch.nn.Module, scales: dict[str, torch.Tensor], block: int) -> tuple[int, int]:
    """Make the loaded model what the checkpoint stores: its quantised experts and linear layers FP8 with their
    scales. Parts on the meta device (not loaded here) are skipped. Returns (experts modules, linear layers)."""
    experts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    num_dense = 0
    for key, scale in scales.items():
        match = _KEY.match(key)
        if match is None or match["stack"] not in STACKS:
            raise Fp8CheckpointError(f"{key}: FP8 weights outside the Thinker's and Talker's decoders are not read")
        layer = f"{STACKS[match['stack']]}.{match['layer']}"
        if (expert := _EXPERT.match(match["rest"])) is not None:
            experts.setdefault(f"{layer}.mlp.experts", {})[expert["proj"], int(expert["expert"])] = scale
            continue
        name = f"{layer}.{match['rest']}"
        linear = hf.get_submodule(name)
        if not linear.weight.is_meta:
            weight = linear.weight.data.to(FP8)  # the checkpoint's values, cast back exactly
            hf.set_submodule(name, Fp8Linear(weight, scale.float().to(weight.device), block,
                                             None if linear.bias is None else linear.bias.data, fused=False))
            num_dense += 1
    num_experts = 0
    for name, by_proj in experts.items():
        module = hf.get_submodule(name)
        if not module.gate_up_proj.is_meta:
            _make_fp8(module, by_proj, block)
            num_experts += 1
    return num_experts, num_dense


def _make_fp8(module: torch.nn.Module, by_proj: dict[tuple[str, int], torch.Tensor], block: int) -> None:
    """An experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I] holding the fp8 values, cast) back in FP8
    with the checkpoint's per-expert scales stacked as `omnirt.pipeline.kernels.fp8` holds them."""
    num_experts, two_inter = module.gate_up_proj.shape[:2]
    if (two_inter // 2) % block:
        raise Fp8CheckpointError(f"experts with intermediate size {two_inter // 2}: gate and up would share a "
                                 f"{block}-row scale block")
    try:
        gate_up = torch.stack([torch.cat([by_proj["gate", e], by_proj["up", e]]) for e in range(num_experts)])
        down = torch.stack([by_proj["down", e] for e in range(num_experts)])
    except KeyError as exc:
        raise Fp8CheckpointError(f"an FP8 expert without its scale: {exc}") from None
    device = module.gate_up_proj.device
    for name, scale in (("gate_up_proj", gate_up), ("down_proj", down)):
        hold(module, name, getattr(module, name).data.to(FP8), scale.float().to(device))
    module.weight_block_size = (block, block)
