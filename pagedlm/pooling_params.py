"""PoolingParams: per-request options of embed / classify / score / encode (vLLM's fields)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from pagedlm.sampling_options import same_value
from pagedlm.sampling_params import RequestOutputKind

POOLING_TASKS = (
    "embed",
    "classify",
    "token_embed",
    "token_classify",
    "plugin",
    "embed&token_classify",
)
_TASK_FIELDS = {
    "embed": ("dimensions", "use_activation"),
    "token_embed": ("dimensions", "use_activation"),
    "classify": ("use_activation",),
    "token_classify": ("use_activation",),
}

_UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "step_tag_id": (None, "step pooling (process reward models)"),
    "returned_token_ids": (None, "step pooling (process reward models)"),
    "requires_token_ids": (False, "a pooler reading token ids"),
    "late_interaction_params": (None, "late-interaction (ColBERT MaxSim) scoring"),
}
"""vLLM fields a PoolingParams may carry only at their default (refused by name otherwise)."""


@dataclass
class PoolingParams:
    """`use_activation`: normalize embeddings / softmax-or-sigmoid class scores (None = on).

    `dimensions` truncates a Matryoshka embedding (before normalization).
    `truncate_prompt_tokens`: keep only the last k prompt tokens (-1: up to max_model_len).
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None  # older name of use_activation for embeddings
    use_activation: bool | None = None
    softmax: bool | None = None  # older name of use_activation for classification
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None
    requires_token_ids: bool = False
    skip_reading_prefix_cache: bool | None = None
    late_interaction_params: Any = None
    extra_kwargs: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        for name, (default, why) in _UNSUPPORTED_FIELDS.items():
            if not same_value(getattr(self, name), default):
                raise NotImplementedError(
                    f"PoolingParams.{name}={getattr(self, name)!r:.60}: {why} is not supported "
                    f"by pagedlm yet; leave it {default!r}."
                )
        legacy = self.normalize if self.normalize is not None else self.softmax
        if self.use_activation is None and legacy is not None:
            self.use_activation = legacy
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task {self.task!r}; use one of {POOLING_TASKS}.")

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)

    def verify(self, task: str, *, is_matryoshka: bool, hidden_size: int) -> None:
        """Check the options against the task and the model (vLLM's rules)."""
        if self.task is None:
            self.task = task
        elif self.task != task:
            raise ValueError(f"You cannot overwrite {self.task=!r} with {task=!r}!")
        allowed = _TASK_FIELDS.get(task, ())
        if self.dimensions is not None:
            if "dimensions" not in allowed:
                raise ValueError(f"Task {task} does not support the `dimensions` parameter.")
            if not is_matryoshka:
                raise ValueError(
                    f"Model does not support matryoshka representation, changing output "
                    f"dimensions will lead to poor results. (dimensions={self.dimensions})"
                )
            if self.dimensions > hidden_size:
                raise ValueError(
                    f"dimensions={self.dimensions} is larger than the embedding size {hidden_size}."
                )
        if self.use_activation is None:
            self.use_activation = True
