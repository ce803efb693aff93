"""Images in requests: data URLs (the server fetches nothing) checked against the limits and decoded to the RGB
pixels the engine takes. Chat completions and Realtime raise the `ImageError` in their own error shapes."""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
DETAILS = ("auto", "low", "high")  # accepted; every image is processed as the checkpoint's processor does
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL)


@dataclass(slots=True, frozen=True)
class ImageLimits:
    max_bytes: int = 10 * 2**20  # one image's encoded size (its base64 text is 4/3 of it)
    max_pixels: int = 4096 * 4096  # its width x height, read from its header before it is decoded
    max_images: int = 8  # per chat request; per Realtime conversation

    def __post_init__(self):
        assert self.max_bytes >= 1024 and self.max_pixels >= 64 and self.max_images >= 0


class ImageError(ValueError):
    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message, self.code = message, code


def decode_data_url(url: str, limits: ImageLimits) -> np.ndarray:
    """`data:image/<png|jpeg|webp|gif>;base64,<data>` -> RGB uint8 [height, width, 3]."""
    if url.lower().startswith(("http://", "https://")):
        raise ImageError("image URLs are not fetched: send the image inline as a data URL "
                         "(data:image/png;base64,...)", "image_url_not_supported")
    match = _DATA_URL.fullmatch(url)
    if match is None or ";base64" not in match["params"].lower():
        raise ImageError("the image must be a base64 data URL (data:image/png;base64,...)", "invalid_image_url")
    media_type = match["type"].strip().lower()
    if media_type not in MEDIA_TYPES:
        raise ImageError(f"image type {media_type or '(none)'!r} is not supported ({', '.join(MEDIA_TYPES)})",
                         "unsupported_image_format")
    data = match["data"]
    if len(data) * 3 // 4 > limits.max_bytes + 2:
        raise ImageError(f"the image is larger than the limit of {limits.max_bytes} bytes", "image_too_large")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError("the image's data is not valid base64", "invalid_base64") from exc
    if len(raw) > limits.max_bytes:
        raise ImageError(f"the image is larger than the limit of {limits.max_bytes} bytes", "image_too_large")
    return decode_image(raw, limits.max_pixels)


def decode_image(raw: bytes, max_pixels: int) -> np.ndarray:
    """Encoded PNG, JPEG, WebP or GIF (its first frame) -> RGB uint8 [height, width, 3]."""
    try:
        image = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError as exc:
        raise ImageError(f"the image has more than {max_pixels} pixels", "image_too_large") from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageError("the image cannot be decoded (not a PNG, JPEG, WebP or GIF image)", "invalid_image") from exc
    if image.format not in MEDIA_TYPES.values():
        raise ImageError(f"image format {image.format} is not supported (PNG, JPEG, WebP, GIF)",
                         "unsupported_image_format")
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"the image has {width}x{height} pixels, more than the limit of {max_pixels}",
                         "image_too_large")
    try:
        image.load()
        return np.asarray(_rgb(image), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise ImageError(f"the image cannot be decoded: {exc}", "invalid_image") from exc


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white, as transformers' `convert_to_rgb` (the released processor's
    `do_convert_rgb`) does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")
