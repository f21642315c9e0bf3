"""Data: `PromptSampler`, a resumable, deterministic, epoch-shuffled sampler of prompt indices, sharded per rank, and
the update's schedule over a step's samples (`mini_batches` of `micro_batches`, walked by `micro_steps`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple
import numpy as np
import torch

__all__ = ["SamplerBatch", "PromptSampler", "micro_batches", "mini_batches", "MicroStep", "micro_steps"]


@dataclass(frozen=True)
class SamplerBatch:
    """One rollout step's prompts. indices: the global batch (train_batch_size dataset indices); local: this
    rank's contiguous share (train_batch_size / world). The trainer repeats each prompt n times for the group."""

    indices: list[int]
    local: list[int]
    epoch: int
    step_in_epoch: int


class PromptSampler:
    """Epoch-shuffled prompt indices over `dataset_len` prompts, `batch_size` (= data.train_batch_size) per step.

    Epoch e uses the permutation `np.random.default_rng([seed, e]).permutation(dataset_len)`, cut into
    `dataset_len // batch_size` steps (the incomplete tail is dropped, as verl's dataloader does). The cursor
    (epoch, step_in_epoch) is the whole state: `state_dict()` / `load_state_dict()` resume exactly. Every rank holds
    the same global sequence; `SamplerBatch.local` is rank r's slice [r*B/W, (r+1)*B/W).
    """

    def __init__(self, dataset_len: int, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if dataset_len < batch_size:
            raise ValueError(
                f"the dataset has {dataset_len} prompts, fewer than train_batch_size={batch_size}; lower the batch size"
            )
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"bad rank/world_size {rank}/{world_size}")
        if batch_size % world_size != 0:
            raise ValueError(
                f"train_batch_size={batch_size} prompts must be divisible by the {world_size} data-parallel ranks"
            )
        self.dataset_len, self.batch_size, self.seed = int(dataset_len), int(batch_size), int(seed)
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.steps_per_epoch = self.dataset_len // self.batch_size
        self.epoch, self.step_in_epoch = 0, 0
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len) if self.shuffle
                          else np.arange(self.dataset_len))
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> SamplerBatch:
        """The next step's prompts; advances the cursor (rolling into the next epoch when this one is used up)."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        start = self.step_in_epoch * self.batch_size
        indices = [int(i) for i in self._permutation(self.epoch)[start:start + self.batch_size]]
        per_rank = self.batch_size // self.world_size
        batch = SamplerBatch(indices, indices[self.rank * per_rank:(self.rank + 1) * per_rank], self.epoch,
                             self.step_in_epoch)
        self.step_in_epoch += 1
        return batch

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "dataset_len": self.dataset_len,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the cursor; refuses a state from another dataset length, batch size, seed or shuffle setting."""
        for key in ("dataset_len", "batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r}, this run has {getattr(self, key)!r}; "
                    f"resume with the same data and flags"
                )
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])


def micro_batches(start: int, stop: int, size: int, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """The samples [start, stop) in order, as micro-batches of `size` row indices (each a (size,) long tensor on
    `device`). `size` must divide stop - start (ValueError): a shorter last micro-batch would weigh its samples more
    in the trainers' loss / (micro-batches x steps) accumulation (`check_batch_sizes` refuses such flags)."""
    if size < 1 or (stop - start) % size:
        raise ValueError(f"micro-batches of {size} do not tile the {stop - start} samples [{start}, {stop})")
    return [torch.arange(i, i + size, device=device) for i in range(start, stop, size)]


def mini_batches(n: int, mini: int, micro: int, *, epochs: int = 1,
                 device: torch.device | str | None = None) -> Iterator[list[torch.Tensor]]:
    """The update's schedule over one step's `n` local samples (rollout order): `epochs` passes, each cut into
    mini-batches of `mini` samples (one optimizer step each), each yielded as its `micro_batches` of `micro` rows.
    `mini` must divide `n` (ValueError), as `micro` must divide `mini`."""
    if mini < 1 or n % mini:
        raise ValueError(f"mini-batches of {mini} do not tile the {n} samples of a step")
    for _ in range(epochs):
        for start in range(0, n, mini):
            yield micro_batches(start, start + mini, micro, device)


class MicroStep(NamedTuple):
    """One micro-step of the update (`micro_steps`)."""

    i: int  # the mini-batch (one optimizer step), counted over all epochs
    mb: torch.Tensor  # (b,) the micro-batch's sample indices
    k: int  # the inner step: NFT's training timestep, DPPO's stored SDE step
    out: Any  # what the trainer's forwards yielded for (mb, k)
    last: bool  # the optimizer steps after this micro-step (the last one of mini-batch i)


def micro_steps(n: int, mini: int, micro: int, inner: int,
                forwards: Callable[[int, torch.Tensor], Iterable[tuple[int, Any]]], *, epochs: int = 1,
                device: torch.device | str | None = None) -> Iterator[MicroStep]:
    """The update's micro-steps over one step's `n` local samples: the `mini_batches` (`epochs` passes of mini-batches
    of `mini` samples, one optimizer step each) of micro-batches `mb` of `micro` samples, and for each micro-batch the
    `inner` pairs (k, out) of the trainer's generator `forwards(i, mb)`, k = 0 .. inner - 1 (its forwards per
    timestep / stored step, run lazily: those of step k + 1 after the trainer's backward of step k). A mini-batch
    holds mini / micro x inner micro-steps; the trainer divides each loss by that count and steps the optimizer after
    the `last` one."""
    if inner < 1:
        raise ValueError(f"a micro-batch needs at least one inner step, got {inner}")
    for i, mini_batch in enumerate(mini_batches(n, mini, micro, epochs=epochs, device=device)):
        for m, mb in enumerate(mini_batch):
            expected = 0
            for k, out in forwards(i, mb):
                if k != expected or k >= inner:  # checked before the trainer's backward, so no gradient leaks
                    due = f"past its {inner} steps" if expected >= inner else f"where step {expected} was due"
                    raise ValueError(f"the forwards of a micro-batch yielded step {k} {due}")
                yield MicroStep(i, mb, k, out, m == len(mini_batch) - 1 and k == inner - 1)
                expected += 1
            if expected != inner:
                raise ValueError(f"the forwards of a micro-batch ended after {expected} of {inner} steps")
