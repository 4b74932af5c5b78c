"""Fault-test bookkeeping: contiguity, comparison with the fault-free run, stalls across a fault."""

from __future__ import annotations

from llmserve.loadgen.streams import StreamRecord, mismatches, stall_s


def record(rid="r", indices=(0, 1, 3), tokens=(1, 2, 1), times=(1.0, 1.2, 4.0), ids=(5, 6, 7, 8), text="abcd",
           finish="length", error=None) -> StreamRecord:
    return StreamRecord(prompt="p", request_id=rid, start_s=0.5, chunk_indices=list(indices),
                        chunk_tokens=list(tokens), chunk_times_s=list(times), token_ids=list(ids), text=text,
                        finish_reason=finish, error=error)


def test_contiguous_needs_every_index_once_from_zero():
    assert record().contiguous()
    assert not record(indices=(0, 1, 2)).contiguous()                  # overlap: a repeated token
    assert not record(indices=(0, 1, 4)).contiguous()                  # gap: a lost token
    assert not record(indices=(1, 2, 4)).contiguous()                  # does not start at 0
    assert not record(ids=(5, 6, 7)).contiguous()                      # chunks disagree with the tokens


def test_mismatches_name_each_problem():
    base = [record("a"), record("b"), record("c"), record("d"), record("e")]
    got = [record("a"), record("b", error="UNAVAILABLE"), record("c", ids=(5, 6, 7, 9)),
           record("d", indices=(0, 1, 2)), record("e", finish="cancelled")]
    assert mismatches(got, base) == [
        "b: failed UNAVAILABLE",
        "c: output differs from the fault-free run (4 vs 4 tokens, finish length, text 'abcd')",
        "d: indices not contiguous [0, 1, 2]", "e: finish_reason cancelled"]
    assert mismatches(base, base) == []


def test_stall_is_the_longest_gap_across_the_fault():
    r = record(times=(1.0, 1.2, 4.0))
    assert r.largest_gap_after(2.0) == 4.0 - 1.2
    assert r.largest_gap_after(5.0) is None                            # ended before the fault
    assert record(times=(0.6,)).largest_gap_after(0.55) == 0.6 - 0.5   # waiting for the first chunk counts
    assert stall_s([r, record(times=(1.0, 2.5, 3.0))], 2.0) == 4.0 - 1.2
    assert stall_s([record(times=(1.0,))], 9.0) is None
