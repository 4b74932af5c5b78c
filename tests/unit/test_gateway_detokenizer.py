"""Incremental detokenization with the real SmolLM2 tokenizer: never broken UTF-8,
and the concatenated pieces equal a one-shot decode."""

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway.output import OutputBuilder
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2
from tokenizer_svc.loader import load_tokenizer

TEXTS = ["Hello, world!", "emoji 🤖🚀 and 你好世界, naïve café", "🏳️‍🌈 flags ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "  spaces\n\nnewlines\t"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path).tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_never_emits_replacement(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.feed([i]) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_multibyte_char_split_across_tokens_is_held(tokenizer):
    ids = tokenizer.encode("🤖", add_special_tokens=False).ids
    assert len(ids) > 1  # byte-level BPE splits this emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.feed([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.feed(ids[-1:]) == "🤖"


def test_eos_is_not_text(tokenizer):
    eos = tokenizer.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Paris.", add_special_tokens=False).ids
    assert detok.feed(ids) + detok.feed([eos]) + detok.flush() == "Paris."


def events(ids, per_event, final_reason=pb.FINISH_REASON_LENGTH):
    out = []
    for start in range(0, len(ids), per_event):
        out.append(queue_pb2.TokenEvent(index=start, token_ids=ids[start:start + per_event]))
    out[-1].final, out[-1].finish_reason = True, final_reason
    return out


def test_builder_dedupes_replayed_events_and_keeps_index_contiguous(tokenizer):
    ids = tokenizer.encode("one two three four five six", add_special_tokens=False).ids
    evs = events(ids, 2)
    replayed = evs[:2] + [evs[1], queue_pb2.TokenEvent(index=1, token_ids=ids[1:4])] + evs[2:]
    builder = OutputBuilder("r", tokenizer, [])
    chunks = [c for c in (builder.feed(e) for e in replayed) if c is not None]
    expected = 0
    for c in chunks:
        assert c.index == expected
        expected += len(c.token_ids)
    assert [t for c in chunks for t in c.token_ids] == ids
    assert "".join(c.text for c in chunks) == "one two three four five six"
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_builder_stop_string_across_tokens(tokenizer):
    ids = tokenizer.encode("The answer is 42. Done here", add_special_tokens=False).ids
    builder = OutputBuilder("r", tokenizer, [". Do"])
    chunks = [c for c in (builder.feed(e) for e in events(ids, 1)) if c is not None]
    assert "".join(c.text for c in chunks) == "The answer is 42"
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP and builder.done


def test_builder_error_event_raises_mapped_status(tokenizer):
    from llmserve.runtime.errors import DeadlineExceeded
    builder = OutputBuilder("r", tokenizer, [])
    with pytest.raises(DeadlineExceeded):
        builder.feed(queue_pb2.TokenEvent(index=0, final=True,
                                          error=queue_pb2.EventError(code="DEADLINE_EXCEEDED", message="late")))


def test_completion_cut_inside_a_character_ends_without_replacement_char(tokenizer):
    ids = tokenizer.encode("ok 🌍", add_special_tokens=False).ids
    assert len(ids) > 2
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.feed([i]) for i in ids[:-1]) + detok.flush()  # last byte of the emoji never came
    assert text == "ok "


def test_builder_never_finishes_over_a_gap(tokenizer):
    from llmserve.runtime.errors import Unavailable
    ids = tokenizer.encode("one two three four five six", add_special_tokens=False).ids
    evs = events(ids, 2)
    builder = OutputBuilder("r", tokenizer, [])
    assert builder.feed(evs[0]) is not None
    with pytest.raises(Unavailable):
        for e in evs[2:]:  # the event holding tokens 2..3 never came
            builder.feed(e)
    assert builder.next_index == 2  # nothing past the gap was taken


def with_epoch(evs, epoch: int):
    for e in evs:
        e.dispatch_epoch = epoch
    return evs


def test_builder_takes_a_rerun_that_repeats_the_same_tokens(tokenizer):
    ids = tokenizer.encode("one two three four five six", add_special_tokens=False).ids
    first_run = with_epoch(events(ids, 2)[:2], 1)
    rerun = with_epoch(events(ids, 2), 2)
    late_stale = with_epoch([queue_pb2.TokenEvent(index=4, token_ids=[7, 7])], 1)
    builder = OutputBuilder("r", tokenizer, [])
    chunks = [c for c in (builder.feed(e) for e in [*first_run, *rerun[:3], *late_stale, *rerun[3:]])
              if c is not None]
    assert [t for c in chunks for t in c.token_ids] == ids
    assert "".join(c.text for c in chunks) == "one two three four five six"


def test_builder_refuses_to_splice_a_rerun_that_diverged(tokenizer):
    from llmserve.runtime.errors import Unavailable
    ids = tokenizer.encode("one two three four five six", add_special_tokens=False).ids
    other = tokenizer.encode("one two seven eight nine ten", add_special_tokens=False).ids
    builder = OutputBuilder("r", tokenizer, [])
    for e in with_epoch(events(ids, 2)[:2], 1):
        builder.feed(e)
    with pytest.raises(Unavailable, match="diverged"):
        builder.feed(with_epoch([queue_pb2.TokenEvent(index=0, token_ids=other[:4])], 2)[0])
