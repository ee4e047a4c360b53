"""Verify draft tokens against the target model so the output distribution is exactly the
target's (Leviathan et al. / Chen et al. speculative sampling).

A request with k drafts d_1..d_k has k + 1 target rows: row j scores the position of d_{j+1}
(row k the position after the last draft). Greedy requests accept drafts while they equal the
target's argmax, then take the argmax at the first mismatch (or after the last draft): the same
tokens as decoding one at a time. Random requests accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)); n-gram drafts are deterministic (q is one-hot), so that is p_j(d_j).
On rejection the token is drawn from the residual max(p_j - q_j, 0), renormalized; when all are
accepted a bonus token is drawn from p_k.
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
) -> list[int]:
    """Accept each deterministic draft with probability p_j(d_j); see the module docstring."""
    draft_ids = torch.tensor(drafts, dtype=torch.long, device=probs.device)
    p_draft = probs[: len(drafts)].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).tolist()
    uniform = torch.rand(len(drafts), generator=generator).tolist()
    out: list[int] = []
    for j, draft in enumerate(drafts):
        if uniform[j] < p_draft[j]:
            out.append(draft)
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0  # max(p - onehot(d), 0): p with the rejected draft removed
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs[len(drafts)], generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights.float(), 1, generator=generator).item())
