"""Prompt-lookup (n-gram) drafts: find the request's last n tokens earlier in its own tokens
and propose the tokens that followed the latest such occurrence.

n goes from `prompt_lookup_max` down to `prompt_lookup_min`; the first n with a match wins.
At most `num_speculative_tokens` drafts, fewer when the match is near the end of the context.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedlm.config import SpeculativeConfig
from pagedlm.worker.input_batch import CachedRequestState


def can_speculate(state: CachedRequestState) -> bool:
    """Drafts are verified with each request's own sampling parameters, which holds only when
    they do not depend on the tokens before (no penalties, bad words, grammar or pending
    min_tokens)."""
    p = state.sampling_params
    return (
        p is not None
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and p.repetition_penalty == 1.0
        and not p.bad_words_token_ids
        and p.structured_outputs is None
        and len(state.output_token_ids) + 1 >= p.min_tokens
    )


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, context: np.ndarray) -> list[int]:
        """Drafts following the latest earlier occurrence of the context's suffix ([] if none)."""
        length = len(context)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = context[length - n :]
            # windows starting before the suffix itself; a match at s is followed by s + n
            windows = sliding_window_view(context[: length - 1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts):
                follow = int(starts[-1]) + n
                return context[follow : follow + self.k].tolist()
        return []
