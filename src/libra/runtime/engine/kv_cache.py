"""Paged KV cache: a pool of fixed-size blocks, a pure allocator, and the tensors that hold them.

Why paged: sequences in agentic rollouts have wildly different lengths, so reserving
`max_model_len` per sequence would waste most of the memory and cap concurrency. Blocks are handed
out as sequences grow and returned when they finish or are preempted, as in vLLM.

`BlockAllocator` is plain Python (no torch) so the scheduler that uses it stays a testable policy.
`KVCache` holds the tensors; block 0 is a reserved all-zero "null" block that padded attention
reads point at, so no uninitialised memory is ever read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from libra.runtime.engine.presets import ModelPreset

NULL_BLOCK = 0


class BlockAllocator:
    """Hands out block ids 1..num_blocks-1; a sequence's blocks live in its `blocks` list."""

    __slots__ = ("block_size", "num_blocks", "_free")

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError("need at least two blocks (one is the null block)")
        self.num_blocks, self.block_size = num_blocks, block_size
        # A stack: the most recently freed (still warm in cache, already paged in) block goes first.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def blocks_needed(self, have: int, n_tokens: int) -> int:
        return max(0, -(-n_tokens // self.block_size) - have)

    def ensure(self, blocks: list[int], n_tokens: int) -> bool:
        """Grow `blocks` to hold `n_tokens`; all or nothing."""
        need = self.blocks_needed(len(blocks), n_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            blocks.append(self._free.pop())
        return True

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()


class KVCache:
    """Keys and values of every layer, [n_layers, num_blocks * block_size, n_kv_heads, head_dim]."""

    __slots__ = ("k", "v", "block_size", "num_blocks", "shape", "dtype", "device")

    def __init__(self, preset: ModelPreset, num_blocks: int, block_size: int, dtype=torch.float32, device: str = "cpu"):  # fmt: skip
        self.shape = (preset.n_layers, num_blocks * block_size, preset.n_kv_heads, preset.head_dim)
        self.block_size, self.num_blocks, self.dtype, self.device = block_size, num_blocks, dtype, device
        self.restore()

    def restore(self) -> None:
        """(Re)allocate the tensors. `empty`, not `zeros`: pages are touched only when a block is
        first used, so the resident memory follows the load rather than --kv-cache-mb."""
        self.k = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.v = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.k[:, : self.block_size].zero_()
        self.v[:, : self.block_size].zero_()

    def release(self) -> int:
        """Give the memory back (SGLang's release_memory_occupation, vLLM's sleep); the bytes freed.
        Only when no sequence holds a block: their keys and values are gone."""
        freed = self.k.numel() * self.k.element_size() * 2
        self.k = self.v = torch.empty(0, dtype=self.dtype)
        return freed

    @property
    def released(self) -> bool:
        return self.k.numel() == 0
