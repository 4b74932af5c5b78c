"""Next-token choice for every sequence of a batch, each with its own parameters.

Randomness is a pure function of (seed, position of the token in the context): each
draw uses a fresh `torch.Generator` seeded from both, so a request yields the same
tokens whatever else shares its batch, on any worker, and after a preemption or a
handoff to another worker (which continues at the same position).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from gpu_worker.engine.sequence import Sequence

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


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p exclude.

    Args:
        logits: [B, vocab] float32, already divided by temperature.
        top_k: [B] int64, 0 = off.
        top_p: [B] float32, 1.0 = off.
    Returns:
        [B, vocab] float32.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)       # [B, vocab]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs                         # mass of strictly better tokens
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False                                                 # the best token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Picks one token per sequence from the step's logits."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Args: logits [num_seqs, vocab] float32 (one row per seq, same order). Returns token ids."""
        logits = logits.float().clone()
        for row, seq in enumerate(seqs):
            if seq.params.repetition_penalty != 1.0:
                apply_repetition_penalty(logits[row], seq.token_ids, seq.params.repetition_penalty)
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled:
            for i, token in zip(sampled, self._sample(logits[sampled], [seqs[i] for i in sampled])):
                tokens[i] = token
        return tokens

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        # logits: [B, vocab]
        device = logits.device
        temperature = torch.tensor([s.params.temperature for s in seqs], device=device).unsqueeze(1)
        top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long, device=device)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=device)
        probs = filter_top_k_top_p(logits / temperature, top_k, top_p).softmax(dim=-1)   # [B, vocab]
        noise = torch.stack([self._exponential(s, probs.shape[1]) for s in seqs]).to(device)
        return (probs / noise).argmax(dim=-1).tolist()    # exponential race = a draw from probs

    @staticmethod
    def _exponential(seq: Sequence, vocab: int) -> torch.Tensor:
        """[vocab] Exp(1) noise fixed by (seed, position of the token to sample)."""
        generator = torch.Generator().manual_seed(mix_seed(seq.params.seed, seq.num_tokens))
        return torch.empty(vocab).exponential_(generator=generator)
