"""Which queue cell a worker joins and a request goes to (llmserve/protocol/queue_cells.py)."""

from __future__ import annotations

import math

from llmserve.protocol.queue_cells import cell_for_request, cell_to_join


def test_a_worker_joins_the_cell_with_fewest_live_workers():
    assert cell_to_join([1, 0, 0]) == 1
    assert cell_to_join([2, 1, 1]) == 1
    assert cell_to_join([1, 1, 0], ticket=1) == 2
    assert cell_to_join([1]) == 0


def test_workers_that_start_together_spread_over_the_cells():
    # each saw no live worker yet; their tickets from the counter spread them round-robin
    assert [cell_to_join([0, 0, 0], ticket) for ticket in (1, 2, 3, 4)] == [1, 2, 0, 1]
    assert sorted(cell_to_join([0, 0], ticket) for ticket in (7, 8)) == [0, 1]


def test_requests_go_to_cells_in_proportion_to_their_live_workers():
    n, counts = 4000, [3, 1, 0]
    picks = [cell_for_request(counts, f"tenant:req-{i}") for i in range(n)]
    assert picks.count(2) == 0                                   # no worker, no request
    p = counts[1] / sum(counts)
    band = 3.3 * math.sqrt(n * p * (1 - p))                      # 99.9 % binomial band
    assert abs(picks.count(1) - n * p) <= band, picks.count(1)


def test_the_same_request_lands_in_the_same_cell_and_no_worker_means_cell_0():
    assert {cell_for_request([1, 1, 1, 1], "t:same") for _ in range(10)} == {cell_for_request([1, 1, 1, 1], "t:same")}
    assert cell_for_request([0, 0], "t:any") == 0
