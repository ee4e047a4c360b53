"""Quantized linear methods end to end on tiny fp32 models.

- quantization="gguf" (default for GGUF files) on a llama GGUF whose projections mix Q4_0,
  Q4_1, Q5_0, Q5_1 and Q8_0 (fused q/k/v of two types) and a Q8_0 LM head: the dequantized
  path's greedy tokens (PAGEDLM_GGUF_DEQUANTIZE=1), logprobs within the activation
  quantization's effect (these tiny random models have near-flat distributions, so a few
  sequences may part at near ties, checked as such); under tensor_parallel_size=2 too.
- quantization="int8" (W8A8): against the unquantized path on a copy whose linear weights are
  their per-channel int8 dequantizations (that path equals transformers, tests/models), within
  the activation quantization's effect.
- a compressed-tensors W8A8 checkpoint (scripts/make_w8a8_checkpoint.py) of the same model:
  exactly quantization="int8"'s outputs, and transformers' own loading of that checkpoint
  (the compressed-tensors package decompresses it) within the activations' effect.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from torch import nn
from transformers import AutoModelForCausalLM

from pagedlm import LLM, SamplingParams
from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.layers.quantization.gguf import GEMV_ROWS, PackedEmbeddingMethod, takes_gemv
from pagedlm.layers.quantization.int8 import quantize_per_channel
from pagedlm.model_loader.gguf_reader import GGUFFile
from tests.e2e.test_tensor_parallel import _prompts
from tests.gguf_writer import write_llama_gguf
from tests.proc_maps import HAS_SMAPS, resident_kb

MIXED = {
    "attn_q": T.Q5_0,
    "attn_k": T.Q5_0,
    "attn_v": T.Q8_0,
    "attn_output": T.Q4_1,
    "ffn_gate": T.Q4_0,
    "ffn_up": T.Q5_1,
    "ffn_down": T.Q8_0,
    "output": T.Q8_0,
    "token_embd": T.Q5_0,  # kept in its blocks, rows decoded when looked up (tied: packed)
}
TOP5 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
# per-token logprob difference the int8 activations may cause on these tiny models
ACTIVATION_QUANT_LOGPROB = 0.05
# Where neither the VNNI GEMM nor the AVX2 GEMV runs (the portable C GEMV only), a step of
# more than GEMV_ROWS rows multiplies dequantized weights in float, exactly the reference's
# values, so eight sequences at once would never reach the integer kernels. There, every run
# decodes GEMV_ROWS sequences at a time (prefill stays dequantized).
_LIB = cpu_kernels()
BATCH = (
    {}
    if _LIB is None or _LIB.gguf_gemm_compiled() or takes_gemv(64)
    else {"max_num_seqs": GEMV_ROWS}
)


def _generate(model, **kwargs) -> list:
    llm = LLM(str(model), dtype="float32", max_model_len=128, **BATCH, **kwargs)
    try:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        return [o.outputs[0] for o in llm.generate(prompts, TOP5, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


def _agree(got: list, want: list, tol: float) -> float:
    """Same greedy tokens with logprobs within `tol`, except that a sequence may part ways at
    a near tie: where the tokens first differ, both must be within `tol` of the reference's
    best (its top-5 logprobs). At most half the sequences may do so. Returns the
    largest logprob difference seen on agreeing tokens."""
    worst, parted = 0.0, 0
    for a, b in zip(got, want, strict=True):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if ta != tb:
                ref = b.logprobs[i]
                assert ta in ref and ref[tb].logprob - ref[ta].logprob < tol, (i, ta, tb)
                parted += 1
                break
            worst = max(worst, abs(a.logprobs[i][ta].logprob - b.logprobs[i][tb].logprob))
    assert worst < tol and parted <= len(got) // 2
    return worst


@pytest.fixture
def mixed_gguf(tiny_llama, tmp_path):
    return write_llama_gguf(tiny_llama, tmp_path / "mixed.gguf", MIXED)


def test_gguf_packed_matches_dequantized(tiny_llama, mixed_gguf, monkeypatch) -> None:
    packed = _generate(mixed_gguf, tokenizer=str(tiny_llama))
    monkeypatch.setenv("PAGEDLM_GGUF_DEQUANTIZE", "1")
    dequantized = _generate(mixed_gguf, tokenizer=str(tiny_llama))
    worst = _agree(packed, dequantized, ACTIVATION_QUANT_LOGPROB)
    assert worst > 0  # the integer kernels ran: int8 activations are not exact


@pytest.mark.parametrize("tp", [1, 2])
def test_gguf_tied_table_is_packed_once(tiny_model_factory, tmp_path, monkeypatch, tp) -> None:
    """A tied table of a packed type (Q5_0): the LM head packs its blocks and the embedding
    decodes its rows from that one copy (as llama.cpp holds it); against the dequantized file
    within the activations' rounding, under tensor parallelism too (vocabulary rows split)."""
    model = tiny_model_factory("llama", tie_word_embeddings=True)
    path = write_llama_gguf(model, tmp_path / "tied.gguf", MIXED)
    if tp == 1:
        llm = LLM(str(path), tokenizer=str(model), dtype="float32", max_model_len=64)
        runner = llm.llm_engine.model_executor.driver_worker.model_runner.model
        assert isinstance(runner.model.embed_tokens.quant_method, PackedEmbeddingMethod)
        assert runner.lm_head.packed_groups[0].packed is not None
        assert runner.model.embed_tokens.weight.is_meta  # no dense table next to it
        del llm
    packed = _generate(path, tokenizer=str(model), tensor_parallel_size=tp)
    monkeypatch.setenv("PAGEDLM_GGUF_DEQUANTIZE", "1")
    dequantized = _generate(path, tokenizer=str(model))
    _agree(packed, dequantized, ACTIVATION_QUANT_LOGPROB)


def test_gguf_packed_under_tensor_parallel(tiny_llama, mixed_gguf) -> None:
    """Column shards split rows; row-parallel shards split K into 32-value halves, too narrow
    for a 64-value chunk, so those are dequantized (exact): within the same tolerance."""
    want = _generate(mixed_gguf, tokenizer=str(tiny_llama))
    got = _generate(mixed_gguf, tokenizer=str(tiny_llama), tensor_parallel_size=2)
    _agree(got, want, ACTIVATION_QUANT_LOGPROB)


def _fake_quantized(model_dir, out, with_head: bool):
    """A copy of `model_dir` whose linear weights (and the LM head's, `with_head`: tied, the
    embedding's too) are their per-channel int8 dequantizations."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and (with_head or name != "lm_head"):
                q, scale = quantize_per_channel(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_int8_matches_its_fake_quantized_weights(tiny_model_factory, tied, tmp_path) -> None:
    """Our int8 run of the original checkpoint against the unquantized path on a copy whose
    linear weights, the LM head's included, are their int8 dequantizations; a tied embedding
    reads its rows from the int8 head (one copy of the table)."""
    model = tiny_model_factory("qwen2", tie_word_embeddings=tied)
    fake = _fake_quantized(model, tmp_path / "fake-int8", with_head=True)
    want = _generate(fake, tokenizer=str(model))
    llm = LLM(str(model), dtype="float32", max_model_len=128, quantization="int8", **BATCH)
    try:
        inner = llm.llm_engine.model_executor.driver_worker.model_runner.model
        assert inner.lm_head.weight is None
        assert inner.model.embed_tokens.weight.is_meta == tied
        attn, mlp = inner.model.layers[0].self_attn, inner.model.layers[0].mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        blocks = [layer.packed_groups[0].packed.activation_block for layer in linears]
        assert blocks == [128, 128, None, 256]  # the AMX GEMM's activation scales per layer
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        got = [o.outputs[0] for o in llm.generate(prompts, TOP5, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert _agree(got, want, ACTIVATION_QUANT_LOGPROB) > 0  # the integer kernels ran


def test_int8_tied_head_under_tensor_parallel(tiny_model_factory) -> None:
    """Each rank packs its vocabulary rows of the tied int8 head and looks its embedding rows
    up there; row-parallel shards narrower than 64 columns keep dequantized weights."""
    model = tiny_model_factory("qwen2", tie_word_embeddings=True)
    want = _generate(model, quantization="int8")
    got = _generate(model, quantization="int8", tensor_parallel_size=2)
    _agree(got, want, ACTIVATION_QUANT_LOGPROB)


@pytest.fixture
def w8a8_checkpoint(tiny_qwen2, tmp_path):
    from scripts.make_w8a8_checkpoint import write_w8a8_checkpoint

    return write_w8a8_checkpoint(tiny_qwen2, tmp_path / "w8a8")


def test_compressed_tensors_checkpoint_matches_its_dequantized_weights(
    tiny_qwen2, w8a8_checkpoint, tmp_path
) -> None:
    """The checkpoint's int8 weights (its LM head stays dense, as `ignore` says) against the
    unquantized path on their dequantizations; the method is the checkpoint's own."""
    fake = _fake_quantized(tiny_qwen2, tmp_path / "fake-int8", with_head=False)
    want = _generate(fake, tokenizer=str(tiny_qwen2))
    assert _agree(_generate(w8a8_checkpoint), want, ACTIVATION_QUANT_LOGPROB) > 0


def test_compressed_tensors_checkpoint_against_transformers(w8a8_checkpoint) -> None:
    pytest.importorskip("compressed_tensors")  # in the test extra: transformers' decompressor
    from tests.models.test_models_vs_hf import MAX_TOKENS, hf_greedy

    prompts = _prompts()
    want_tokens, want_logprobs = hf_greedy(w8a8_checkpoint, prompts)
    llm = LLM(str(w8a8_checkpoint), dtype="float32", max_model_len=128, **BATCH)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compared = 0
    for out, tokens, logprobs in zip(outs, want_tokens, want_logprobs, strict=True):
        c = out.outputs[0]
        for i, (ta, tb) in enumerate(zip(c.token_ids, tokens, strict=True)):
            if ta != tb:  # a near tie under the int8 activations: both among our top 2
                assert tb in c.logprobs[i], (i, ta, tb)
                gap = c.logprobs[i][ta].logprob - c.logprobs[i][tb].logprob
                assert gap < ACTIVATION_QUANT_LOGPROB, (i, ta, tb, gap)
                break
            assert abs(c.logprobs[i][ta].logprob - logprobs[i]) < ACTIVATION_QUANT_LOGPROB
            compared += 1
    assert compared >= len(prompts) * MAX_TOKENS // 2  # these flat models tie often


@pytest.mark.skipif(not HAS_SMAPS, reason="reads Linux's smaps")
def test_packed_gguf_holds_no_file_pages_after_loading(tiny_model_factory, tmp_path) -> None:
    """The packed copies replace what was read: once the model is loaded, the packed
    tensors' pages are gone but for Linux's fault-around (up to 64 kB mapped around each
    fault, so a read next to a released tensor maps up to that much of it again); the
    untied embedding table stays in the file's mapping (as llama.cpp keeps it), resident
    only where lookups read it. Tensors of 160-640 kB, larger than the fault-around."""
    model_dir = tiny_model_factory("llama", hidden_size=512, intermediate_size=2048)
    gguf_path = write_llama_gguf(model_dir, tmp_path / "mixed.gguf", MIXED)
    llm = LLM(str(gguf_path), tokenizer=str(model_dir), dtype="float32", max_model_len=64)
    tensors = GGUFFile(str(gguf_path)).tensors
    header_kb = min(t.offset for t in tensors) // 1024
    file_kb = gguf_path.stat().st_size // 1024
    bound_kb = header_kb + 64 * len(tensors)
    assert bound_kb < file_kb // 2
    count, rss_kb = resident_kb(gguf_path)
    assert count <= 2  # the cached metadata reader's mapping and the one the table views
    assert rss_kb <= bound_kb, (rss_kb, bound_kb)
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    embed = model.model.embed_tokens
    assert type(embed.quant_method).__name__ == "GGUFEmbeddingMethod"
    assert embed.gguf_table.file_backed  # a view of the mapping, not an anonymous copy
    assert llm.generate("hello", use_tqdm=False)[0].outputs[0].token_ids
