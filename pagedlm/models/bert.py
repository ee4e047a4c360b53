"""BERT encoder (embeddings and sequence classification) over flat packed tokens.

The forward pass takes the tokens of several requests concatenated into one row of T tokens;
`positions` restart at 0 for every request, and the encoder-only `Attention` keeps attention
inside each request through the step's `query_start_loc` (forward context). Layers are
post-norm as in Hugging Face's `modeling_bert.py`. Checkpoint names are kept verbatim
(`attention.self.query`, `attention.output.LayerNorm`, ...); query/key/value load into the
fused `attention.self.qkv_proj`.

Pooling: `BertModel.pooler` is an `EmbeddingPooler` configured from the model directory's
sentence-transformers files (`modules.json`, `1_Pooling/config.json`);
`BertForSequenceClassification.pooler` is a `ClassifierPooler` on the CLS token whose head is
BERT's pooler (dense + tanh) followed by the classifier.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.layers.attention import Attention
from pagedlm.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedlm.layers.pooler import ClassifierPooler, EmbeddingPooler
from pagedlm.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.models.interfaces import ModelBase
from pagedlm.models.weight_utils import load_packed_weights

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

# Sentence-transformers pooling modes (legacy boolean keys and the newer `pooling_mode` values).
_ST_POOLING_KEYS = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}
_ST_POOLING_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_ST_NEUTRAL_MODULES = {"transformer", "pooling", "normalize", "dropout"}

_STACKED_PARAMS = [
    (".qkv_proj", ".query", "q"),
    (".qkv_proj", ".key", "k"),
    (".qkv_proj", ".value", "v"),
]
# Buffers some checkpoints carry; never parameters.
_SKIP_SUFFIXES = ("embeddings.position_ids", "embeddings.token_type_ids")


def _load_bert_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """load_packed_weights, plus a check that every fused qkv got all of query, key, value."""
    seen: set[str] = set()

    def record() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            seen.add(name)
            yield name, tensor

    loaded = load_packed_weights(model, record(), _STACKED_PARAMS)
    missing = [
        name.replace(".qkv_proj.", f".{shard}.")
        for name in loaded
        if ".qkv_proj." in name
        for shard in ("query", "key", "value")
        if name.replace(".qkv_proj.", f".{shard}.") not in seen
    ]
    if missing:
        raise ValueError(
            f"checkpoint is missing weights for: {', '.join(sorted(missing)[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    return loaded


def _get_act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"Unsupported BERT hidden_act {name!r}") from None


def _rename_legacy(name: str) -> str:
    """Old TF-converted checkpoints call LayerNorm parameters gamma / beta."""
    if name.endswith(".gamma"):
        return name[: -len(".gamma")] + ".weight"
    if name.endswith(".beta"):
        return name[: -len(".beta")] + ".bias"
    return name


def sentence_transformers_pooler(model_dir: str | Path | None) -> EmbeddingPooler:
    """The EmbeddingPooler a sentence-transformers model directory describes.

    No `modules.json` (or no directory): MEAN pooling, normalized (vLLM's default for BERT).
    Otherwise the Pooling module's mode, normalized iff a Normalize module is listed.
    """
    modules_file = Path(model_dir) / "modules.json" if model_dir is not None else None
    if modules_file is None or not modules_file.is_file():
        return EmbeddingPooler("MEAN", normalize=True)
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize = "MEAN", False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1].lower()
        if kind not in _ST_NEUTRAL_MODULES:
            raise ValueError(
                f"{modules_file}: sentence-transformers module {module.get('type')!r} is not "
                "supported by pagedlm (only Transformer, Pooling and Normalize)."
            )
        if kind == "normalize":
            normalize = True
        elif kind == "pooling":
            config_file = Path(model_dir) / module.get("path", "") / "config.json"
            if config_file.is_file():
                pooling_type = _st_pooling_type(json.loads(config_file.read_text()), config_file)
    return EmbeddingPooler(pooling_type, normalize=normalize)


def _st_pooling_type(config: dict[str, Any], source: Path) -> str:
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
        found = [_ST_POOLING_MODES.get(m) for m in modes]
        names = modes
    else:
        names = [k for k in _ST_POOLING_KEYS if config.get(k)]
        found = [_ST_POOLING_KEYS[k] for k in names]
    if not names:
        return "MEAN"
    if len(found) != 1 or found[0] is None:
        raise ValueError(f"{source}: pooling {names} is not supported (one of CLS, MEAN, LAST).")
    return found[0]


class BertLayerNorm(nn.Module):
    """nn.LayerNorm with `weight_loader`s on its parameters."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        for p in (self.weight, self.bias):
            p.weight_loader = lambda p, w, shard_id=None: default_weight_loader(p, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"BERT position_embedding_type {config.position_embedding_type!r} is not "
                "supported (only 'absolute')."
            )
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden)
        self.position_embeddings = VocabParallelEmbedding(
            config.max_position_embeddings, hidden, replicated=True
        )
        self.token_type_embeddings = VocabParallelEmbedding(
            config.type_vocab_size, hidden, replicated=True
        )
        self.LayerNorm = BertLayerNorm(hidden, config.layer_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, True)
        self.num_heads = self.qkv_proj.num_heads  # this tensor-parallel rank's heads
        self.q_size = self.qkv_proj.q_size
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_heads,
            attn_type="encoder_only",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size] * 3, dim=-1)
        return self.attn(q, k, v)


class BertSelfOutput(nn.Module):
    """dense -> + residual -> LayerNorm (post-norm); also BertOutput's shape."""

    def __init__(self, in_size: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_size, hidden, bias=True)
        self.LayerNorm = BertLayerNorm(hidden, eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act_fn = _get_act(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.dense(hidden_states))


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(
            config.intermediate_size, config.hidden_size, config.layer_norm_eps
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attn_out = self.attention(hidden_states)
        return self.output(self.intermediate(attn_out), attn_out)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class BertModel(ModelBase):
    """BERT encoder for embeddings: flat packed tokens -> last hidden states [T, hidden].

    `pooler` (an EmbeddingPooler) is applied by the runner to each request's rows.
    """

    accepts_token_type_ids = True
    is_pooling_model = True
    # Checkpoint heads a BertModel does not use (BertModel's own `pooler.dense`, MLM/NSP `cls`,
    # a classifier's `classifier`).
    _unused_prefixes = ("pooler.", "cls.", "classifier.", "qa_outputs.")

    def __init__(self, config: Any, max_position: int, model_dir: str | None = None) -> None:
        super().__init__()
        if max_position > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_position} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings}."
            )
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = sentence_transformers_pooler(model_dir)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids))

    def _checkpoint_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = _rename_legacy(name.removeprefix("bert."))
            if name.startswith(self._unused_prefixes) or name.endswith(_SKIP_SUFFIXES):
                continue
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names with or without the `bert.` prefix; unused heads and buffers are skipped."""
        return _load_bert_weights(self, self._checkpoint_names(weights))


class BertPooler(nn.Module):
    """Hugging Face's BertPooler on an already pooled (CLS) row: dense + tanh."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class BertForSequenceClassification(ModelBase):
    """BERT + pooler (dense + tanh on CLS) + classifier; `pooler` gives class scores.

    Checkpoint `bert.pooler.dense.*` loads into `bert_pooler.dense.*` (our `bert.pooler` is the
    encoder's embedding pooler, which has no weights).
    """

    accepts_token_type_ids = True
    is_pooling_model = True

    def __init__(self, config: Any, max_position: int, model_dir: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.bert = BertModel(config, max_position, model_dir=model_dir)
        self.bert_pooler = BertPooler(config.hidden_size)
        self.classifier = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True)
        # A bound method, so that the head's weights are registered once (here, not in pooler).
        self.pooler = ClassifierPooler("CLS", self.head, config.num_labels)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled CLS row(s) [..., hidden] -> logits [..., num_labels]."""
        pooled = pooled.to(self.classifier.weight.dtype)
        return self.classifier(self.bert_pooler(pooled))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.bert(input_ids, positions, token_type_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def names() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = _rename_legacy(name)
                if name.endswith(_SKIP_SUFFIXES):
                    continue
                if name.startswith("bert.pooler."):
                    name = "bert_pooler." + name.removeprefix("bert.pooler.")
                yield name, tensor

        return _load_bert_weights(self, names())
