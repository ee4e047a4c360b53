"""Loading images: URLs (data, file, http) like vLLM's MediaConnector, and the values of
`multi_modal_data["image"]` normalised to PIL images.

Fetched images are converted to RGB, as vLLM does by default (`image_mode="RGB"`): RGBA is
composited on a white background, other modes are converted by Pillow.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import urllib.error
import urllib.request
from io import BytesIO
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
from PIL import Image

from pagedlm import envs

_ACCEPTED = (
    "a PIL.Image.Image, a numpy array (H, W, C) of uint8, a 4-dim tensor or array of images, or "
    "a list of these"
)


def _short(url: str) -> str:
    return url if len(url) <= 48 else url[:45] + "..."


# ------------------------------------------------------------------ decoding
def rgba_to_rgb(
    image: Image.Image, background: tuple[int, int, int] = (255, 255, 255)
) -> Image.Image:
    """An RGBA image composited on `background` (vLLM's default: white)."""
    converted = Image.new("RGB", image.size, background)
    converted.paste(image, mask=image.split()[3])
    return converted


def convert_image_mode(image: Image.Image, to_mode: str = "RGB") -> Image.Image:
    if image.mode == to_mode:
        return image
    if image.mode == "RGBA" and to_mode == "RGB":
        return rgba_to_rgb(image)
    return image.convert(to_mode)


def _decode(data: bytes, url: str) -> Image.Image:
    """Decode image bytes now (Pillow opens lazily), in RGB."""
    try:
        image = Image.open(BytesIO(data))
        image.load()
        return convert_image_mode(image, "RGB")
    except Exception as e:  # UnidentifiedImageError, truncated data, decompression bomb, ...
        raise ValueError(f"cannot decode the image at {_short(url)}: {e}") from e


# ------------------------------------------------------------------ URL kinds
def _load_data_url(url: str) -> bytes:
    """data:[<mediatype>][;<param>]*;base64,<data> (RFC 2397); only base64, like vLLM."""
    spec, sep, data = url[5:].partition(",")
    if not sep:
        raise ValueError(f"Invalid data URL {_short(url)!r}: missing ',' separator.")
    _, sep, encoding = spec.rpartition(";")
    if not sep or encoding != "base64":
        raise NotImplementedError("Only base64 data URLs are supported for now.")
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ValueError(f"cannot decode the image at {_short(url)}: invalid base64 ({e})") from e


def _allowed_dir(allowed_local_media_path: str) -> Path:
    if not allowed_local_media_path:
        raise ValueError(
            "Cannot load local files without `allowed_local_media_path` (the "
            "`--allowed-local-media-path` option): set it to the directory the images are in."
        )
    allowed = Path(allowed_local_media_path).resolve()
    if not allowed.is_dir():
        raise ValueError(
            f"Invalid `--allowed-local-media-path`: the path {allowed} does not exist or is "
            "not a directory."
        )
    return allowed


def _load_file_url(url: str, allowed_local_media_path: str) -> bytes:
    """A file:// URL, read only when it lies under `allowed_local_media_path`."""
    allowed = _allowed_dir(allowed_local_media_path)
    spec = urlparse(url)
    filepath = Path(urllib.request.url2pathname(spec.netloc + spec.path))
    if allowed not in filepath.resolve().parents:
        raise ValueError(
            f"The file path {filepath} must be a subpath of `--allowed-local-media-path {allowed}`."
        )
    try:
        return filepath.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the image at {_short(url)}: {e}") from e


def _load_http_url(url: str, timeout: float) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "pagedlm"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        cause = f"HTTP error {e.code} {e.reason}"
    except urllib.error.URLError as e:
        reason = e.reason
        timed_out = isinstance(reason, TimeoutError)
        cause = f"timed out after {timeout:g}s" if timed_out else f"cannot connect ({reason})"
    except TimeoutError:
        cause = f"timed out after {timeout:g}s (VLLM_IMAGE_FETCH_TIMEOUT)"
    except (OSError, http.client.HTTPException, ValueError) as e:
        cause = f"{type(e).__name__}: {e}"
    raise ValueError(f"Failed to fetch the image at {_short(url)}: {cause}")


def fetch_image(
    url: str, *, allowed_local_media_path: str = "", timeout: float | None = None
) -> Image.Image:
    """Load an RGB PIL image from a base64 data URL, a file:// URL under
    `allowed_local_media_path`, or an http(s) URL (`timeout` seconds, default
    VLLM_IMAGE_FETCH_TIMEOUT)."""
    if not isinstance(url, str):
        raise ValueError(f"An image URL must be a string, got {type(url).__name__}.")
    if url[:5].lower() == "data:":
        return _decode(_load_data_url(url), url)
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        seconds = envs.VLLM_IMAGE_FETCH_TIMEOUT if timeout is None else timeout
        return _decode(_load_http_url(url, seconds), url)
    if scheme == "file":
        return _decode(_load_file_url(url, allowed_local_media_path), url)
    raise ValueError(f"The URL must be either a HTTP, data or file URL, got {_short(url)!r}.")


# ------------------------------------------------------------------ multi_modal_data
def _to_uint8(array: np.ndarray, where: str) -> np.ndarray:
    if array.dtype == np.uint8:
        return array
    if array.dtype.kind == "f" and array.size and 0 <= array.min() and array.max() <= 1:
        return np.round(array * 255).astype(np.uint8)  # a [0, 1] image, as HF rescales it
    integral = array.dtype.kind in "iub" or np.all(np.mod(array, 1) == 0)
    if array.size and integral and 0 <= array.min() and array.max() <= 255:
        return array.astype(np.uint8)
    raise ValueError(
        f"{where}: an image array must hold uint8 values, values in [0, 255] or floats in "
        f"[0, 1], got dtype {array.dtype}."
    )


def _array_to_pil(array: np.ndarray, where: str) -> Image.Image:
    """(H, W), (H, W, C) with C in 1, 3, 4, or (C, H, W) with C in 1, 3 -> a PIL image."""
    if array.ndim == 3 and array.shape[-1] not in (1, 3, 4) and array.shape[0] in (1, 3):
        array = array.transpose(1, 2, 0)  # channels first
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise ValueError(
            f"{where}: an image array must be (H, W, C) with C in 1, 3 or 4 (or (H, W)), got "
            f"shape {tuple(array.shape)}."
        )
    return Image.fromarray(np.ascontiguousarray(_to_uint8(array, where)))


def _refuse_embeddings(where: str) -> None:
    raise NotImplementedError(
        f"{where}: vLLM reads a 3-dim tensor (or a list of 2-dim tensors) as image embeddings, "
        f"which pagedlm does not support; pass {_ACCEPTED}."
    )


def _one_image(item: Any, where: str) -> Image.Image:
    if isinstance(item, Image.Image):
        return item
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy()
    if isinstance(item, np.ndarray):
        return _array_to_pil(item, where)
    hint = " (URLs go in chat image_url parts)" if isinstance(item, str) else ""
    raise ValueError(
        f"{where}: unsupported image type {type(item).__name__}{hint}; pass {_ACCEPTED}."
    )


def to_pil_images(data: Any) -> list[Image.Image]:
    """The images of `multi_modal_data["image"]` as a list of PIL images (None: none)."""
    where = 'multi_modal_data["image"]'
    if data is None:
        return []
    if isinstance(data, torch.Tensor) and data.ndim == 3:
        _refuse_embeddings(where)
    if isinstance(data, (torch.Tensor, np.ndarray)) and data.ndim == 4:
        return [_one_image(item, f"{where}[{i}]") for i, item in enumerate(data)]
    if not isinstance(data, (list, tuple)):
        return [_one_image(data, where)]
    if data and all(isinstance(x, torch.Tensor) and x.ndim == 2 for x in data):
        _refuse_embeddings(where)
    return [_one_image(item, f"{where}[{i}]") for i, item in enumerate(data)]
