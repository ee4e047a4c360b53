"""benchmarks/make_shaped_gguf.py: the scaling table's GGUF files hold the Hugging Face
directory's weights under llama.cpp's qwen2 names and metadata.

- F32: pagedlm on the file gives the directory's greedy tokens, logprobs within 1e-4 (the
  directory's path equals transformers, tests/models), with the default model's tokenizer.
- Q8_0: every matrix read back is its original within half a quantization step per block
  (and the fp16 rounding of the block's scale).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from safetensors import safe_open

from pagedlm import LLM, SamplingParams
from pagedlm.model_loader.gguf_loader import gguf_tensor_name
from pagedlm.model_loader.gguf_reader import GGUFFile
from tests.e2e.test_tensor_parallel import _prompts

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def shaped(tiny_model_factory):
    # the shaped models' layout: the default model's vocabulary, tied head, q/k/v biases
    model = tiny_model_factory("qwen2", vocab_size=151936, tie_word_embeddings=True)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield model, importlib.import_module("make_shaped_gguf")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _generate(model: str) -> list:
    llm = LLM(model, dtype="float32", max_model_len=128)
    try:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        return [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


def test_f32_file_runs_as_its_directory(shaped, tmp_path) -> None:
    model, writer = shaped
    path = writer.make_shaped_gguf(model, tmp_path / "m.gguf", "F32")
    meta = GGUFFile(path).metadata
    assert meta["general.architecture"] == "qwen2"
    assert len(meta["tokenizer.ggml.tokens"]) == 151936
    assert meta["tokenizer.ggml.eos_token_id"] == 151645
    for got, want in zip(_generate(str(path)), _generate(str(model)), strict=True):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            for token, lp in b.items():
                assert abs(a[token].logprob - lp.logprob) < 1e-4


def test_q8_0_file_holds_the_weights(shaped, tmp_path) -> None:
    model, writer = shaped
    path = writer.make_shaped_gguf(model, tmp_path / "m.gguf", "Q8_0")
    reader = GGUFFile(path)
    stored = {t.name: t for t in reader.tensors}
    assert "output.weight" not in stored  # tied: llama.cpp reads token_embd
    with safe_open(next(Path(model).glob("*.safetensors")), framework="np") as f:
        for name in f.keys():  # noqa: SIM118
            if name == "lm_head.weight":
                continue
            want = f.get_tensor(name).astype(np.float32)
            info = stored[gguf_tensor_name(name)]
            raw = np.frombuffer(reader.tensor_bytes(info), dtype=np.uint8)
            if want.ndim == 1:
                assert info.ggml_type == GGMLQuantizationType.F32
                np.testing.assert_array_equal(raw.view(np.float32), want)
                continue
            assert info.ggml_type == GGMLQuantizationType.Q8_0
            got = quants.dequantize(raw, GGMLQuantizationType.Q8_0).reshape(want.shape)
            blocks = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True)
            step = np.repeat(blocks / 127, 32, axis=1).reshape(want.shape)
            # half a step, plus the scale's rounding to fp16 times the largest code (127)
            assert (np.abs(got - want) <= step * (0.5 + 127 * 2**-11) + 1e-7).all(), name
