"""Stop strings matched on text across token boundaries; the stop string is never emitted."""

import pytest

from gateway.stops import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out, stopped = [], False
    for piece in pieces:
        r = m.feed(piece)
        out.append(r.text)
        if r.stopped:
            stopped = True
            break
    if not stopped:
        out.append(m.flush())
    return out, stopped


def test_stop_inside_one_piece():
    assert run(["END"], ["abcENDxyz"]) == (["abc"], True)


def test_stop_across_pieces_holds_back_prefix():
    assert run(["world"], ["Hello wor", "ld!"]) == (["Hello ", ""], True)


def test_false_start_released():
    assert run(["world"], ["Hello wor", "m!"]) == (["Hello ", "worm!", ""], False)


def test_stop_split_over_many_pieces():
    assert run(["\n\nUser:"], ["a", "\n", "\nU", "ser", ":", "after"]) == (["a", "", "", "", ""], True)


def test_earliest_of_several_stops_wins():
    assert run(["cd", "b"], ["abcd"]) == (["a"], True)


def test_overlapping_prefixes():
    # "aab" is held as long as its tail can still start "aab"
    assert run(["aab"], ["aa", "aab"]) == (["", "aa"], True)


def test_no_stops_streams_everything():
    assert run([], ["x", "y"]) == (["x", "y", ""], False)


def test_flush_releases_held_tail():
    assert run(["STOP"], ["xyz ST"]) == (["xyz ", "ST"], False)


def test_after_stop_nothing_more():
    m = StopMatcher(["x"])
    assert m.feed("ax").stopped
    assert m.feed("more").text == "" and m.flush() == ""


@pytest.mark.parametrize("text", ["héllo wörld ✓ 你好", "a" * 50])
def test_char_by_char_equals_whole(text):
    stop = text[len(text) // 2: len(text) // 2 + 3]
    by_char, _ = run([stop], list(text))
    whole, _ = run([stop], [text])
    assert "".join(by_char) == "".join(whole) == text[:text.find(stop)]
