"""Qwen3-Omni checkpoints published in FP8: `quantization_config: {quant_method: fp8, fmt: e4m3,
weight_block_size: [B, B]}`, each quantised linear layer of the Thinker's and Talker's decoders stored as
`<layer>.weight` (float8_e4m3fn) beside `<layer>.weight_scale_inv` (float32, one per B x B block).

transformers loads such a checkpoint without its quantizer (which needs kernels from the hub) as the fp8 values
cast to the engine's dtype, exactly, and the scales unread; `apply_scales` then makes the experts FP8 again with the
checkpoint's own values and scales (`omnirt.pipeline.kernels.fp8`), and multiplies the other layers by their
scales (they run in the engine's dtype).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from omnirt.pipeline.kernels.fp8 import FP8

log = logging.getLogger(__name__)

SCALE_SUFFIX = ".weight_scale_inv"
# the checkpoint's decoder stacks -> their module in Qwen3OmniMoeForConditionalGeneration
STACKS = {"thinker.model.layers": "thinker.model.language_model.layers", "talker.model.layers": "talker.model.layers",
          "talker.code_predictor.model.layers": "talker.code_predictor.model.layers"}
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


def apply_scales(hf: torch.nn.Module, scales: dict[str, torch.Tensor], block: int) -> tuple[int, int]:
    """Make the loaded model what the checkpoint stores: experts in FP8 with their scales, other layers scaled.
    Parts on the meta device (not loaded here) are skipped. Returns (experts modules, dense layers)."""
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
        linear = hf.get_submodule(f"{layer}.{match['rest']}")
        if not linear.weight.is_meta:
            _scale_dense(linear.weight, scale, block)
            num_dense += 1
    num_experts = 0
    for name, by_proj in experts.items():
        module = hf.get_submodule(name)
        if not module.gate_up_proj.is_meta:
            _make_fp8(module, by_proj, block)
            num_experts += 1
    return num_experts, num_dense


def _scale_dense(weight: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """The weight [N, K] holds the fp8 values (cast): times each block's scale, in place."""
    n, k = weight.shape
    expanded = scale.to(weight.device).repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    with torch.no_grad():
        weight.copy_((weight.float() * expanded).to(weight.dtype))


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
        setattr(module, name, torch.nn.Parameter(getattr(module, name).data.to(FP8), requires_grad=False))
        setattr(module, f"{name}_scale_inv", torch.nn.Parameter(scale.float().to(device), requires_grad=False))
    module.weight_block_size = (block, block)
