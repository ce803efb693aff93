"""Images -> the vision encoder's inputs, as the checkpoint's own image processor makes them.

The released checkpoint names `Qwen2VLImageProcessor` in its preprocessor_config.json; omnirt runs its PIL twin
(`Qwen2VLImageProcessorPil`, same resizing, rescaling, normalisation and patch layout) built from that file, as
`Qwen3OmniMoeProcessor` would build it where torchvision is not installed. Images arrive decoded (RGB uint8
[H, W, 3], their alpha already composited on white as transformers' `convert_to_rgb` does).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnirt.pipeline.types import RequestError


def pixels(processor: Qwen2VLImageProcessorPil, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [patches, C*T*P*P] float32, image_grid_thw [images, 3]) of the images, in order."""
    for image in images:
        if not (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
                and min(image.shape[:2]) > 0):
            raise RequestError("an image part must hold RGB pixels (uint8, [height, width, 3])", "messages")
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def num_tokens(grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """<|image_pad|> tokens per image: its patches, merged merge_size x merge_size."""
    return (grid_thw.prod(-1) // merge_size**2).tolist()


def patch_counts(grid_thw: torch.Tensor) -> list[int]:
    return grid_thw.prod(-1).tolist()
