"""The policy's distribution of a token: one definition for the engine that samples and the trainer
that scores.

An RL trainer's importance ratio compares the log-probability the engine reported for a sampled
token with the one the trainer computes for it. They agree only if both mean the same
distribution, so both call `processed_logprobs`: the model's logits divided by the temperature,
narrowed to the `top_k` most likely tokens, to the nucleus of mass `top_p` and to the tokens at
least `min_p` times as likely as the most likely one, renormalised (vLLM's "processed logprobs").
It works on logits and token ids only, so any model the engine or the trainer runs uses it.

What it leaves out, on purpose: the engine's constraint (a grammar, or the UTF-8 rule) and
`logit_bias`. They are not the policy: the engine applies them on top when it samples, and a
trainer cannot recompute them (it would need each position's allowed set). A token the constraint
alone chose (it allowed that one token only, or none that the policy keeps) says nothing about the
policy, so the engine marks it `forced` and the trainer leaves it out of the loss and its
statistics. A temperature below `SAMPLING_EPS` is greedy decoding; its log-probabilities are those
of the raw distribution (temperature 1), as vLLM reports them.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Below this temperature sampling is greedy, as in vLLM: dividing logits by 1e-300 overflows to
# inf, and softmax of inf is NaN.
SAMPLING_EPS = 1e-5
# What a log-probability of minus infinity is reported as (JSON has no -inf; OpenAI writes -9999).
LOGPROB_FLOOR = -9999.0

Param = float | Tensor


def filters(top_p: Param = 1.0, top_k: Param = 0, min_p: Param = 0.0) -> bool:
    """Whether any row narrows its distribution (else the processed one is the tempered one)."""

    def active(x: Param, off: float, below: bool) -> bool:
        if isinstance(x, Tensor):
            return bool(((x < off) if below else (x > off)).any())
        return (x < off) if below else (x > off)

    return active(top_p, 1.0, True) or active(top_k, 0, False) or active(min_p, 0.0, False)


def processed_logprobs(
    logits: Tensor,
    temperature: Param = 1.0,
    top_p: Param = 1.0,
    top_k: Param = 0,
    min_p: Param = 0.0,
    keep: Tensor | None = None,
) -> Tensor:
    """Log-probabilities [N, V] of the processed distribution of each row of `logits` [N, V]
    (float32, minus infinity outside what the row keeps). Each parameter is a number for every row
    or a tensor [N] of one per row; `top_k` 0 keeps every token.

    `keep` [N] (token ids) stay in their row's set whatever the filters say: the trainer passes the
    tokens the engine sampled, so a float rounding at a nucleus's edge cannot make a sampled token
    impossible. Differentiable in `logits` (the kept set itself is a discrete choice)."""
    t = _column(temperature, logits)
    t = torch.where(t < SAMPLING_EPS, torch.ones_like(t), t)
    lp = torch.log_softmax(logits.float() / t, dim=-1)
    if not filters(top_p, top_k, min_p):
        return lp
    kept = kept_set(lp.detach().exp(), top_p, top_k, min_p)
    if keep is not None:
        kept[torch.arange(len(keep)), keep] = True
    lp = lp.masked_fill(~kept, float("-inf"))
    return lp - torch.logsumexp(lp, dim=-1, keepdim=True)


def sampled_logprobs(row_logits: Tensor, targets: Tensor, rows: tuple[Tensor, Tensor], temperature: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:  # fmt: skip
    """The trainer's side: the logits [N, V] at `rows` (a [B, T] mask's `nonzero(as_tuple=True)`,
    what the model's `forward_train(tokens, rows)` returns), the tokens that followed [B, T], and
    per-sequence parameters [B]. Returns [B, T]: each target's processed log-probability at `rows`,
    0 elsewhere (computed only there: a large vocabulary's head and sort stay small)."""
    seq, tok = rows[0], targets[rows]
    lp = processed_logprobs(row_logits, temperature[seq], top_p[seq], top_k[seq], keep=tok)
    picked = lp.gather(1, tok[:, None]).squeeze(1)
    return torch.zeros(targets.shape, dtype=picked.dtype).index_put(rows, picked)


def kept_set(probs: Tensor, top_p: Param = 1.0, top_k: Param = 0, min_p: Param = 0.0) -> Tensor:
    """Bool [N, V]: the tokens each row's `top_k`, nucleus (`top_p`) and `min_p` keep. The most
    likely token always stays, even for a top_p that rounds to 0 in float32."""
    n, v = probs.shape
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(dim=-1) - sorted_p) < _column(top_p, probs)  # the nucleus
    k = _column(top_k, probs).long()
    keep &= (torch.arange(v)[None, :] < k) | (k <= 0)
    keep &= sorted_p >= _column(min_p, probs) * sorted_p[:, :1]
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(1, order, keep)


def _column(x: Param, like: Tensor) -> Tensor:
    """A per-row parameter as a column [N, 1]."""
    if isinstance(x, Tensor):
        return x.to(dtype=torch.float32).reshape(-1, 1)
    return torch.full((like.shape[0], 1), float(x))
