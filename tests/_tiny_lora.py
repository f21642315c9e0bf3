"""A tiny stand-in for a flow transformer (3 blocks under `blocks`, embedders outside), for the tests/test_training_*.py
files and their torchrun worker. Module names mirror the real models' LoRA targets (`to_q`, `ff`)."""

from __future__ import annotations

import torch
from torch import nn

BLOCK_PREFIXES = ("blocks",)
TARGETS = ("to_q", "ff")
DIM = 8


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(DIM, DIM)
        self.ff = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, use_ff: bool = True) -> torch.Tensor:
        return x + (self.ff(torch.tanh(self.to_q(x))) if use_ff else self.to_q(x))


class TinyFlowTransformer(nn.Module):
    """(B, L, 4) -> (B, L, 4). skip_last_ff: the last block's `ff` is never used (like Qwen-Image's last text-stream
    projections), so its LoRA gets no gradient and no optimizer state."""

    def __init__(self, num_blocks: int = 3, skip_last_ff: bool = False) -> None:
        super().__init__()
        self.skip_last_ff = skip_last_ff
        self.proj_in = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList([TinyBlock() for _ in range(num_blocks)])
        self.proj_out = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x)
        for i, block in enumerate(self.blocks):
            h = block(h, use_ff=not (self.skip_last_ff and i == len(self.blocks) - 1))
        return self.proj_out(h)
