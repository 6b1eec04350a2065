"""Images in chat messages, up to their bytes: `image_url` content parts (data: URLs, or http(s) URLs when the
server allows them), checked before anything is sent to an encoder. Every error names the content part.

Parsing (no I/O) flattens a message's parts to text, with IMAGE_MARKER where each image was; once the model is
known the marker becomes the model's image placeholder token (catalog.ServedModel.render_chat, after the client's
text is protected: a client cannot write the placeholder token itself).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field

from engine_core.images import ImageError, ImageLimits, inspect_image
from services.gateway.catalog import IMAGE_MARKER, ServedModel
from services.gateway.egress import EgressGuard, FetchRefused, FetchTooLarge
from services.gateway.errors import invalid

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL)


@dataclass(frozen=True)
class ImagePart:
    param: str  # where it was, for errors: messages[i].content[j]
    url: str  # a data: URL or an http(s) URL


@dataclass(frozen=True)
class ImageSettings:
    limits: ImageLimits
    max_images: int  # per request
    allow_remote: bool  # fetch http(s) URLs (off by default: the gateway would fetch any address a client names)
    fetch_timeout_s: float
    egress: EgressGuard = field(default_factory=EgressGuard)  # where remote fetches may go (egress.py)


def check_text(text: str, param: str) -> None:
    if IMAGE_MARKER in text:
        raise invalid(param, f"'{param}' must not contain {IMAGE_MARKER!r}")


def check_count(parts: tuple[ImagePart, ...], settings: ImageSettings) -> None:
    if len(parts) > settings.max_images:
        raise invalid(
            parts[settings.max_images].param,
            f"too many images: at most {settings.max_images} per request, got {len(parts)}",
        )


def check_accepts_images(model: ServedModel, parts: tuple[ImagePart, ...]) -> None:
    """A 400 naming the first image part for a model that takes no images."""
    if parts and model.image_token_id is None:
        raise invalid(parts[0].param, f"the model {model.name!r} does not accept images")


async def read_image(part: ImagePart, settings: ImageSettings) -> bytes:
    """The image's bytes, checked (PNG or JPEG, within the limits) from its header."""
    url = part.url
    if url.startswith("data:"):
        data = _decode_data_url(part)
    elif url.startswith(("http://", "https://")):
        if not settings.allow_remote:
            raise invalid(
                part.param,
                "remote image URLs are not allowed on this server: send the image inline as "
                "a data: URL (data:image/png;base64,...)",
            )
        data = await _fetch(part, settings)
    else:
        raise invalid(
            part.param,
            "an image URL must be a data: URL (data:image/png;base64,...)"
            + (" or an http(s) URL" if settings.allow_remote else ""),
        )
    try:
        inspect_image(data, settings.limits)
    except ImageError as exc:
        raise invalid(part.param, f"bad image: {exc}") from None
    return data


def _decode_data_url(part: ImagePart) -> bytes:
    match = _DATA_URL.fullmatch(part.url)
    if match is None:
        raise invalid(part.param, "a data: image URL must be base64: data:image/png;base64,...")
    try:
        return base64.b64decode(match.group("data"), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(part.param, "the image's data: URL is not valid base64") from None


async def _fetch(part: ImagePart, settings: ImageSettings) -> bytes:
    """GET the URL through the egress guard. One answer for every network outcome (refused address, closed port,
    timeout, HTTP error, redirect): which one happened would map the gateway's network for the client."""
    limit = settings.limits.max_bytes
    try:
        return await settings.egress.fetch(part.url, limit, settings.fetch_timeout_s)
    except FetchRefused:
        raise invalid(part.param, f"{part.param}.image_url could not be fetched") from None
    except FetchTooLarge:
        raise invalid(part.param, f"the image is over the limit of {limit} bytes") from None
