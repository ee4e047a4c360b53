"""LLM.beam_search (vLLM's BeamSearchOfflineMixin): plain Python over one-token generate calls.

Each step runs every live beam of the batch as its own request with ``max_tokens=1`` and
``logprobs=2*beam_width``; every returned logprob entry extends its beam. A beam's prompt is
the previous step's prompt plus one token, so its full KV blocks are prefix-cache hits and only
the last partial block is recomputed.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pagedlm.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchSequence,
    create_sort_beams_key_function,
)
from pagedlm.inputs import TokensPrompt, prompt_to_seq
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedlm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class BeamSearchMixin:
    llm_engine: LLMEngine

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over text or token prompts; one ``BeamSearchOutput`` per prompt, in order.

        Returned sequences hold the prompt tokens too, and ``text`` decodes all of them.
        """
        beam_width = params.beam_width
        tokenizer = self.get_tokenizer()  # type: ignore[attr-defined]
        eos_token_id = tokenizer.eos_token_id
        sort_beams_key = create_sort_beams_key_function(eos_token_id, params.length_penalty)

        prompt_list = prompt_to_seq(prompts)
        loras = (
            list(lora_request)
            if isinstance(lora_request, list)
            else [lora_request] * len(prompt_list)
        )
        if len(loras) != len(prompt_list):
            raise ValueError(
                f"The lengths of prompts ({len(prompt_list)}) and lora_request ({len(loras)}) "
                "must be the same."
            )
        instances = [
            BeamSearchInstance(self._render_beam_prompt(p), lora_request=lora)
            for p, lora in zip(prompt_list, loras, strict=True)
        ]

        if use_tqdm and concurrency_limit is not None:
            logger.warning(
                "Progress bar is not supported when using concurrency_limit. "
                "Disabling progress bar."
            )
            use_tqdm = False
        if concurrency_limit is None:
            concurrency_limit = len(instances)
        if concurrency_limit < 1 and instances:
            raise ValueError(f"concurrency_limit must be at least 1, got {concurrency_limit}.")

        # 2 * beam_width candidates per beam, as transformers does.
        sampling_params = SamplingParams(
            logprobs=2 * beam_width,
            max_tokens=1,
            temperature=params.temperature,
            skip_clone=True,
        )
        for start in range(0, len(instances), max(concurrency_limit, 1)):
            batch = instances[start : start + concurrency_limit]
            token_iter: Any = range(params.max_tokens)
            if use_tqdm:
                token_iter = tqdm(token_iter, desc="Beam search", unit="token", unit_scale=False)
                logger.warning(
                    "The progress bar shows the upper bound on token steps and may finish early "
                    "due to stopping conditions. It does not reflect instance-level progress."
                )
            for _ in token_iter:
                if not self._beam_search_step(batch, sampling_params, params, sort_beams_key):
                    break

        outputs = []
        for instance in instances:
            instance.completed.extend(instance.beams)
            best = sorted(instance.completed, key=sort_beams_key, reverse=True)[:beam_width]
            for beam in best:
                beam.text = tokenizer.decode(
                    beam.tokens, skip_special_tokens=params.skip_special_tokens
                )
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs

    def _render_beam_prompt(self, prompt: Any) -> dict[str, Any]:
        """A token prompt dict (``prompt_token_ids`` plus the original text and cache salt)."""
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            raise NotImplementedError("Embedding prompt not supported for beam search")
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise NotImplementedError(
                "Images in beam search are not supported by pagedlm; use LLM.generate."
            )
        processor = self.llm_engine.input_processor
        text, token_ids, cache_salt = processor.tokenize_prompt(prompt)
        rendered: dict[str, Any] = {"prompt_token_ids": token_ids}
        if text is not None:
            rendered["prompt"] = text
        if cache_salt is not None:
            rendered["cache_salt"] = cache_salt
        return rendered

    def _beam_search_step(
        self,
        batch: list[BeamSearchInstance],
        sampling_params: SamplingParams,
        params: BeamSearchParams,
        sort_beams_key: Any,
    ) -> bool:
        """Extend every live beam of `batch` by one token; False when no beam is live."""
        all_beams: list[BeamSearchSequence] = [b for inst in batch for b in inst.beams]
        if not all_beams:
            return False
        bounds = list(itertools.accumulate((len(inst.beams) for inst in batch), initial=0))
        prompts: list[TokensPrompt] = [beam.get_prompt() for beam in all_beams]
        loras = [b.lora_request for b in all_beams]  # one per beam (its prompt's adapter)
        self._add_requests(  # type: ignore[attr-defined]
            prompts, [sampling_params] * len(prompts), False, loras, None, None
        )
        output: list[RequestOutput] = self._run_engine(use_tqdm=False)  # type: ignore[attr-defined]
        eos_token_id = self.get_tokenizer().eos_token_id  # type: ignore[attr-defined]
        for (lo, hi), instance in zip(itertools.pairwise(bounds), batch, strict=True):
            new_beams: list[BeamSearchSequence] = []
            for beam, result in zip(all_beams[lo:hi], output[lo:hi], strict=True):
                if result.outputs[0].logprobs is None:
                    continue  # capped by max_model_len or aborted: the beam ends here
                logprobs = result.outputs[0].logprobs[0]
                for token_id, logprob in logprobs.items():
                    new_beam = BeamSearchSequence(
                        beam.orig_prompt,
                        tokens=beam.tokens + [token_id],
                        logprobs=beam.logprobs + [logprobs],
                        lora_request=beam.lora_request,
                        cum_logprob=beam.cum_logprob + logprob.logprob,
                    )
                    if token_id == eos_token_id and not params.ignore_eos:
                        instance.completed.append(new_beam)
                    else:
                        new_beams.append(new_beam)
            instance.beams = sorted(new_beams, key=sort_beams_key, reverse=True)[
                : params.beam_width
            ]
        return True
