"""`pagedlm run-batch` with image parts in /v1/chat/completions bodies, on a tiny Qwen2.5-VL:
good lines equal LLM.chat; a bad image (undecodable, unreachable URL, file:// outside the
allowed directory, too many images, a video part) is that line's error record and the job
goes on."""

from __future__ import annotations

import base64
import io
import json

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.entrypoints.openai.run_batch import main
from tests.e2e.test_run_batch import CHAT, line, read_results
from tests.mm_models import make_tiny_qwen2_5_vl, random_image


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl-batch"))


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def body(*parts: dict) -> dict:
    content = [*parts, {"type": "text", "text": "Describe."}]
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 5}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_lines_and_bad_images(tmp_path, qwen_vl) -> None:
    one, two = random_image(90, 70, seed=1), random_image(64, 64, seed=2)
    media = tmp_path / "media"
    media.mkdir()
    (media / "two.png").write_bytes(base64.b64decode(data_url(two).split(",", 1)[1]))
    good = {
        "one": body(image_part(data_url(one))),
        "two": body(image_part(data_url(one)), image_part(f"file://{media / 'two.png'}")),
    }
    bad = {
        "undecodable": body(image_part("data:image/png;base64," + base64.b64encode(b"x").decode())),
        "unreachable": body(image_part("http://127.0.0.1:9/a.png")),
        "outside": body(image_part(f"file://{tmp_path}/elsewhere.png")),
        "too-many": body(*[image_part(data_url(one))] * 3),
        "video": body({"type": "video_url", "video_url": {"url": "x.mp4"}}),
    }
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [line(k, CHAT, b) for k, b in {**good, **bad}.items()]
    inp.write_text("\n".join(lines) + "\n")
    args = ["--model", str(qwen_vl), "--dtype", "float32", "--max-model-len", "512"]
    args += ["--allowed-local-media-path", str(media)]
    args += ["--limit-mm-per-prompt", json.dumps({"image": 2})]
    assert main(["-i", str(inp), "-o", str(out), *args]) == 1  # some lines failed
    records = {r["custom_id"]: r for r in read_results(out)}
    assert set(records) == set(good) | set(bad)
    for key in bad:
        assert records[key]["error"]["code"] == 400, key
    llm = LLM(
        str(qwen_vl),
        dtype="float32",
        max_model_len=512,
        allowed_local_media_path=str(media),
    )
    params = SamplingParams(temperature=0, max_tokens=5)
    for key, request in good.items():
        expected = llm.chat(request["messages"], params, use_tqdm=False)[0].outputs[0].text
        assert records[key]["response"]["body"]["choices"][0]["message"]["content"] == expected
