"""Grammar-constrained decoding: one llguidance matcher per constrained sequence, and the
batched token masks the sampler applies before temperature, top-k/top-p and the seeded draw.

The matcher state is a function of the tokens produced so far, nothing else:

    prompt | output tokens (prior_output_ids: produced before a handoff, then output_token_ids)
             ^ matcher starts here; `Constraints.start` feeds prior_output_ids back in

so a handed-off or reclaimed request resumes exactly where it was, and a preempted one
(recomputed, same Sequence object) keeps its matcher untouched.

Compiling a grammar (and the first wait for the vocabulary) can take seconds: the worker calls
`start` off its event loop (`LLMEngine.prepare`), concurrently with a step, so the store's
cache is locked; a grammar that does not compile is remembered as such.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy  # not llguidance.torch: it imports torch._dynamo (~5 s at every worker start)
import torch

from gpu_worker.engine.sequence import Sequence

_BITS = torch.arange(32, dtype=torch.int32)


class ConstraintError(ValueError):
    """A sequence's grammar cannot be started (bad grammar, or prior tokens it rejects)."""


class Constraints:
    """The engine's grammar store: the vocabulary, pristine matchers by grammar, masks.

    Args:
        tokenizer: llguidance tokenizer of the model (its EOS ids are the model's stop ids).
        vocab_size: width of the model's logits (may exceed the tokenizer's vocabulary).
        capacity: compiled grammars (or their compile errors) kept (LRU).
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer | Future[llguidance.LLTokenizer], vocab_size: int,
                 capacity: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._compiled: OrderedDict[str, llguidance.LLMatcher | ConstraintError] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary (waits for a background load the first time)."""
        if isinstance(self._tokenizer, Future):
            try:
                self._tokenizer = self._tokenizer.result()
            except Exception as e:  # an unreadable vocabulary refuses grammars, never stops the engine
                raise ConstraintError(f"the model's vocabulary did not load: {e}") from e
        return self._tokenizer

    @classmethod
    def from_tokenizer_json(cls, tokenizer_json: str, eos_token_ids: Seq[int], vocab_size: int) -> Constraints:
        """From a `tokenizers` JSON (what tokenizer_svc serves and ModelTokenizer.to_json gives)."""
        return cls(_lltokenizer(tokenizer_json, eos_token_ids), vocab_size)

    def start(self, seq: Sequence) -> None:
        """Give `seq` its matcher, advanced over the tokens it already produced elsewhere.

        Raises:
            ConstraintError: the grammar does not compile, or rejects prior_output_ids.
        """
        grammar = seq.params.grammar
        if not grammar or seq.matcher is not None:
            return
        matcher = self._pristine(grammar).deep_copy()
        if seq.prior_output_ids and not matcher.consume_tokens(list(seq.prior_output_ids)):
            raise ConstraintError(f"tokens produced before the handoff do not match: {matcher.get_error()}")
        seq.matcher = matcher

    def _pristine(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
        if matcher is None:
            matcher = self._compile(grammar)   # outside the lock: one slow grammar holds up no other
            with self._lock:
                self._compiled[grammar] = matcher
                if len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        if isinstance(matcher, ConstraintError):
            raise ConstraintError(str(matcher))   # a fresh one: no traceback piles up on the cached one
        return matcher

    def _compile(self, grammar: str) -> llguidance.LLMatcher | ConstraintError:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return ConstraintError(f"grammar does not compile: {matcher.get_error()}")
        return matcher

    def apply_masks(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """-inf on every token the grammar forbids, for the constrained rows only.

        Args:
            logits: [num_seqs, vocab] float32, one row per seq.
        Returns:
            logits (a masked copy when any row is constrained).
        """
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return logits
        allowed = self._allowed([seqs[i] for i in rows]).to(logits.device)    # [R, vocab] bool
        if len(rows) == len(seqs):
            return logits.masked_fill(~allowed, float("-inf"))
        logits = logits.clone()
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return logits

    def _allowed(self, seqs: list[Sequence]) -> torch.Tensor:
        """[R, vocab] bool: tokens each sequence's grammar accepts next (EOS only where it accepts)."""
        words = (self.tokenizer.vocab_size + 31) // 32
        bitmask = torch.zeros(len(seqs), words, dtype=torch.int32)                 # [R, words]
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(seq.matcher, row) for row, seq in enumerate(seqs)], bitmask.numpy())
        bits = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().view(len(seqs), -1)   # [R, words * 32]
        if bits.shape[1] >= self.vocab_size:
            allowed = bits[:, :self.vocab_size].clone()
        else:                                   # logits wider than the vocabulary: padding never allowed
            allowed = torch.zeros(len(seqs), self.vocab_size, dtype=torch.bool)
            allowed[:, :bits.shape[1]] = bits
        for row, seq in enumerate(seqs):
            self._fix_stops(allowed[row], seq)
        allowed[~allowed.any(dim=1)] = True     # no stop id to fall back on: never a row of -inf only
        return allowed

    @staticmethod
    def _fix_stops(allowed: torch.Tensor, seq: Sequence) -> None:
        """The request's stop ids end the sequence: allowed exactly where the grammar accepts.
        A matcher in error (it never should be) gets its stop ids only, so the step cannot fail."""
        stops = list(seq.params.stop_token_ids)
        if not stops:
            return
        matcher = seq.matcher
        if matcher.is_error():
            allowed.zero_()
        allowed[stops] = matcher.is_error() or matcher.is_accepting()

    @staticmethod
    def advance(seq: Sequence, token: int) -> bool:
        """Feed an accepted (non-stop) token to the sequence's matcher; False if it was refused."""
        return seq.matcher is None or bool(seq.matcher.consume_token(token))


def _lltokenizer(tokenizer_json: str, eos_token_ids: Seq[int]) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer_json, eos_token=list(eos_token_ids))


def _load_lltokenizer(spec: str) -> llguidance.LLTokenizer:
    from llmserve.catalog import model_store
    from llmserve.catalog.vocabulary import load_vocabulary  # the one loader of GGUF / HF vocabularies

    vocab = load_vocabulary(model_store.resolve(spec))
    return _lltokenizer(vocab.tokenizer.to_str(), vocab.eos_token_ids)


def load_constraints(spec: str, vocab_size: int) -> Constraints:
    """The grammar store of a model spec (alias, .gguf or HF directory), built from the model's
    own tokenizer in a background thread (seconds for a GGUF): the worker does not wait for it
    at start, only its first constrained sequence may.

    Args:
        vocab_size: width of the model's logits.
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-vocab")
    future = pool.submit(_load_lltokenizer, spec)
    pool.shutdown(wait=False)
    return Constraints(future, vocab_size)
