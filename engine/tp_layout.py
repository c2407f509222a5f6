"""Which part of the model each tensor-parallel rank holds (Megatron's split, as vLLM lays it out).

q/k/v and gate/up are split by output (column-parallel: each rank computes its own heads and its share of the
intermediate activations, no communication); o_proj and down_proj by input (row-parallel: each rank's partial sums
are all-reduced once); the embedding and LM head by vocabulary rows. Query heads go with their KV head, so a rank
attends only with the KV heads it holds:

- at least as many KV heads as ranks: each rank takes a run of whole KV groups (a KV head and its query heads).
  Counts that do not divide leave some ranks one group more (SmolLM2-135M's 3 KV heads on 2 ranks: 2 and 1).
- fewer KV heads than ranks: the ranks are split evenly among the KV heads; each holds a copy of its KV head and a
  share of that head's query heads.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelArgs


def split(total: int, rank: int, world_size: int, unit: int = 1) -> tuple[int, int]:
    """[start, end) of `rank`'s share of `total` items in whole `unit`s, as even as the units allow."""
    units = total // unit
    return units * rank // world_size * unit, units * (rank + 1) // world_size * unit


@dataclass(frozen=True)
class ShardLayout:
    rank: int
    world_size: int
    q_heads: tuple[int, int]  # [start, end) of the model's query heads
    kv_heads: tuple[int, int]  # [start, end) of its KV heads (a copy of one when KV heads are fewer than ranks)
    intermediate: tuple[int, int]  # [start, end) of the MLP's intermediate features
    vocab: tuple[int, int]  # [start, end) of the vocabulary rows held
    vocab_rows: int  # rows of the embedding and LM head on every rank (the last one pads with zeros)

    @classmethod
    def full(cls, args: ModelArgs) -> "ShardLayout":
        return cls.of(args, 0, 1)

    @classmethod
    def of(cls, args: ModelArgs, rank: int, world_size: int) -> "ShardLayout":
        check_shardable(args, world_size)
        heads, kv = args.num_heads, args.num_kv_heads
        group = heads // kv
        if kv >= world_size:
            kv_range = split(kv, rank, world_size)
            q_range = (kv_range[0] * group, kv_range[1] * group)
        else:
            copies = world_size // kv
            head, share = divmod(rank, copies)
            start, end = split(group, share, copies)
            kv_range, q_range = (head, head + 1), (head * group + start, head * group + end)
        unit = 2 if args.intermediate_size % 2 == 0 else 1  # the native CPU linear needs an even input width
        rows = -(-args.vocab_size // world_size)
        vocab = (min(rank * rows, args.vocab_size), min((rank + 1) * rows, args.vocab_size))
        return cls(rank, world_size, q_range, kv_range, split(args.intermediate_size, rank, world_size, unit),
                   vocab, rows)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]


def check_shardable(args: ModelArgs, world_size: int) -> None:
    """Raises ValueError, saying what to change, when the model cannot be split over `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {world_size}")
    heads, kv = args.num_heads, args.num_kv_heads
    if world_size > heads:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the model's {heads} attention heads; "
                         f"use at most {heads}")
    if kv < world_size and world_size % kv:
        raise ValueError(f"the model has {kv} KV heads: a tensor_parallel_size above {kv} must be a multiple of "
                         f"{kv}, so that each KV head is copied to as many ranks; got {world_size}")
    if args.intermediate_size // 2 < world_size:
        raise ValueError(f"the MLP's {args.intermediate_size} features cannot be split over {world_size} ranks")
