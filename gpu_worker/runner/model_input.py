"""Turns a scheduler plan into the tensors of one forward: input ids, positions and
AttentionMetadata (gpu_worker/model/metadata.py), prefills first, then decodes.

    scheduled (prefills: q_len > 1, decodes: q_len == 1)
      seq A computed 0, q 5     seq D computed 7, q 3 (draft d8 d9)     seq B computed 9, q 1
    input_ids   [A0 A1 A2 A3 A4 | D7 d8 d9 | B9]
    positions   [ 0  1  2  3  4 |  7  8  9 |  9]
    logits_idx  [4, 5, 6, 7, 8]           last token of each sequence, every position of a
                                          drafted one (engine/speculation.py), batch order

A drafted sequence's chunk runs as a prefill chunk over its computed context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.scheduler import ScheduledSeq
from gpu_worker.model.metadata import AttentionMetadata, GroupTables


@dataclass
class ModelInput:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    meta: AttentionMetadata
    batch: list[ScheduledSeq]    # batch order (the rows of the logits)


def order_batch(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """Prefill chunks first, then single-token decodes (stable within each group)."""
    return [s for s in scheduled if s.num_tokens > 1] + [s for s in scheduled if s.num_tokens == 1]


def _padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[len(tables), max_blocks] int32, padded with 0."""
    width = max((len(t) for t in tables), default=0)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(tables), width)


def _group_tables(batch: list[ScheduledSeq], prefills: list[ScheduledSeq], decodes: list[ScheduledSeq],
                  blocks: BlockManager, group: int, device: torch.device) -> GroupTables:
    """The slot of every token of the step and the block tables, in KV group `group`."""
    bs = blocks.block_size
    slots: list[int] = []
    for item in batch:
        start = item.seq.num_computed_tokens
        table = blocks.block_table(item.seq, group)
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + item.num_tokens)]
    return GroupTables(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        prefill_block_tables=_padded([blocks.block_table(s.seq, group) for s in prefills], device),
        decode_block_tables=_padded([blocks.block_table(s.seq, group) for s in decodes], device),
    )


def build_model_input(scheduled: list[ScheduledSeq], blocks: BlockManager,
                      device: torch.device) -> ModelInput:
    """Everything the model's forward needs for this step's batch."""
    batch = order_batch(scheduled)
    ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    for item in batch:
        start, end = item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_tokens
        ids += item.seq.tokens_in(start, end)
        positions += range(start, end)
        logits_indices += range(len(ids) - item.num_logits, len(ids))
    prefills = [s for s in batch if s.num_tokens > 1]
    decodes = batch[len(prefills):]
    groups = [_group_tables(batch, prefills, decodes, blocks, g, device) for g in range(len(blocks.windows))]
    query_start = [0]
    for item in prefills:
        query_start.append(query_start[-1] + item.num_tokens)

    def ctx_lens(items: list[ScheduledSeq]) -> torch.Tensor:
        lens = [s.seq.num_computed_tokens + s.num_tokens for s in items]
        return torch.tensor(lens, dtype=torch.int32, device=device)

    meta = AttentionMetadata(
        slot_mapping=groups[0].slot_mapping,
        num_prefills=len(prefills),
        num_prefill_tokens=query_start[-1],
        prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        prefill_context_lens=ctx_lens(prefills),
        prefill_block_tables=groups[0].prefill_block_tables,
        decode_context_lens=ctx_lens(decodes),
        decode_block_tables=groups[0].decode_block_tables,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        groups=tuple(groups[1:]),
    )
    return ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        batch=batch,
    )
