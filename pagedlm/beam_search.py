"""Beam search state and scoring (the ``vllm.beam_search`` surface).

A beam's ``tokens`` include its prompt, so the length in the score counts the prompt too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedlm.inputs import TokensPrompt
from pagedlm.logprobs import Logprob


@dataclass
class BeamSearchSequence:
    """One hypothesis: the prompt tokens followed by the generated ones.

    ``logprobs[i]`` is the whole logprob dict returned at generated position i (not only the
    chosen token's entry). ``text`` is filled when the beam is returned; ``finish_reason`` and
    ``stop_reason`` are not filled by the offline path (as in vLLM).
    """

    orig_prompt: dict[str, Any]
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def get_prompt(self) -> TokensPrompt:
        """The token prompt that continues this beam (keeps the original cache salt)."""
        prompt = TokensPrompt(prompt_token_ids=self.tokens)
        salt = self.orig_prompt.get("cache_salt")
        if salt is not None:
            prompt["cache_salt"] = salt
        return prompt


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """The live beams and the completed (EOS-ended) ones of one prompt."""

    def __init__(
        self,
        prompt: dict[str, Any],
        lora_request: Any = None,
        logprobs: list[dict[int, Logprob]] | None = None,
    ) -> None:
        self.beams: list[BeamSearchSequence] = [
            BeamSearchSequence(
                orig_prompt=prompt,
                tokens=list(prompt["prompt_token_ids"]),
                logprobs=[] if logprobs is None else list(logprobs),
                lora_request=lora_request,
            )
        ]
        self.completed: list[BeamSearchSequence] = []


def get_beam_search_score(
    tokens: list[int],
    cumulative_logprob: float,
    eos_token_id: int | None,
    length_penalty: float = 1.0,
) -> float:
    """``cum_logprob / seq_len ** length_penalty``; seq_len counts the prompt, not a final EOS."""
    seq_len = len(tokens)
    if tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


def create_sort_beams_key_function(
    eos_token_id: int | None, length_penalty: float
) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


__all__ = [
    "BeamSearchInstance",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "create_sort_beams_key_function",
    "get_beam_search_score",
]
