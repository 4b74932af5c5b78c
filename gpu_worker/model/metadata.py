"""What one forward step needs to know about the batch: the contract between the
engine (which builds it) and the model (which reads it).

A step's tokens are laid out prefills first, then decodes:

    input_ids:  [ p0 p0 p0 p0 | p1 p1 | d0 | d1 | d2 ]   T = num_prefill_tokens + num_decodes
                  prefill 0     pf 1    one token per decoding sequence

A prefill chunk holds the *last* `q_len` tokens of its sequence's context so far
(chunked prefill, or a prompt whose prefix came from the prefix cache); the KV of
the earlier tokens is already in the paged cache.

The slot mapping and block tables are those of KV group 0 (gpu_worker/model/kv_cache.py KVLayout);
a model with several groups carries the others' in `groups`, and each layer reads
`meta.for_group(its group)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class GroupTables:
    """The slot mapping and block tables of one KV group beyond the first (shapes as AttentionMetadata's)."""

    slot_mapping: torch.Tensor          # [T] int64
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    decode_block_tables: torch.Tensor   # [num_decodes, max_blocks] int32


@dataclass
class AttentionMetadata:
    # [T] int64: cache slot (block_id * block_size + offset) of every token; -1 = do not write
    slot_mapping: torch.Tensor
    num_prefills: int
    num_prefill_tokens: int
    # [num_prefills + 1] int32: start of each prefill chunk in the token axis (0, ..., num_prefill_tokens)
    prefill_query_start_loc: torch.Tensor
    # [num_prefills] int32: context length of each prefilling sequence after this step
    prefill_context_lens: torch.Tensor
    # [num_prefills, max_blocks] int32: block table of each prefilling sequence (padded with 0)
    prefill_block_tables: torch.Tensor
    # [num_decodes] int32: context length of each decoding sequence after this step
    decode_context_lens: torch.Tensor
    # [num_decodes, max_blocks] int32: block table of each decoding sequence (padded with 0)
    decode_block_tables: torch.Tensor
    # [num_seqs] int64: token position whose logits are sampled, one per sequence in batch order
    logits_indices: torch.Tensor
    # KV groups 1, 2, ...: their own slots and tables (empty: the model has one group)
    groups: tuple[GroupTables, ...] = field(default_factory=tuple)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_context_lens.shape[0])

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group `group` reads: that group's slots and block tables."""
        if group == 0:
            return self
        g = self.groups[group - 1]
        return dataclasses.replace(self, slot_mapping=g.slot_mapping, prefill_block_tables=g.prefill_block_tables,
                                   decode_block_tables=g.decode_block_tables, groups=())
