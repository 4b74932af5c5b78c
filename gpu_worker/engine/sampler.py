"""Next-token choice for every sequence of a batch, each with its own parameters.

Randomness is a pure function of (seed, position of the token in the context): each
draw is torch.rand's stream after `manual_seed` of both (drawn in C, ops/cpu/uniform.py),
so a request yields the same tokens whatever else shares its batch, on any worker, and
after a preemption or a handoff to another worker (which continues at the same position).

Log probabilities (docs/logprobs.md), only for sequences that ask (`params.logprobs`): the
log-softmax of the row the draw starts from, i.e. after the grammar mask, the repetition penalty
and the temperature (greedy: unscaled), before top-k/top-p truncation. One extra pass over those
rows only; a batch where nobody asks pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from gpu_worker.engine.constraint import Constraints
from gpu_worker.engine.sequence import Sequence, TokenLogprobs
from gpu_worker.ops.cpu import uniform as cpu_uniform

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """SplitMix64 of (seed, position): well-spread 63-bit seed for torch.Generator."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def apply_repetition_penalty(logits: torch.Tensor, token_ids: Seq[int], penalty: float) -> None:
    """In place on one row [vocab]: seen tokens' positive logits / penalty, negative ones * penalty."""
    seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=logits.device)
    picked = logits.index_select(0, seen)
    logits.index_copy_(0, seen, torch.where(picked > 0, picked / penalty, picked * penalty))


NUCLEUS_CANDIDATES = 1024  # top-p looks at the best this many tokens before it sorts a whole row


@dataclass
class Candidates:
    """The tokens some rows of a batch draw from."""

    rows: torch.Tensor                # [R] int64 rows of the batch
    logits: torch.Tensor              # [R, W] float32 (scaled), -inf = excluded
    token_ids: torch.Tensor | None    # [R, W] int64 vocab id of each column; None: column j is token j


def _filter_by_sort(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Exact top-k/top-p over whole sorted rows. logits [R, vocab], k [R] (vocab = off), top_p [R]
    -> [R, vocab] with what they exclude at -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)       # [R, vocab]
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs                         # mass of strictly better tokens
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False                                                 # the best token always stays
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> list[Candidates]:
    """What each row may draw from after top-k and top-p, in up to three groups of rows.

    Sorting a whole vocabulary row is slow on CPU (docs/performance.md), so rows that ask for neither keep their whole
    row, and the others look only at their best W tokens (one `topk`; W = the largest k, or
    NUCLEUS_CANDIDATES for a row with top-p alone): top-k never reaches past them, and top-p does
    not either once their mass reaches p. Rows where it does not (very flat distributions) fall
    back to a whole-row sort. Each row's candidates depend on that row alone.

    Args:
        logits: [B, vocab] float32, already divided by temperature.
        top_k: [B] int64, 0 = off.
        top_p: [B] float32, 1.0 = off.
    """
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))   # [B]
    limited = (k < vocab) | (top_p < 1.0)
    if not bool(limited.any()):
        return [Candidates(torch.arange(logits.shape[0], device=logits.device), logits, None)]
    groups = []
    if not bool(limited.all()):
        free = (~limited).nonzero().flatten()
        groups.append(Candidates(free, logits[free], None))
    rows = limited.nonzero().flatten()
    sub, k, top_p = logits[rows], k[rows], top_p[rows]                 # [R, vocab], [R], [R]
    limit_k = k < vocab
    width = min(vocab, int(torch.where(limit_k, k, NUCLEUS_CANDIDATES).max()))
    values, order = sub.topk(width, dim=-1)                            # [R, W] best first
    drop = torch.arange(width, device=logits.device).expand_as(values) >= k.unsqueeze(1)
    # probabilities under the top-k distribution: over the kept candidates, or over the whole row
    normalizer = torch.logsumexp(values.masked_fill(drop, float("-inf")), dim=-1, keepdim=True)
    if not bool(limit_k.all()):
        normalizer = torch.where(limit_k.unsqueeze(1), normalizer, torch.logsumexp(sub, dim=-1, keepdim=True))
    probs = (values - normalizer).exp().masked_fill(drop, 0.0)
    mass = probs.cumsum(dim=-1)
    drop |= (mass - probs) >= top_p.unsqueeze(1)
    drop[:, 0] = False                                                 # the best token always stays
    unsure = ~limit_k & (mass[:, -1] < top_p)                          # the nucleus may go past W
    sure = ~unsure
    groups.append(Candidates(rows[sure], values[sure].masked_fill(drop[sure], float("-inf")), order[sure]))
    if bool(unsure.any()):
        groups.append(Candidates(rows[unsure], _filter_by_sort(sub[unsure], k[unsure], top_p[unsure]), None))
    return groups


class Sampler:
    """Picks one token per sequence from the step's logits.

    Args:
        constraints: grammar masks for sequences with a matcher (applied first, before the
            penalty, temperature, top-k/top-p and the seeded draw, so a seed still reproduces).
    """

    def __init__(self, constraints: Constraints | None = None) -> None:
        self.constraints = constraints

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Args: logits [num_seqs, vocab] float32 (one row per seq, same order). Returns token ids."""
        logits = logits.float()
        if self.constraints is not None:
            logits = self.constraints.apply_masks(logits, seqs)
        penalized = [row for row, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
        if penalized:
            logits = logits.clone()
            for row in penalized:
                apply_repetition_penalty(logits[row], seqs[row].token_ids, seqs[row].params.repetition_penalty)
        tokens = [0] * len(seqs)
        greedy = [i for i, seq in enumerate(seqs) if seq.params.greedy]
        sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if greedy:
            for i, token in zip(greedy, _rows(logits, greedy).argmax(dim=-1).tolist()):
                tokens[i] = token
        if sampled:
            for i, token in zip(sampled, self._sample(_rows(logits, sampled), [seqs[i] for i in sampled])):
                tokens[i] = token
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs]
        if wanted:
            found = token_logprobs(_rows(logits, wanted), [seqs[i] for i in wanted], [tokens[i] for i in wanted])
            for i, entry in zip(wanted, found):
                seqs[i].sampled = entry
        return tokens

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        # logits: [B, vocab]
        device = logits.device
        top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long, device=device)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=device)
        if any(s.params.temperature != 1.0 for s in seqs):     # x / 1 is x: the default skips a pass
            temperature = torch.tensor([s.params.temperature for s in seqs], device=device).unsqueeze(1)
            logits = logits / temperature
        # exponential race: argmax(p / E) with E ~ Exp(1) per token is a draw from p. The noise
        # is keyed by token id, so a tiny change in the logits (another batch, another chunking)
        # flips a draw only when two tokens' scores nearly tie; an inverse-CDF draw flipped ~1/4
        # of draws under bf16-size noise in the logits.
        noise = _exponential_noise(seqs, logits.shape[1]).to(device)                             # [B, vocab]
        tokens = torch.empty(len(seqs), dtype=torch.long, device=device)
        for group in top_k_top_p_candidates(logits, top_k, top_p):
            group_noise = _rows(noise, group.rows)                                       # a group's rows ascend
            if group.token_ids is not None:
                group_noise = group_noise.gather(1, group.token_ids)
            cols = (group.logits.softmax(dim=-1) / group_noise).argmax(dim=-1)
            tokens[group.rows] = cols if group.token_ids is None else group.token_ids.gather(1, cols[:, None])[:, 0]
        return tokens.tolist()



def token_logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprobs]:
    """Each row's sampled-token logprob and its params.top_logprobs best (token, logprob).

    Args:
        logits: [R, vocab] float32 after the mask and the penalty, not yet scaled by temperature.
        seqs: the R sequences (their temperature and top_logprobs).
        tokens: the R tokens sampled.
    """
    device = logits.device
    temperatures = [s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=device).unsqueeze(1)
    # log p = logit - logsumexp: one reduction, no [R, vocab] log-softmax kept
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)                    # [R, 1]
    picked = logits.gather(1, torch.tensor(tokens, device=device).unsqueeze(1))   # [R, 1]
    chosen = (picked - normalizer)[:, 0].tolist()
    width = max(s.params.top_logprobs for s in seqs)
    if not width:
        return [TokenLogprobs(c) for c in chosen]
    values, ids = logits.topk(width, dim=-1)                                      # [R, width] best first
    values = values - normalizer
    out = []
    for seq, c, row_values, row_ids in zip(seqs, chosen, values.tolist(), ids.tolist()):
        top = [(t, v) for t, v in zip(row_ids, row_values) if v != float("-inf")]  # masked tokens: no entry
        out.append(TokenLogprobs(c, tuple(top[:seq.params.top_logprobs])))
    return out


def _rows(batch: torch.Tensor, rows: list[int] | torch.Tensor) -> torch.Tensor:
    """The given ascending rows of `batch` [B, vocab] (the tensor itself when they are all B of them)."""
    return batch if len(rows) == batch.shape[0] else batch[rows]


def _exponential_noise(seqs: list[Sequence], vocab: int) -> torch.Tensor:
    """[B, vocab] Exp(1) noise (-log U), each row fixed by its sequence's (seed, position of the
    token to sample)."""
    seeds = [mix_seed(seq.params.seed, seq.num_tokens) for seq in seqs]
    return cpu_uniform.uniform_rows(seeds, vocab).log_().neg_()   # torch.rand's stream of each seed
