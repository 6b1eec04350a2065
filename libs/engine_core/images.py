"""Image bytes as the mesh takes them: PNG or JPEG, within size limits, named by their content hash.

The gateway checks the header (`inspect_image`, cheap: no pixel is decoded) before it sends an image anywhere; the
encoder decodes it whole (`decode_image`). Both raise ImageError, whose message names the problem for the client.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG")


class ImageError(ValueError):
    """Image bytes the mesh refuses: not PNG or JPEG, corrupt or truncated, or too large."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 8 * 2**20  # the encoded file
    max_side: int = 4096  # width or height, in pixels
    max_pixels: int = 4096 * 4096  # width * height (decoded, 3 bytes each)


@dataclass(frozen=True)
class ImageInfo:
    format: str  # PNG | JPEG
    width: int
    height: int


def image_hash(data: bytes) -> bytes:
    """The image's key: SHA-256 of its bytes. It enters the block keys of the prompt positions it fills."""
    return hashlib.sha256(data).digest()


def _open(data: bytes, limits: ImageLimits) -> Image.Image:
    if not data:
        raise ImageError("the image is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"the image has too many pixels; the limit is {limits.max_pixels}") from None
    except UnidentifiedImageError:
        raise ImageError("the image is not a PNG or JPEG file (or its header is corrupt)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError(f"the image is corrupt or truncated: {exc}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"the image has no pixels ({width}x{height})")
    if max(width, height) > limits.max_side or width * height > limits.max_pixels:
        raise ImageError(
            f"the image is {width}x{height} pixels; the limit is {limits.max_side} pixels a side "
            f"and {limits.max_pixels} in all"
        )
    return image


def inspect_image(data: bytes, limits: ImageLimits) -> ImageInfo:
    """Format and size from the header alone; ImageError unless it is PNG or JPEG within the limits."""
    image = _open(data, limits)
    return ImageInfo(str(image.format), image.width, image.height)


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """Every pixel, as RGB; ImageError for anything `inspect_image` refuses and for corrupt or truncated data."""
    image = _open(data, limits)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError(f"the {image.format} image is corrupt or truncated: {exc}") from None
