"""Prompt lookup (gpu_worker/engine/speculation.py): which draft a context gives."""

from __future__ import annotations

from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.engine.speculation import NgramIndex, PromptLookup, SpeculationConfig


def draft(tokens: list[int], limit: int = 4, min_ngram: int = 2, max_ngram: int = 3) -> list[int]:
    return NgramIndex(min_ngram, max_ngram).draft(tokens, limit)


def test_draft_is_what_followed_the_latest_earlier_occurrence():
    assert draft([1, 2, 3, 4, 5, 9, 1, 2]) == [3, 4, 5, 9]
    assert draft([1, 2, 3, 1, 2, 7, 1, 2]) == [7, 1, 2]            # the latest occurrence, up to the end
    assert draft([1, 2, 3, 4, 5, 9, 1, 2], limit=2) == [3, 4]


def test_longest_suffix_is_tried_first():
    # "2 3" last occurred before 8, but "1 2 3" only before 5
    assert draft([1, 2, 3, 5, 0, 2, 3, 8, 0, 1, 2, 3]) == [5, 0, 2, 3]


def test_no_match_no_draft_and_the_suffix_never_matches_itself():
    assert draft([1, 2, 3, 4, 5]) == []
    assert draft([1, 2]) == []
    assert draft([5, 1, 2, 6, 7], min_ngram=1) == []                # 7 occurs only at the end
    assert draft([7, 7, 7]) == [7]                                  # "7 7" at 0 was followed by 7


def test_index_grows_with_the_context():
    index = NgramIndex(2, 2)
    tokens = [1, 2, 3]
    assert index.draft(tokens, 4) == []
    tokens += [1, 2]
    assert index.draft(tokens, 4) == [3, 1, 2]
    tokens += [4, 1, 2]
    assert index.draft(tokens, 4) == [4, 1, 2]


def test_drafts_stay_inside_the_request_and_the_context():
    lookup = PromptLookup(SpeculationConfig(num_tokens=4, max_running=2), context_length=12)
    seq = Sequence([1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(max_new_tokens=3))
    assert lookup.propose([seq], num_running=1) == [(seq, [3, 4])]          # 2 kept + 1 sampled = 3
    seq = Sequence([1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(max_new_tokens=100))
    assert lookup.propose([seq], num_running=1) == [(seq, [3, 4, 5])]       # 8 + 3 + 1 = 12 positions
    assert lookup.propose([seq], num_running=3) == []                       # too many running
    cool = PromptLookup(SpeculationConfig(num_tokens=4, max_running=2, max_temperature=0.7), context_length=12)
    hot = Sequence([1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(temperature=1.0, max_new_tokens=100))
    warm = Sequence([1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(temperature=0.7, max_new_tokens=100))
    assert cool.propose([hot, warm], num_running=1) == [(warm, [3, 4, 5])]  # hotter than 0.7: no draft
    off = PromptLookup(SpeculationConfig(), context_length=12)
    assert not off.enabled and off.propose([seq], num_running=1) == []
