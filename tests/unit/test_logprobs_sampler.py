"""Sampler logprobs: of which distribution, how many alternatives, and nothing for rows that do not ask."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine.sampler import Sampler, apply_repetition_penalty
from gpu_worker.engine.sequence import SamplingParams, Sequence

VOCAB = 50


def make_seq(**params) -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(**params))


def make_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_top1_is_the_chosen_token_with_the_unscaled_log_softmax():
    logits = make_logits(2)
    seqs = [make_seq(temperature=0.0, logprobs=True, top_logprobs=5) for _ in range(2)]
    tokens = Sampler()(logits, seqs)
    expected = logits.log_softmax(dim=-1)
    for row, (seq, token) in enumerate(zip(seqs, tokens)):
        entry = seq.sampled
        assert entry is not None and entry.top[0][0] == token
        assert entry.logprob == entry.top[0][1] == pytest.approx(expected[row, token].item(), abs=1e-6)
        assert [t for t, _ in entry.top] == expected[row].topk(5).indices.tolist()


def test_sampled_rows_report_the_temperature_scaled_distribution():
    logits = make_logits(1, seed=3)
    seq = make_seq(temperature=0.5, seed=11, logprobs=True, top_logprobs=2)
    token = Sampler()(logits, [seq])[0]
    scaled = (logits[0] / 0.5).log_softmax(dim=-1)
    assert seq.sampled is not None
    assert abs(seq.sampled.logprob - scaled[token].item()) < 1e-6
    assert [v for _, v in seq.sampled.top] == pytest.approx(scaled.topk(2).values.tolist(), abs=1e-6)


def test_repetition_penalty_enters_before_the_logprobs():
    logits = make_logits(1, seed=4)
    seq = make_seq(temperature=0.0, repetition_penalty=1.5, logprobs=True, top_logprobs=1)
    token = Sampler()(logits, [seq])[0]
    penalized = logits[0].clone()
    apply_repetition_penalty(penalized, seq.token_ids, 1.5)
    assert token == int(penalized.argmax())
    assert seq.sampled is not None and abs(seq.sampled.logprob - penalized.log_softmax(-1)[token].item()) < 1e-6


def test_rows_that_do_not_ask_get_nothing_and_mixed_batches_keep_their_tokens():
    logits = make_logits(3, seed=5)
    asks = make_seq(temperature=1.0, seed=2, logprobs=True)
    silent = [make_seq(temperature=1.0, seed=2), make_seq(temperature=0.0)]
    tokens = Sampler()(logits, [silent[0], asks, silent[1]])
    assert all(s.sampled is None for s in silent)
    assert asks.sampled is not None and asks.sampled.top == ()
    # the same rows without anybody asking draw the same tokens: logprobs never change a draw
    assert Sampler()(logits, [make_seq(temperature=1.0, seed=2), make_seq(temperature=1.0, seed=2),
                              make_seq(temperature=0.0)]) == tokens


def test_append_token_takes_the_draw():
    logits = make_logits(1, seed=6)
    seq = make_seq(temperature=0.0, logprobs=True)
    token = Sampler()(logits, [seq])[0]
    seq.append_token(token)
    assert len(seq.output_logprobs) == 1 and seq.sampled is None
