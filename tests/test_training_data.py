"""training/data.py: `PromptSampler` (deterministic, epoch-shuffled, sharded per rank, resumable) and the update's
`mini_batches` / `micro_batches` and `micro_steps`, the update loop's iterator over them."""

from __future__ import annotations

import json

import pytest
import torch

import training as T
from training.data import PromptSampler, mini_batches


# ---------------------------------------------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------------------------------------------


def test_sampler_deterministic_epochs_and_shards():
    a = PromptSampler(10, 4, seed=3)
    b = PromptSampler(10, 4, seed=3)
    seq_a = [a.next_batch() for _ in range(5)]
    seq_b = [b.next_batch() for _ in range(5)]
    assert [s.indices for s in seq_a] == [s.indices for s in seq_b]
    assert [(s.epoch, s.step_in_epoch) for s in seq_a] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    epoch0 = seq_a[0].indices + seq_a[1].indices
    assert len(set(epoch0)) == 8  # no repeats inside an epoch (tail of 2 dropped)
    assert seq_a[0].indices != seq_a[2].indices  # reshuffled per epoch
    c = PromptSampler(10, 4, seed=4)
    assert c.next_batch().indices != seq_a[0].indices
    assert PromptSampler(10, 4, seed=3, shuffle=False).next_batch().indices == [0, 1, 2, 3]
    # sharding: the ranks' local slices partition the global batch, identical global batch on every rank
    ranks = [PromptSampler(12, 6, seed=1, rank=r, world_size=3) for r in range(3)]
    for _ in range(3):
        batches = [s.next_batch() for s in ranks]
        assert all(bt.indices == batches[0].indices for bt in batches)
        assert sum((bt.local for bt in batches), []) == batches[0].indices
        assert all(len(bt.local) == 2 for bt in batches)



def test_mini_and_micro_batches_cover_each_epoch_in_order():
    as_lists = lambda batches: [[mb.tolist() for mb in mini] for mini in batches]  # noqa: E731
    assert as_lists(mini_batches(8, 4, 2, epochs=2)) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]] * 2
    assert [mb.tolist() for mb in T.micro_batches(2, 8, 3)] == [[2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="micro-batches of 4 do not tile the 6 samples"):
        list(mini_batches(6, 6, 4))  # a short last micro-batch would weigh its samples more
    with pytest.raises(ValueError, match="mini-batches of 4 do not tile the 5 samples"):
        list(mini_batches(5, 4, 1))
    assert T.micro_batches(0, 4, 4)[0].dtype == torch.long


def test_micro_steps_walk_the_schedule_lazily_and_mark_each_optimizer_step():
    """(i, mb, k, out, last) per micro-step in the nested loops' order; `last` on the last inner step of each
    mini-batch's last micro-batch; the trainer's forwards of step k + 1 run only after step k was handed out (so
    after its backward); a generator with the wrong number of steps is an error."""
    events = []

    def forwards(i, mb):
        for k in range(3):
            events.append(("forward", i, mb.tolist(), k))
            yield k, f"out{i}{k}"

    seen = []
    for i, mb, k, out, last in T.micro_steps(8, 4, 2, 3, forwards, epochs=2):
        events.append(("backward", i, mb.tolist(), k))
        seen.append((i, mb.tolist(), k, out, last))
    micro = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [(i, mb, k) for i, mb, k, _, _ in seen] == [
        (i, micro[2 * (i % 2) + m], k) for i in range(4) for m in range(2) for k in range(3)]
    assert [last for *_, last in seen] == [m == 1 and k == 2 for i in range(4) for m in range(2) for k in range(3)]
    assert seen[4][3] == "out01"
    assert events[:4] == [("forward", 0, [0, 1], 0), ("backward", 0, [0, 1], 0), ("forward", 0, [0, 1], 1),
                          ("backward", 0, [0, 1], 1)]
    assert [e[0] for e in events] == ["forward", "backward"] * 24
    with pytest.raises(ValueError, match="ended after 2 of 3 steps"):
        list(T.micro_steps(2, 2, 2, 3, lambda i, mb: enumerate("ab")))
    # one step too many: refused at the extra step, before the trainer sees it (the optimizer stepped at k = 1 only
    # because that was the last of 2; no micro-step past it is handed out)
    handed = []
    with pytest.raises(ValueError, match="yielded step 2 past its 2 steps"):
        for step in T.micro_steps(2, 2, 2, 2, lambda i, mb: enumerate("abc")):
            handed.append(step.k)
    assert handed == [0, 1]
    with pytest.raises(ValueError, match="yielded step 1 where step 0 was due"):
        list(T.micro_steps(2, 2, 2, 2, lambda i, mb: iter([(1, "x")])))
    with pytest.raises(ValueError, match="at least one inner step"):
        list(T.micro_steps(2, 2, 2, 0, lambda i, mb: iter([])))


def test_sampler_resume_and_refusals():
    s = PromptSampler(9, 3, seed=11)
    for _ in range(4):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))  # survives JSON (stored in trainer_state.json)
    cont = [s.next_batch().indices for _ in range(4)]
    r = PromptSampler(9, 3, seed=11)
    r.load_state_dict(state)
    assert [r.next_batch().indices for _ in range(4)] == cont
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(9, 3, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len"):
        PromptSampler(10, 3, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="divisible"):
        PromptSampler(10, 3, seed=0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="fewer than"):
        PromptSampler(2, 3, seed=0)
