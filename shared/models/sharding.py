"""How one rank's share of a model is cut: the heads, MLP columns, vocabulary rows and layers it
holds, and the collectives that join the shares (Megatron-style tensor parallelism, as vLLM's
``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``).

* QKV and gate/up are column-parallel: rank r holds the rows of its query heads, of its KV heads
  (partitioned when ``num_kv_heads >= tp``; replicated, one head per rank, otherwise), and its
  ``intermediate / tp`` MLP columns. o_proj and down_proj are row-parallel: each rank multiplies
  its input columns and an all-reduce sums the partial outputs.
* The embedding and the LM head hold ``ceil(vocab / tp)`` rows each (the last rank's padded):
  a token outside a rank's rows embeds to zeros before the all-reduce; the LM head's logits
  are all-gathered and the padding cut.
* Pipeline stage ``pp_rank`` holds layers ``[layer_start, layer_end)``; the first stage embeds,
  the last normalises and holds the LM head.

A :class:`Shard` with ``tp_size == 1`` and one stage is the whole model; its collectives are
then the identity and nothing imports ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shard:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    layer_start: int = 0
    layer_end: int = -1  # -1: every layer
    group: Any = None  # the torch.distributed group of this stage's TP ranks
    comm: Any = None  # ShmComm when this group's ranks share a CPU node (else group's backend)

    # ---- what this rank holds ----------------------------------------------------------
    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layers(self, num_layers: int) -> range:
        return range(self.layer_start, num_layers if self.layer_end < 0 else self.layer_end)

    def heads(self, num_heads: int) -> tuple[int, int]:
        """This rank's query heads ``(first, count)``."""
        n = num_heads // self.tp_size
        return self.tp_rank * n, n

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads ``(first, count)``: partitioned, or one replicated head."""
        if num_kv_heads >= self.tp_size:
            n = num_kv_heads // self.tp_size
            return self.tp_rank * n, n
        replicas = self.tp_size // num_kv_heads
        return self.tp_rank // replicas, 1

    def columns(self, size: int) -> tuple[int, int]:
        """This rank's slice ``(first, count)`` of a dimension split evenly over TP."""
        n = size // self.tp_size
        return self.tp_rank * n, n

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """This rank's vocabulary rows ``(first, count)``; ``count`` is the same on every rank
        (the last rank's rows past ``vocab_size`` are padding)."""
        n = -(-vocab_size // self.tp_size)
        return self.tp_rank * n, n

    # ---- collectives -------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over this stage's TP ranks (in place; identity without TP)."""
        if self.tp_size == 1:
            return x
        if self.comm is not None and self.comm.all_reduce(x) is not None:
            return x
        import torch.distributed as dist

        from shared.engine.distributed import run_collective

        # on gloo bounded: a stuck rank raises CommTimeoutError
        run_collective(
            lambda a: dist.all_reduce(x, group=self.group, async_op=a),
            "a TP all-reduce",
            x.device.type,
        )
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every TP rank's ``x`` along the last dimension, in rank order."""
        if self.tp_size == 1:
            return x
        if self.comm is not None:
            y = self.comm.all_gather_last(x)
            if y is not None:
                return y  # type: ignore[no-any-return]
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        from shared.engine.distributed import run_collective

        xc = x.contiguous()
        run_collective(
            lambda a: dist.all_gather(parts, xc, group=self.group, async_op=a),
            "a TP all-gather",
            x.device.type,
        )
        return torch.cat(parts, dim=-1)


WHOLE = Shard()
