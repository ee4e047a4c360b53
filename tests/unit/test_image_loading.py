"""Image loading (pagedlm.multimodal.image): vLLM's MediaConnector rules for data, file and
http(s) URLs, and multi_modal_data["image"] values normalised to PIL images."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from pagedlm.multimodal.image import fetch_image, to_pil_images


def _image(w: int = 12, h: int = 8, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def _encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _same(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ data URLs
def test_data_url_png_round_trip() -> None:
    image = _image()
    got = fetch_image(_data_url(_encode(image)))
    assert got.mode == "RGB" and _same(got, image)


def test_data_url_jpeg_round_trip() -> None:
    image = Image.new("RGB", (16, 10), (200, 30, 90))
    got = fetch_image(_data_url(_encode(image, "JPEG"), "image/jpeg"))
    assert got.mode == "RGB" and got.size == (16, 10)
    assert np.abs(np.asarray(got).astype(int) - [200, 30, 90]).max() <= 3


def test_fetched_images_are_rgb_rgba_on_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent
    assert np.asarray(fetch_image(_data_url(_encode(rgba)))).tolist() == [[[255] * 3] * 4] * 4
    gray = fetch_image(_data_url(_encode(_image(mode="L"))))
    assert gray.mode == "RGB"


@pytest.mark.parametrize(
    "url, error, match",
    [
        (_data_url(b"not an image at all"), ValueError, "cannot decode the image at data:image"),
        (_data_url(_encode(_image())[:40]), ValueError, "cannot decode the image"),  # truncated
        ("data:image/png;base64,@@not-base64@@", ValueError, "invalid base64"),
        ("data:image/png;base64", ValueError, "missing ','"),
        ("data:image/png,rawbytes", NotImplementedError, "Only base64 data URLs"),
        ("ftp://example.com/a.png", ValueError, "HTTP, data or file URL"),
        ("a.png", ValueError, "HTTP, data or file URL"),
    ],
)
def test_bad_urls(url, error, match) -> None:
    with pytest.raises(error, match=match):
        fetch_image(url)


def test_url_must_be_a_string() -> None:
    with pytest.raises(ValueError, match="must be a string, got NoneType"):
        fetch_image(None)  # type: ignore[arg-type]


# ------------------------------------------------------------------ file URLs
def test_file_url_only_under_allowed_local_media_path(tmp_path) -> None:
    media, image = tmp_path / "media", _image(seed=1)
    (media / "sub").mkdir(parents=True)
    (media / "sub" / "a.png").write_bytes(_encode(image))
    (tmp_path / "outside.png").write_bytes(_encode(image))
    url = f"file://{media}/sub/a.png"
    assert _same(fetch_image(url, allowed_local_media_path=str(media)), image)
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        fetch_image(url)  # not set
    for outside in (f"file://{tmp_path}/outside.png", f"file://{media}/../outside.png"):
        with pytest.raises(ValueError, match="must be a subpath"):
            fetch_image(outside, allowed_local_media_path=str(media))
    with pytest.raises(ValueError, match="cannot read the image"):
        fetch_image(f"file://{media}/missing.png", allowed_local_media_path=str(media))
    with pytest.raises(ValueError, match="not a directory"):
        fetch_image(url, allowed_local_media_path=str(media / "sub" / "a.png"))


# ------------------------------------------------------------------ http URLs
@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server(no_proxy):
    """A local HTTP server: /ok.png serves a PNG, anything else is a 404."""
    png = _encode(_image(seed=2))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            ok = self.path == "/ok.png"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(png if ok else b"nope")

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", png
    httpd.shutdown()
    httpd.server_close()


def test_http_image_and_http_error(server) -> None:
    base, png = server
    assert _same(fetch_image(f"{base}/ok.png"), Image.open(io.BytesIO(png)).convert("RGB"))
    with pytest.raises(ValueError, match=r"/missing\.png: HTTP error 404"):
        fetch_image(f"{base}/missing.png")


def test_unreachable_http_url_fails_fast(no_proxy) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"http://127\.0\.0\.1:9/x\.png: cannot connect"):
        fetch_image("http://127.0.0.1:9/x.png")
    assert time.monotonic() - start < 5


def test_http_timeout_from_the_argument_and_the_env_var(no_proxy, monkeypatch) -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/slow.png"
        start = time.monotonic()
        with pytest.raises(ValueError, match="slow.png: timed out after 0.3s"):
            fetch_image(url, timeout=0.3)
        monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "0.2")
        with pytest.raises(ValueError, match="timed out after 0.2s"):
            fetch_image(url)
        assert time.monotonic() - start < 4


# ------------------------------------------------------------------ to_pil_images
def test_to_pil_images_pil_and_lists() -> None:
    a, b = _image(seed=3), _image(seed=4)
    assert to_pil_images(a) == [a]
    assert to_pil_images([a, b]) == [a, b]
    assert to_pil_images((a,)) == [a]
    assert to_pil_images([]) == [] and to_pil_images(None) == []


def test_to_pil_images_arrays() -> None:
    image = _image(seed=5)
    hwc = np.asarray(image)
    (got,) = to_pil_images(hwc)
    assert _same(got, image)
    assert _same(to_pil_images(hwc.transpose(2, 0, 1))[0], image)  # channels first
    assert _same(to_pil_images(hwc.astype(np.float32) / 255)[0], image)  # floats in [0, 1]
    assert _same(to_pil_images(hwc.astype(np.int64))[0], image)
    assert to_pil_images(hwc[..., 0])[0].mode == "L"
    assert [_same(x, image) for x in to_pil_images(np.stack([hwc, hwc]))] == [True, True]
    assert [_same(x, image) for x in to_pil_images([hwc, image])] == [True, True]


def test_to_pil_images_tensors() -> None:
    image = _image(seed=6)
    chw = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
    assert _same(to_pil_images(chw.unsqueeze(0))[0], image)  # a 4-dim batch
    assert _same(to_pil_images([chw])[0], image)  # a list of 3-dim images
    with pytest.raises(NotImplementedError, match="image embeddings"):
        to_pil_images(chw)  # vLLM: a lone 3-dim tensor is embeddings
    with pytest.raises(NotImplementedError, match="image embeddings"):
        to_pil_images([torch.zeros(4, 8)])


@pytest.mark.parametrize(
    "value, match",
    [
        ("http://x/a.png", r"unsupported image type str \(URLs go in chat image_url parts\)"),
        ({"image": 1}, "unsupported image type dict; pass a PIL.Image.Image"),
        ([_image(), 5], r'multi_modal_data\["image"\]\[1\]: unsupported image type int'),
        (np.zeros((4, 4, 2), np.uint8), "must be \\(H, W, C\\)"),
        (np.full((4, 4, 3), 300.5), "must hold uint8 values"),
    ],
)
def test_to_pil_images_refuses(value, match) -> None:
    with pytest.raises(ValueError, match=match):
        to_pil_images(value)
