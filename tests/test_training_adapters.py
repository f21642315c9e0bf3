"""training/adapters.py: the rollout adapter versions (an earlier run's removed at start-up, a sync's pruning)."""

from __future__ import annotations

import os

from training.adapters import clean_rollout_adapters, prune_rollout_adapters


# ---------------------------------------------------------------------------------------------------------------
# rollout adapter versions
# ---------------------------------------------------------------------------------------------------------------


def test_rollout_adapter_versions_of_earlier_runs_never_remove_the_current_one(tmp_path):
    root = tmp_path / "rollout_adapters"
    for name in ("v00000002", "v00000003", "v00000006", ".v00000004.tmp.abc"):
        (root / name).mkdir(parents=True)
    line = clean_rollout_adapters(str(root))
    assert "v00000002..v00000006" in line and "4 entries" in line and not os.listdir(root)
    assert clean_rollout_adapters(str(root)) is None
    # a version published below leftovers of an earlier run (a resume from an earlier step)
    for name in ("v00000003", "v00000004", "v00000005", "v00000009", "v00000010"):
        (root / name).mkdir()
    assert prune_rollout_adapters(str(root), 5, keep=2) == ["v00000003", "v00000009", "v00000010"]
    assert sorted(os.listdir(root)) == ["v00000004", "v00000005"]  # the new one and the one the workers hold
