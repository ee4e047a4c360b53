"""Verify draft tokens against the target model so the output distribution is exactly the
target's (Leviathan et al. / Chen et al. speculative sampling).

A request with k drafts d_1..d_k has k + 1 target rows: row j scores the position of d_{j+1}
(row k the position after the last draft). Greedy requests accept drafts while they equal the
target's argmax, then take the argmax at the first mismatch (or after the last draft): the same
tokens as decoding one at a time. Random requests accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)); n-gram drafts are deterministic (q is one-hot), so that is p_j(d_j).
On rejection the token is drawn from the residual max(p_j - q_j, 0), renormalized; when all are
accepted a bonus token is drawn from p_k. A draft model's drafts are drawn from its own q_j:
acceptance is then min(1, p_j(d_j) / q_j(d_j)).
"""

from __future__ import annotations

import torch


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    """`target_argmax` has len(drafts) + 1 entries; returns the accepted drafts + one token."""
    for j, draft in enumerate(drafts):
        if target_argmax[j] != draft:
            return target_argmax[: j + 1]
    return target_argmax[: len(drafts) + 1]


def verify_random(
    probs: torch.Tensor,  # [k + 1, vocab] target probabilities (after temperature, top-k/p)
    drafts: list[int],
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,  # [k, vocab] q of a draft model; None: one-hot
) -> list[int]:
    """Accept draft j with probability min(1, p_j(d_j) / q_j(d_j)); see the module docstring."""
    k = len(drafts)
    draft_ids = torch.tensor(drafts, dtype=torch.long, device=probs.device).unsqueeze(-1)
    p_draft = probs[:k].gather(-1, draft_ids).squeeze(-1)
    if draft_probs is not None:
        q_draft = draft_probs[:k].gather(-1, draft_ids).squeeze(-1)
        p_draft = p_draft / q_draft.clamp_min(1e-30)
    accept = p_draft.tolist()
    uniform = torch.rand(k, generator=generator).tolist()
    out: list[int] = []
    for j, draft in enumerate(drafts):
        if uniform[j] < accept[j]:
            out.append(draft)
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[draft] = 0.0  # max(p - onehot(d), 0): p with the rejected draft removed
        else:
            residual = (probs[j] - draft_probs[j]).clamp_min(0.0)
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs[len(drafts)], generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights.float(), 1, generator=generator).item())
