"""Token embedding and LM head, split over tensor-parallel ranks by vocabulary rows.

Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the vocabulary, per_rank =
ceil(vocab / tp); rows past the vocabulary are zero padding. A lookup zeroes the ids this rank
does not hold and all-reduces; the LM head gathers every rank's logits on the first rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from pagedlm.layers.linear import default_weight_loader, linear, prepack_weight
from pagedlm.layers.quantization import current_quantization
from pagedlm.platforms import current_platform


class VocabParallelEmbedding(nn.Module):
    """`replicated=True` keeps the whole table on every rank (small tables: positions)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, replicated: bool = False) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_size = 1 if replicated else get_tensor_model_parallel_world_size()
        self.tp_rank = 0 if replicated else get_tensor_model_parallel_rank()
        per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        # empty, not zeros: loading writes every vocabulary row (a table held quantized never
        # touches these pages, and zeroing them cost a dense table's RSS at load); only the
        # padding rows past the vocabulary are zeroed
        weight = torch.empty(per_rank, embedding_dim)
        weight[self.vocab_end - self.vocab_start :].zero_()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # how lookups read a table held quantized (`look_up_with`), or None: the dense weight
        self.quant_method: Any = None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        from pagedlm.layers.quantization.gguf import GGUFEmbeddingMethod, GGUFRawTensor

        # a GGUF file's table kept as blocks (an untied LM head's go to its method's sink; a
        # tied head packs these after loading)
        if isinstance(loaded_weight, GGUFRawTensor) and param is self.weight:
            method = GGUFEmbeddingMethod()
            method.load(self, loaded_weight)
            self.look_up_with(method)
            return
        if self.tp_size == 1:
            default_weight_loader(param, loaded_weight)
            return
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"checkpoint tensor has {loaded_weight.shape[0]} rows, expected "
                f"{self.num_embeddings}"
            )
        n = self.vocab_end - self.vocab_start
        rows = loaded_weight.narrow(0, self.vocab_start, n)
        default_weight_loader(param.data.narrow(0, 0, n), rows)

    def look_up_with(self, method: Any) -> None:
        """Lookups go to `method.embedding(self, ids)` (the table held quantized: its GGUF
        blocks, or a tied int8 head); the dense parameter becomes a placeholder (shape and
        dtype kept, no memory)."""
        self.quant_method = method
        dense = self.weight
        placeholder = torch.empty(dense.shape, dtype=dense.dtype, device="meta")
        self.weight = nn.Parameter(placeholder, requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        held = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(held, input_ids - self.vocab_start, 0)
        out = self._lookup(local_ids) * held.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


def _is_int8(method: Any) -> bool:
    from pagedlm.layers.quantization.int8 import Int8LinearMethod

    return isinstance(method, Int8LinearMethod)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding.

    A tied head keeps the embedding's dense weight for lookups and adds a prepacked copy.
    Under quantization="gguf" an untied head is a GGUF linear (its rows: this rank's vocab); a
    tied one packs the embedding's GGUF blocks where loading kept them (a type with packed
    kernels), else reads the dense table. Under quantization="int8" the head is an int8
    linear, tied or not. A tied embedding then reads its rows from the head's packed weight
    (`PackedEmbeddingMethod`: one copy of the table, as llama.cpp holds it).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tied = False
        self.logits_weight: torch.Tensor | None = None  # prepacked copy of the dense weight
        self.quant_method = None
        method = current_quantization()
        if method in ("gguf", "int8"):
            from pagedlm.layers.quantization.gguf import GGUFLinearMethod
            from pagedlm.layers.quantization.int8 import Int8LinearMethod

            self.output_size, self.input_size = self.weight.shape
            self.params_dtype = self.weight.dtype
            self.quant_method = GGUFLinearMethod() if method == "gguf" else Int8LinearMethod()
            self.quant_method.create_weights(self)

    def shard_ids(self) -> tuple[object, ...]:
        """One checkpoint tensor fills the head (the int8 method quantizes it then)."""
        return (None,)

    def tie_weights(self, embed: VocabParallelEmbedding) -> None:
        self.weight = embed.weight
        self.tied = True
        # not a submodule (its table is the model's, loaded once): a plain reference
        object.__setattr__(self, "_tied_embedding", embed)

    def process_weights_after_loading(self) -> None:
        from pagedlm.layers.quantization.gguf import GGUFLinearMethod, PackedEmbeddingMethod

        if self.tied and isinstance(self.quant_method, GGUFLinearMethod):
            table = getattr(self._tied_embedding, "gguf_table", None)
            if table is None:  # the table was loaded dense: the dense tied path below
                self.quant_method = None
            else:  # pack the embedding's blocks as this head's weight
                self.gguf_shards.append((0, table))
                del self._tied_embedding.gguf_table
        if self.quant_method is not None:
            if _is_int8(self.quant_method):
                self.quant_method.process_weights_after_loading(self)  # the (shared) table
            else:
                held = sum(t.shape[0] for _, t in self.gguf_shards)
                if held < self.output_size:  # padding rows past the vocabulary (TP)
                    pad = torch.zeros(self.output_size - held, self.input_size)
                    self.gguf_shards.append((held, pad))
                self.quant_method.process_weights_after_loading(self)  # may become unquantized
            groups = getattr(self, "packed_groups", None)
            if self.tied and groups and groups[0].packed is not None:
                self._tied_embedding.look_up_with(PackedEmbeddingMethod(groups[0].packed))
            return
        if self.tied:  # lookups need the dense weight: only add the packed copy
            weight = self.weight.data
            self.logits_weight = current_platform.prepack_linear_weight(weight)
            if self.logits_weight is None and current_platform.reads_dense_weight(weight):
                self.logits_weight = weight  # small batches: the kernel; larger: F.linear
            return
        self.logits_weight = prepack_weight(self)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[num_rows, hidden] -> [num_rows, vocab] in the model's dtype (the sampler casts);
        None on tensor-parallel ranks other than the first (they only send their part)."""
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden_states)
        else:
            logits = linear(hidden_states, self.weight, None, self.logits_weight)
        if self.tp_size == 1:
            return logits
        logits = tensor_model_parallel_gather(logits, dst=0, dim=-1)
        return None if logits is None else logits[:, : self.num_embeddings]
