"""torchrun worker for tests/test_rollout_layout.py::test_a_rollout_longer_than_the_collective_timeout_ends_no_rank
(not collected by pytest).

Two ranks on CPU/gloo share one node's rollout worker (tiny Qwen-Image), whose node group times out after
NODE_TIMEOUT_S. Rank 0 (the driver) freezes the worker (SIGSTOP) for FROZEN_S > NODE_TIMEOUT_S and resumes it
(SIGCONT): the worker answers well inside its own --rollout_timeout_s, but the whole rollout lasts longer than a
collective may wait. Both the blocking `generate` and `submit` / `collect` must still give every rank its rows,
the ranks waiting in rounds of one all_reduce that each end well inside the timeout (counted and timed here).
Then a scorer that never finishes (a consumer whose finish() sleeps past the scoring limit, the collective timeout)
must end both ranks alike with a RolloutError. Each rank writes what it saw to <out>/rank<r>.json.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

import rollout  # noqa: E402
from rollout import RolloutRequest  # noqa: E402

NODE_TIMEOUT_S = 4.0
FROZEN_S = 10.0


def request(rank: int) -> RolloutRequest:
    prompts = [f'A sign that says "{word}"' for word in ("OPEN", "SALE")]
    return RolloutRequest(prompts=prompts, negative_prompts=[" "] * 2, cfg_scale=1.0,
                          seeds=[rollout.row_seed(3, 1, 2 * rank + i) for i in range(2)], num_inference_steps=2,
                          height=64, width=64)


def freeze_worker(client: rollout.DistributedRollout) -> None:
    """Driver only: stop the worker now, resume it FROZEN_S later."""
    if client.is_driver:
        pid = client.group.workers[0].process.pid
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(FROZEN_S, os.kill, (pid, signal.SIGCONT)).start()


class StuckScorer:
    """A rollout consumer (see DistributedRollout.submit) whose scoring never ends."""

    def __init__(self, payloads, sizes):
        self.sizes = sizes

    def on_chunk(self, first_row, part):
        pass

    def finish(self):
        time.sleep(60)
        return [None] * len(self.sizes)

    def busy_s(self):
        return 0.0

    def close(self):
        pass


ROUNDS: list[float] = []  # the wall time of each all_reduce this rank made


def counted_all_reduce(all_reduce):
    def wrapper(*args, **kwargs):
        began = time.monotonic()
        try:
            return all_reduce(*args, **kwargs)
        finally:
            ROUNDS.append(time.monotonic() - began)
    return wrapper


def main() -> None:
    model_path, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # the worker's start-up fits in it
    rank = dist.get_rank()
    client = rollout.DistributedRollout(model_path, ["cpu"], trainer_device="cpu", collective_timeout_s=NODE_TIMEOUT_S,
                                        max_batch_size=2, threads_per_worker=1, timeout_s=300, startup_timeout_s=300)
    dist.all_reduce = counted_all_reduce(dist.all_reduce)
    seen: dict = {"rank": rank}
    try:
        freeze_worker(client)
        began = time.monotonic()
        result = client.generate(request(rank))
        seen["generate"] = {"rows": len(result), "waited_s": time.monotonic() - began, "rounds": list(ROUNDS)}
        ROUNDS.clear()
        freeze_worker(client)
        began = time.monotonic()
        client.submit(request(rank))
        result, _, stats = client.collect(request(rank))
        seen["collect"] = {"rows": len(result), "waited_s": time.monotonic() - began,
                           "gen_s": stats.get("timing_s/gen"), "rounds": list(ROUNDS)}
        began = time.monotonic()
        client.submit(request(rank), consumer=StuckScorer)
        try:
            client.collect(request(rank))
        except Exception as e:  # noqa: BLE001 - the test reads it
            seen["stuck"] = {"error": f"{type(e).__name__}: {e}", "waited_s": time.monotonic() - began}
    except Exception as e:  # noqa: BLE001 - the test reads it
        seen["error"] = f"{type(e).__name__}: {e}"
    finally:
        client.close()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
