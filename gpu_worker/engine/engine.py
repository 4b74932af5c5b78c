"""The engine: one `step()` = schedule, one batched forward, sample, update.

Not thread-safe: the worker service calls `add`, `abort` and `step` from one place in turn
(step runs in an executor thread while the event loop only does I/O).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
import torch

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.constraint import ConstraintError, Constraints
from gpu_worker.engine.sampler import Sampler
from gpu_worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from gpu_worker.engine.sequence import FINISH_LENGTH, FINISH_STOP, Failure, SamplingParams, Sequence
from gpu_worker.engine.speculation import PromptLookup, SpeculationConfig
from gpu_worker.model.kv_cache import KVCache, kv_layout
from gpu_worker.model.llama import LlamaModel
from gpu_worker.roofline import RooflineMeter, RooflineStats, probe_bandwidth
from gpu_worker.runner.cuda_graphs import DecodeGraphRunner
from gpu_worker.runner.model_runner import ModelRunner

logger = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    priority_preemption: bool = True     # scheduler.py step 0
    aging_steps: int = 256               # starvation guard: waited steps per priority level
    fair_tokens: bool = True             # tenants share admission by tokens (VTC), else by requests
    speculation: SpeculationConfig = SpeculationConfig()   # prompt-lookup drafts (speculation.py; off by default)


@dataclass
class StepOutput:
    """What one step did to one sequence."""

    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    draft_tokens: int = 0               # drafted positions the step computed for it (speculation.py)
    accepted_draft_tokens: int = 0      # ... whose token was the one sampled there


@dataclass
class EngineCounters:
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens_computed: int = 0
    last_step_s: float = 0.0
    last_batch_tokens: int = 0
    draft_tokens: int = 0                # drafted positions computed (speculation.py)
    accepted_draft_tokens: int = 0       # ... whose token was the one sampled there


class LLMEngine:
    """Continuous-batching generation over a paged KV cache.

    Args:
        model: forward(input_ids [T], positions [T], meta, kv_cache) -> logits [num_seqs, vocab]; the
            runner (gpu_worker/runner/model_runner.py) runs it.
        kv_cache: the paged cache the model reads and writes.
        config: cache geometry and batch limits.
        constraints: the model's grammar store, for sequences with a grammar (None: refused).
    """

    def __init__(self, model: LlamaModel, kv_cache: KVCache, config: EngineConfig,
                 constraints: Constraints | None = None) -> None:
        assert kv_cache.num_blocks == config.num_blocks and kv_cache.block_size == config.block_size
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.runner = ModelRunner(model, kv_cache)
        self.context_length: int = model.config.context_length
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          kv_cache.layout.windows, config.max_num_batched_tokens)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.priority_preemption, config.aging_steps,
                                                   config.fair_tokens),
                                   self.block_manager)
        self.constraints = constraints
        self.sampler = Sampler(constraints)
        self.counters = EngineCounters()
        self.roofline = RooflineMeter.for_model(model, kv_cache)
        self.drafter = PromptLookup(config.speculation, self.context_length)
        self.deferred: list[Sequence] = []   # choices waiting for their leader's prompt (sequence.py)

    @classmethod
    def create(cls, model: LlamaModel, config: EngineConfig, dtype: torch.dtype | None = None,
               constraints: Constraints | None = None) -> LLMEngine:
        """Allocate the KV cache for `model` and build the engine."""
        param = next(model.parameters())
        cache = KVCache.allocate(model.config, config.num_blocks, config.block_size,
                                 dtype or param.dtype, param.device, kv_layout(model.config))
        return cls(model, cache, config, constraints)

    def capture_decode_graphs(self, batch_sizes: list[int]) -> None:
        """Capture pure-decode steps of these batch sizes in CUDA graphs; later steps replay them.

        Steps with a prefill, more sequences than the largest size, or a block table wider than
        the model's context run eagerly, so output never depends on whether a graph was used.
        """
        max_blocks = -(-self.context_length // self.config.block_size)
        self.runner.capture_decode_graphs([b for b in batch_sizes if b <= self.config.max_num_seqs], max_blocks)

    @property
    def decode_graphs(self) -> DecodeGraphRunner | None:
        """The captured graphs once capture_decode_graphs() ran (CUDA only), else None."""
        return self.runner.decode_graphs

    # --- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> StepOutput | None:
        """Queue `seq`; returns a finished output at once if there is nothing to generate."""
        if seq.num_generated >= seq.params.max_new_tokens or seq.num_tokens >= self.context_length:
            seq.finish(FINISH_LENGTH)
            return StepOutput(seq, finished=True)
        if seq.params.grammar and not self._start_constraint(seq):
            return StepOutput(seq, finished=True)
        if seq.waits_for_leader:
            self.deferred.append(seq)
        else:
            self.scheduler.add(seq)
        return None

    def _release_deferred(self) -> None:
        """Schedule the choices whose leader computed the shared prompt: its blocks are cached now."""
        ready = [s for s in self.deferred if not s.waits_for_leader]
        self.deferred = [s for s in self.deferred if s.waits_for_leader]
        for seq in ready:
            self.scheduler.add(seq)

    def _start_constraint(self, seq: Sequence) -> bool:
        """Give seq its matcher (rebuilt over tokens produced before a handoff); False: it failed."""
        try:
            if self.constraints is None:
                raise ConstraintError("this engine was built without a tokenizer for grammars")
            self.constraints.start(seq)
            return True
        except ConstraintError as e:
            logger.warning("constraint refused", request_id=seq.request_id, error=str(e))
            seq.finish(0, Failure.BAD_CONSTRAINT)
            return False

    def abort(self, seq: Sequence, reason: int, failure: Failure | None = None) -> None:
        """Stop `seq` now (cancel, deadline, drain) and free its blocks."""
        if not seq.is_finished:
            seq.finish(reason, failure)
        if seq in self.deferred:
            self.deferred.remove(seq)
        self.scheduler.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.deferred)

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.scheduler.waiting)

    # --- the step --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one batched forward for every scheduled sequence; outputs of sequences that changed."""
        start = time.perf_counter()
        self._release_deferred()
        plan = self.scheduler.schedule()
        if self.drafter.enabled:
            self._add_drafts(plan)
        outputs = [self._out_of_memory(seq) for seq in plan.out_of_memory]
        if plan.is_empty:
            return outputs
        logits = self._forward(plan)                                  # [num_rows, vocab]
        read = self.roofline.step_bytes((item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_tokens)
                                        for item in plan.scheduled)  # the spans before _advance moves them
        outputs += self._advance(plan, logits)
        self.counters.steps += 1
        self.counters.last_batch_tokens = plan.num_tokens
        self.counters.last_step_s = time.perf_counter() - start
        self.roofline.record(read, self.counters.last_step_s)
        return outputs

    def _add_drafts(self, plan: SchedulerOutput) -> None:
        """Give the plan's decodes their drafts where the plan has room left (speculation.py)."""
        decodes = [item.seq for item in plan.scheduled if item.num_tokens == 1 and item.completes_context]
        self.scheduler.add_drafts(plan, self.drafter.propose(decodes, len(self.scheduler.running)))

    def _forward(self, plan: SchedulerOutput) -> torch.Tensor:
        plan.scheduled, logits = self.runner.execute(plan.scheduled, self.block_manager, plan.copy_on_write)
        return logits                                                 # rows in plan.scheduled's order

    def _advance(self, plan: SchedulerOutput, logits: torch.Tensor) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        to_sample: list[tuple[int, Sequence]] = []
        row = 0
        for item in plan.scheduled:
            if item.num_logits > 1:
                outputs.append(self._verify(item.seq, logits[row:row + item.num_logits]))
            else:
                done = item.completes_context
                item.seq.num_computed_tokens += item.num_tokens
                self.block_manager.cache_computed_blocks(item.seq)
                if done:
                    to_sample.append((row, item.seq))
                else:
                    self.counters.prompt_tokens_computed += item.num_tokens
            row += item.num_logits
        if not to_sample:
            return outputs
        if len(to_sample) < logits.shape[0]:  # only some rows are sampled together: pick those
            rows = torch.tensor([r for r, _ in to_sample], device=logits.device)
            logits = logits.index_select(0, rows)
        tokens = self.sampler(logits, [s for _, s in to_sample])
        return outputs + [self._accept(seq, token) for (_, seq), token in zip(to_sample, tokens)]

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> StepOutput:
        """Sample a drafted step's positions in order, each as a decode step would, while the drafted
        token there is the one drawn; the first draw that differs is kept instead (speculation.py).

        Args:
            seq: its last context token and draft were this step's input, one position a row.
            logits: [positions, vocab].
        """
        draft, seq.draft_token_ids = seq.draft_token_ids, []
        kept: list[int] = []
        for position in range(logits.shape[0]):
            seq.num_computed_tokens += 1               # as if a decode step computed just this input
            self.block_manager.cache_computed_blocks(seq)
            token = self.sampler(logits[position:position + 1], [seq])[0]
            kept += self._accept(seq, token).new_token_ids
            if seq.is_finished or position == len(draft) or token != draft[position]:
                break
        self.counters.draft_tokens += logits.shape[0] - 1
        self.counters.accepted_draft_tokens += position
        return StepOutput(seq, kept, seq.is_finished, logits.shape[0] - 1, position)

    def _accept(self, seq: Sequence, token: int) -> StepOutput:
        """Append a sampled token and apply the stop rules (a stop token itself is not emitted)."""
        params = seq.params
        if token in params.stop_token_ids and not params.ignore_eos:
            self._finish(seq, FINISH_STOP)
            return StepOutput(seq, [], finished=True)
        seq.append_token(token)
        if self.constraints is not None and not self.constraints.advance(seq, token):
            # the mask allowed it, so this is a library fault: log it; the next mask ends the row
            logger.error("grammar refused a sampled token", request_id=seq.request_id, token=token)
        self.counters.generated_tokens += 1
        if seq.num_generated >= params.max_new_tokens or seq.num_tokens >= self.context_length:
            self._finish(seq, FINISH_LENGTH)
        return StepOutput(seq, [token], finished=seq.is_finished)

    def _finish(self, seq: Sequence, reason: int) -> None:
        seq.finish(reason)
        self.scheduler.finish(seq)

    def _out_of_memory(self, seq: Sequence) -> StepOutput:
        seq.finish(0, Failure.DOES_NOT_FIT)
        return StepOutput(seq, [], finished=True)

    # --- offline use -----------------------------------------------------------------------
    def run(self, seqs: list[Sequence]) -> list[Sequence]:
        """Add these sequences and step until no work is left; returns them, finished."""
        for seq in seqs:
            self.add(seq)
        while self.has_work():
            self.step()
        return seqs

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; the generated token ids of each."""
        seqs = self.run([Sequence(list(p), sp) for p, sp in zip(prompts, params)])
        return [seq.output_token_ids for seq in seqs]

    # --- what the engine tells its callers ---------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Width of the model's logits: every token id below it can be fed in."""
        return self.model.config.vocab_size

    def can_take_more(self) -> bool:
        """Whether fewer sequences wait than one batch holds (worth reading more requests)."""
        return len(self.scheduler.waiting) < self.config.max_num_seqs

    def stats(self, prefix_hashes: int = 0) -> EngineStats:
        """What the engine holds and did so far; with the `prefix_hashes` hottest cached block hashes."""
        bm = self.block_manager
        preemptible_seqs, preemptible_blocks = self.scheduler.preemptible_by_high()
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting) + len(self.deferred),
            free_blocks=bm.num_free_blocks, total_blocks=self.config.num_blocks, kv_usage=bm.usage,
            steps=self.counters.steps, generated_tokens=self.counters.generated_tokens,
            last_batch_tokens=self.counters.last_batch_tokens, preemptions=self.scheduler.num_preemptions,
            prefix_hit_rate=bm.stats.hit_rate,
            cached_prefix_hashes=tuple(bm.cached_hashes(prefix_hashes)) if prefix_hashes else (),
            roofline=self.roofline.stats,
            preemptible_seqs=preemptible_seqs, preemptible_blocks=preemptible_blocks,
        )

    def reset_stats(self) -> None:
        """Forget the prefix cache and zero the counters (after a warm-up, so it shows in no stat)."""
        self.block_manager.reset_prefix_cache()
        self.block_manager.stats.queried_tokens = self.block_manager.stats.hit_tokens = 0
        self.counters = EngineCounters()
        self.scheduler.num_preemptions = 0
        self.roofline.reset()

    def probe_bandwidth(self) -> float:
        """Measure the memory bandwidth of the engine's device (logged, well under a second:
        gpu_worker/roofline.py); the roofline meter's fractions are of the best probe so far, which
        this returns (GB/s). Safe to call while a step runs (it touches only the probe's figure), but
        each then slows the other."""
        return self.roofline.offer_probe(probe_bandwidth(self.kv_cache.k_caches[0].device))

    def prepare(self, seq: Sequence) -> None:
        """Compile `seq`'s grammar and give it its matcher before `add`, which then has nothing
        left to compile. Thread-safe against `step()` (it touches no engine state): run it off the
        event loop, since a new grammar or the first vocabulary load can take seconds. A grammar
        that fails is left for `add` to refuse (the failure is cached, so that costs nothing)."""
        if seq.params.grammar and self.constraints is not None:
            try:
                self.constraints.start(seq)
            except ConstraintError:
                pass


@dataclass(frozen=True)
class EngineStats:
    """`LLMEngine.stats()`: a copy, safe to read from any thread."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    kv_usage: float                     # fraction of KV blocks in use
    steps: int
    generated_tokens: int
    last_batch_tokens: int              # tokens of the last step's batch
    preemptions: int
    prefix_hit_rate: float
    cached_prefix_hashes: tuple[int, ...] = ()
    roofline: RooflineStats = RooflineStats()  # bytes the steps read against their time and the probe
    preemptible_seqs: int = 0           # running below HIGH: what a HIGH arrival may preempt
    preemptible_blocks: int = 0         # the KV blocks those alone hold
