"""Rollouts, the trainers' side: one request/response contract, a group of rollout worker subprocesses on GPUs
reserved for rollout (or colocated with the trainer ranks), and the per-node driver every trainer rank uses.

The trainers build a `RolloutRequest` (one prompt per sample, already repeated `n` times per group), hand it to a
`RolloutGroup`, and get a `RolloutResult` back in request order. Each worker process owns one engine on its own
device(s) (`CUDA_VISIBLE_DEVICES` set per worker) and loads LoRA adapters from the same PEFT directories a
vllm-omni engine would read. Everything that crosses the process boundary is plain data (CPU tensors and built-in
types, read with `torch.load(weights_only=True)`), so the workers may run another Python environment
(`--rollout_python`, e.g. vllm-omni's own torch stack); a start-up handshake refuses a peer of another protocol.

The worker side lives in `engines/`, in layers that import only the ones before them: `sampler` (seeds, SDE
windows, the denoising loop) -> `contract` (request / result) -> `layout` (GPU layouts, shared-memory adapters) ->
`native` / `vllm_omni` (the engines; `vllm_omni_pipelines` imports only `sampler`) -> `protocol` (messages,
handshake) -> `worker` (the worker process, the probe) -> this module. This file is also the processes' entry
script: `python rollout.py --worker ...` / `--probe` run `engines.worker.main`.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import torch

from engines.contract import ENGINES, RolloutRequest, RolloutResult
from engines.layout import (COLOCATED, AdapterBuffer, adapter_layout, adapter_sources, gpu_index, layout_numel,
                            node_worker_devices, resolve_sync, worker_cuda_devices)
from engines.native import NativeEngine
from engines.protocol import ProtocolError, recv_message, send_message_within, handshake_error, peer_info
from engines.sampler import rl_denoise, row_seed
from engines.worker import (RolloutEnvError, WorkerProcess, check_rollout_python, worker_command,
                            worker_process_env)

# what code outside uses as `rollout.X` (the contract, the in-process engine and the trainers' helpers)
__all__ = [
    "ENGINES", "RolloutRequest", "RolloutResult", "row_seed", "rl_denoise", "NativeEngine", "COLOCATED", "gpu_index",
    "AdapterBuffer", "adapter_layout", "layout_numel", "RolloutEnvError", "check_rollout_python", "RolloutError",
    "PendingRollout", "RolloutGroup", "DistributedRollout",
]


class RolloutError(RuntimeError):
    """A rollout worker failed, died or hung; the message carries its stderr tail."""


class PendingRollout:
    """A request in flight on a `RolloutGroup` (`RolloutGroup.submit`). One reader thread per worker takes the
    worker's streamed chunks off its pipe as they arrive, so a worker never stalls on a full pipe while the caller
    does other work (trains, scores), and calls `on_chunk(first_row, part)` from that thread for each chunk (row
    numbers of the whole request). `wait()` returns the whole result in request order."""

    def __init__(self, group: "RolloutGroup", request: RolloutRequest, blocks: Sequence[tuple[int, int]],
                 on_chunk: Callable[[int, RolloutResult], None] | None) -> None:
        self.group, self.request, self.on_chunk = group, request, on_chunk
        self.workers = list(group.workers[: len(blocks)])
        self.blocks = list(blocks)                   # (first row, rows) of each worker's share
        self.submitted_at = time.monotonic()
        self.last_chunk_at: float | None = None      # when the last chunk arrived (monotonic)
        self.memory: list[dict[str, float]] = []     # each worker's `release_memory` report
        self._parts: list[tuple[int, RolloutResult]] = []
        self._lock = threading.Lock()
        self._active = [self.submitted_at] * len(blocks)    # last sign of life of each worker
        self._finished = [threading.Event() for _ in blocks]
        self._outcome: list[tuple[str, str]] = [("", "")] * len(blocks)  # ("done"|"error"|"died"|"broken", detail)
        self._callback_error: BaseException | None = None
        self._threads = [threading.Thread(target=self._read, args=(i,), name=f"rollout-reader-{i}", daemon=True)
                         for i in range(len(blocks))]
        for thread in self._threads:
            thread.start()

    def _read(self, i: int) -> None:
        worker, (first, _) = self.workers[i], self.blocks[i]
        try:
            while True:
                message = recv_message(worker.process.stdout)
                self._active[i] = time.monotonic()
                if not message.get("ok"):
                    self._outcome[i] = ("error", f"{message.get('error')}\n{message.get('traceback', '')}")
                    return
                if message.get("done"):
                    with self._lock:
                        self.memory.append(dict(message.get("memory") or {}))
                    self._outcome[i] = ("done", "")
                    return
                row, part = first + int(message["chunk"]["start"]), RolloutResult.from_dict(message["chunk"]["result"])
                with self._lock:
                    self._parts.append((row, part))
                    self.last_chunk_at = time.monotonic()
                if self.on_chunk is not None and self._callback_error is None:
                    try:
                        self.on_chunk(row, part)
                    except BaseException as e:  # noqa: BLE001 - raised by wait(), in the caller's thread
                        self._callback_error = e
        except EOFError:
            self._outcome[i] = ("died", "")
        except Exception as e:  # a message that cannot be read leaves the channel unusable
            self._outcome[i] = ("broken", f"{type(e).__name__}: {e}")
        finally:
            self._finished[i].set()

    def done(self) -> bool:
        """Every worker has answered (its last chunk, or an error)."""
        return all(event.is_set() for event in self._finished)

    def drain(self) -> None:
        """Wait until every worker has answered this request; the workers are then free for the next one. A worker
        that dies or stays silent longer than the group's `timeout_s` closes the group (`RolloutError` with its
        stderr tail); a worker's error reply is kept for `wait()`."""
        timeout = self.group.timeout_s
        for i, worker in enumerate(self.workers):
            while not self._finished[i].wait(1.0):
                if worker.process.poll() is not None:  # its reader sees the end of the pipe next
                    self._finished[i].wait(10.0)
                    break
                if time.monotonic() - self._active[i] > timeout:
                    raise self.group._fail(worker, f"did not answer within {timeout:.0f} s during generate")
            kind, detail = self._outcome[i]
            if kind in ("died", "") or (kind == "broken" and worker.process.poll() is not None):
                try:
                    code = worker.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    code = None
                raise self.group._fail(worker, f"died during generate (exit code {code})")
            if kind == "broken":
                raise self.group._fail(worker, f"sent an unreadable reply during generate ({detail})")
        if self.group._pending is self:
            self.group._pending = None

    def wait(self) -> RolloutResult:
        """The whole result in request order, once every worker answered (`drain`). A worker's error reply or an
        exception of `on_chunk` is raised here, after every worker finished (the workers stay usable)."""
        self.drain()
        for worker, (kind, detail) in zip(self.workers, self._outcome):
            if kind == "error":
                raise RolloutError(f"rollout worker {worker.index} ({worker.devices}) failed during generate: {detail}")
        if self._callback_error is not None:
            raise self._callback_error
        parts = sorted(self._parts, key=lambda item: item[0])
        rows = [row for row, _ in parts]
        starts = [0]
        for _, part in parts[:-1]:
            starts.append(starts[-1] + len(part))
        if rows != starts or not parts or starts[-1] + len(parts[-1][1]) != len(self.request):
            raise RolloutError(f"the rollout workers returned rows {rows} (chunks of {[len(p) for _, p in parts]}) for "
                               f"a request of {len(self.request)} rows")
        return RolloutResult.cat([part for _, part in parts])


class RolloutGroup:
    """Rollout worker subprocesses, one per entry of `devices`.

    devices: e.g. ["cuda:3"] or ["cuda:2", "cuda:3"] (each worker then sees only its GPU through
    `CUDA_VISIBLE_DEVICES` and runs on cuda:0; "cuda:k" is this process's cuda:k, see `visible_gpu`), or
    ["cpu", "cpu"] for tests. ipc_sources: per worker, this process's cuda index of the trainer GPU that will share
    adapter tensors with it (`load_adapter_tensors`), or None; a GPU other than the worker's own is made visible to
    it as its cuda:1. Requests are split into contiguous row blocks across workers; each worker streams its results
    back chunk by chunk (`submit`), gathered in order. A worker that dies, fails or exceeds `timeout_s` stops the
    group with a `RolloutError` carrying its stderr tail; `close()` (also on Ctrl-C, at exit, or when the parent
    dies) leaves no process behind. attention_backend: the workers' SDPA backend (`models.base.attention_backend`);
    compile_blocks: a native engine compiles its transformer blocks (`models.base.compile_blocks`);
    profile_generate N > 0: each worker records a torch.profiler trace of its N-th generate request into
    `log_dir`/profile-worker-<index>.json.gz (`engines.profiler.step_profiler`).
    """

    def __init__(self, model_path: str, devices: Sequence[str], *, engine: str = "native", dtype: str = "float32",
                 max_batch_size: int = 8, timeout_s: float = 1800.0, startup_timeout_s: float = 1800.0,
                 log_dir: str | None = None, threads_per_worker: int = 0, env: dict[str, str] | None = None,
                 cfg_batch: bool = False, ipc_sources: Sequence[int | None] | None = None,
                 python: str | None = None, attention_backend: str = "auto", profile_generate: int = 0,
                 compile_blocks: bool = False) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown rollout engine {engine!r}; choose from {ENGINES}")
        if not devices:
            raise ValueError("a rollout group needs at least one device")
        self.timeout_s = timeout_s
        self.workers: list[WorkerProcess] = []
        self._pending: PendingRollout | None = None
        self.closed_reason = ""
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="rollout-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            for index, device in enumerate(devices):
                worker_env = worker_process_env(env)
                local_device, ipc_index = device, None
                if device.startswith("cuda"):
                    worker_env["CUDA_VISIBLE_DEVICES"], ipc_index = worker_cuda_devices(
                        device, None if ipc_sources is None else ipc_sources[index])
                    local_device = "cuda:0"
                log_path = os.path.join(self.log_dir, f"rollout-worker-{index}.log")
                log = open(log_path, "ab")
                command = worker_command(
                    python, engine=engine, model_path=model_path, device=local_device, dtype=dtype,
                    max_batch_size=max_batch_size, threads=threads_per_worker, attention_backend=attention_backend,
                    cfg_batch=cfg_batch, compile_blocks=compile_blocks, profile_generate=profile_generate,
                    profile_path=os.path.join(self.log_dir, f"profile-worker-{index}.json.gz"))
                # unbuffered: select() on the pipe then sees every byte the worker wrote
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                           env=worker_env, bufsize=0)
                log.close()
                self.workers.append(WorkerProcess(index, device, process, log_path, ipc_index))
            ours = peer_info()
            for worker in self.workers:  # the handshake: both sides send theirs, each refuses an incompatible peer
                self._send(worker, {"op": "hello", **ours}, "the handshake", startup_timeout_s)
            for worker in self.workers:
                problem = handshake_error(ours, self._read(worker, startup_timeout_s, "the handshake"),
                                          peer=f"rollout worker {worker.index} ({worker.devices})")
                if problem:
                    self.close()
                    raise RolloutError(f"{problem} (the worker runs --rollout_python {python or sys.executable})")
            for worker in self.workers:
                reply = self._read(worker, startup_timeout_s, "start-up")
                if not reply.get("ok"):
                    raise RolloutError(f"rollout worker {worker.index} ({worker.devices}) failed to start: "
                                       f"{reply.get('error')}\n{reply.get('traceback', '')}")
        except BaseException:
            self.close()
            raise

    # ---- plumbing ---------------------------------------------------------------------------------------------
    def _fail(self, worker: WorkerProcess, what: str) -> RolloutError:
        self.close()
        self.closed_reason = f"rollout worker {worker.index} ({worker.devices}) {what}"
        return RolloutError(f"{self.closed_reason}; stderr tail ({worker.log_path}):\n{worker.stderr_tail()}")

    def _send(self, worker: WorkerProcess, message: dict, what: str, timeout_s: float) -> None:
        try:
            send_message_within(worker.process.stdin.fileno(), message, timeout_s)
        except TimeoutError:  # before OSError: it is one
            raise self._fail(worker, f"did not read {what} within {timeout_s:.0f} s (alive, not reading)") from None
        except OSError:
            raise self._fail(worker, f"is gone (could not send {what})") from None

    def _read(self, worker: WorkerProcess, timeout_s: float, what: str) -> dict:
        stdout = worker.process.stdout
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(worker, f"did not answer within {timeout_s:.0f} s during {what}")
            ready, _, _ = select.select([stdout], [], [], min(remaining, 1.0))
            if ready:
                try:
                    return recv_message(stdout)
                except EOFError:
                    code = worker.process.wait(timeout=10)
                    raise self._fail(worker, f"died during {what} (exit code {code})") from None
                except ProtocolError as e:
                    raise self._fail(worker, f"sent a message that was refused during {what}: {e}") from None
            if worker.process.poll() is not None:
                raise self._fail(worker, f"died during {what} (exit code {worker.process.returncode})")

    def _call_all(self, messages: list[dict], what: str) -> list[dict]:
        """Send one message per worker (they run in parallel), then collect every reply in worker order.

        A worker that dies or hangs closes the group. A worker that reports an error (e.g. a request that
        violates the contract) stays alive: all replies are drained first, then the first error is raised.
        A submitted request still sampling is finished first (its results stay with its `PendingRollout`).
        """
        self._finish_pending()
        if not self.workers:
            raise RolloutError(f"the rollout group is closed{': ' + self.closed_reason if self.closed_reason else ''}")
        for worker, message in zip(self.workers, messages):
            self._send(worker, message, what, self.timeout_s)
        replies = [self._read(worker, self.timeout_s, what) for worker in self.workers[: len(messages)]]
        for worker, reply in zip(self.workers, replies):
            if not reply.get("ok"):
                raise RolloutError(f"rollout worker {worker.index} ({worker.devices}) failed during {what}: "
                                   f"{reply.get('error')}\n{reply.get('traceback', '')}")
        return replies

    # ---- API --------------------------------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Split the request's rows into contiguous blocks, one per worker, and gather the results in order."""
        return self.submit(request).wait()

    def submit(self, request: RolloutRequest,
               on_chunk: Callable[[int, RolloutResult], None] | None = None) -> PendingRollout:
        """Send the request to the workers (contiguous row blocks, one per worker) and return at once; the
        `PendingRollout` collects the chunks as the workers stream them (`on_chunk(first_row, part)` for each, from a
        reader thread) and `wait()` gives the whole result. One request is in flight at a time: a new request or
        any other call first waits until the previous one has finished sampling."""
        request.validate()
        self._finish_pending()
        if not self.workers:
            raise RolloutError(f"the rollout group is closed{': ' + self.closed_reason if self.closed_reason else ''}")
        n, k = len(request), min(len(self.workers), len(request))
        bounds = [round(i * n / k) for i in range(k + 1)]
        for i, worker in enumerate(self.workers[:k]):
            message = {"op": "generate", "request": request.select(range(bounds[i], bounds[i + 1])).to_dict()}
            self._send(worker, message, "generate", self.timeout_s)
        self._pending = PendingRollout(self, request, [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(k)],
                                       on_chunk)
        return self._pending

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.drain()

    def load_adapter(self, adapter_dir: str, version: str) -> list[int]:
        """Every worker loads the PEFT adapter directory; returns each worker's bound-module count."""
        replies = self._call_all([{"op": "load_adapter", "path": adapter_dir, "version": version}] * self.num_workers,
                                 "load_adapter")
        return [int(r["bound_modules"]) for r in replies]

    def load_adapter_tensors(self, shares: Sequence[dict[str, Any]], layout: list, config: dict[str, Any],
                             version: str) -> list[int]:
        """Every worker binds the adapter tensors of its trainer rank's `AdapterBuffer` (`shares[i]` = that buffer's
        `share()`), laid out by `layout` (`adapter_layout`) with the PEFT `config`; no disk round trip. Returns each
        worker's bound-module count. The message is plain data (CUDA IPC handles are bytes); a CUDA IPC handle needs
        the same torch on both sides, which the worker checks."""
        messages = []
        for worker, share in zip(self.workers, shares):
            source = dict(share)
            if source.get("kind") == "cuda_ipc":
                if worker.ipc_index is None:
                    raise RolloutError(f"rollout worker {worker.index} ({worker.devices}) was started without "
                                       "access to a trainer GPU (ipc_sources), so it cannot map CUDA IPC tensors")
                source["device"] = worker.ipc_index
            messages.append({"op": "load_adapter_tensors", "version": version, "config": config, "layout": layout,
                             "source": source, "torch_version": str(torch.__version__)})
        if len(messages) != self.num_workers:
            raise RolloutError(f"{len(messages)} adapter shares for {self.num_workers} rollout workers")
        replies = self._call_all(messages, "load_adapter_tensors")
        return [int(r["bound_modules"]) for r in replies]

    def close(self) -> None:
        """Stop every worker (politely, then SIGKILL); idempotent."""
        self._pending = None
        workers, self.workers = self.workers, []
        for worker in workers:
            try:
                worker.process.stdin.close()
            except OSError:
                pass
        for worker in workers:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()

    def __enter__(self) -> "RolloutGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------------
# Trainer side: one rollout group per node, driven by the node's local rank 0
# ---------------------------------------------------------------------------------------------------------


class DistributedRollout:
    """What every trainer rank uses. On each node, local rank 0 owns a `RolloutGroup` on that node's rollout GPUs;
    `generate` gathers the node's per-rank requests (over a gloo subgroup of the node's ranks), runs them as one
    request and scatters each rank its own rows back. Without torch.distributed it is a plain group.

    Layouts (`node_worker_devices`): `devices` = GPUs reserved for rollout on every node (e.g. ["cuda:3"]), or
    ["colocated"]: one worker per trainer rank of the node, on that rank's GPU (the trainer empties its CUDA cache
    before each rollout, the worker after each request). Multi-node: every node runs `torchrun
    --nproc_per_node=<trainer GPUs>`; disk adapter versions must be on a filesystem all nodes see.

    Besides `generate`, the trainers use `submit` / `collect` (the rollout runs while the driver scores finished
    chunks, or while the ranks train: `--rollout_policy_lag`) and `load_adapter_tensors` (`sync` = "tensors": each
    worker gets the adapter from a trainer rank of its own node in memory, `AdapterBuffer`).
    """

    def __init__(self, model_path: str, devices: Sequence[str], *, trainer_device: str = "cpu", sync: str = "disk",
                 collective_timeout_s: float | None = None, **group_kwargs: Any) -> None:
        """collective_timeout_s: timeout of the node subgroups (None = torch's default); the trainers pass the one
        of their main group (`training.collective_timeout_s`), above every rollout timeout, so that a node's ranks
        waiting for the driver hear its RolloutError instead of timing out first."""
        import datetime

        import torch.distributed as dist

        self.distributed = dist.is_available() and dist.is_initialized()
        self.scoring_limit_s = collective_timeout_s or 1800.0   # `_while_drivers_work`
        self.keepalive_s = min(60.0, self.scoring_limit_s / 10)
        self.node_group, self.node_root = None, 0
        local_rank, local_world = 0, 1
        if self.distributed:
            world = dist.get_world_size()
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if world % local_world:
                raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}")
            # every rank must create every node's subgroup (a collective), then keep its own
            timeout = None if collective_timeout_s is None else datetime.timedelta(seconds=collective_timeout_s)
            self.node_group, _ = dist.new_subgroups(group_size=local_world, backend="gloo", timeout=timeout)
            self.node_root = dist.get_global_rank(self.node_group, 0)
            if world > local_world and group_kwargs.get("log_dir"):
                # nodes share the output directory: each node's workers log into their own folder
                group_kwargs["log_dir"] = os.path.join(group_kwargs["log_dir"], f"node{dist.get_rank() // local_world}")
        if COLOCATED in devices and group_kwargs.get("engine", "native") != "native":
            raise ValueError(f"--rollout_devices {COLOCATED} is for the native engine; the vllm_omni engine manages "
                             "its GPU memory itself and needs rollout GPUs of its own (e.g. --rollout_devices cuda:3)")
        devices = node_worker_devices(devices, local_world_size=local_world, trainer_device=trainer_device)
        self.sync_mode = resolve_sync(sync, engine=group_kwargs.get("engine", "native"), trainer_device=trainer_device,
                                      devices=devices)
        self.adapter_sources = adapter_sources(devices, local_world_size=local_world, trainer_device=trainer_device)
        self.feeds_workers = self.sync_mode == "tensors" and local_rank in self.adapter_sources
        self._local_rank, self._node_world = local_rank, local_world
        self.device = torch.device(f"cuda:{local_rank}" if trainer_device == "cuda" else "cpu")
        # a worker samples on this rank's GPU: hand it the cached memory before every rollout
        self.shares_gpu = trainer_device == "cuda" and local_rank in [gpu_index(d) for d in devices]
        self.versions_published = 0          # adapter versions loaded so far (`rollout/policy_lag` counts them)
        self._pending: dict[str, Any] | None = None
        if self.sync_mode == "tensors" and trainer_device == "cuda":
            group_kwargs["ipc_sources"] = self.adapter_sources
        self.group, error = None, None
        if local_rank == 0:
            try:
                self.group = RolloutGroup(model_path, devices, **group_kwargs)
            except Exception as e:  # reported after every rank has heard of it, so no rank waits forever
                error = e
        self._check_started(error)

    def _check_started(self, error: Exception | None) -> None:
        """Every rank learns whether every node's group started, and the first failed driver's error (so none waits
        forever on a failed node, and every rank's log says why)."""
        if self.distributed:
            import torch.distributed as dist

            messages: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
            failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
            if error is None and failed:
                raise RolloutError(f"the rollout group of rank {failed[0][0]} failed to start: {failed[0][1]}")
        if error is not None:
            raise error

    @property
    def is_driver(self) -> bool:
        return self.group is not None

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """This rank's rows of the node's combined request, in order. Collective over all ranks."""
        self._release_trainer_cache()
        if not self.distributed:
            return self.group.generate(request)
        gathered = self._node_gather(request.to_dict())

        def driver_work() -> tuple[list[Any], Exception | None]:
            try:
                requests = [RolloutRequest.from_dict(r) for r in gathered]
                result, start, parts = self.group.generate(RolloutRequest.concat(requests)), 0, []
                for r in requests:
                    parts.append({"result": result.select(range(start, start + len(r))).to_dict()})
                    start += len(r)
                return parts, None
            except Exception as e:  # every rank of the node must hear about it, not hang in the scatter
                return [{"error": f"{type(e).__name__}: {e}"}] * len(gathered), e

        mine = self._node_scatter(self._while_drivers_work(driver_work)[0])
        if "error" in mine:
            raise RolloutError(f"rollout failed on this node: {mine['error']}")
        return RolloutResult(**mine["result"])

    def load_adapter(self, adapter_dir: str, version: str) -> list[int]:
        """Every node's workers load the adapter; returns this node's per-worker bound-module counts on every rank
        of the node. Collective over the node's ranks."""
        return self._load_on_driver(lambda: self.group.load_adapter(adapter_dir, version),
                                    f"adapter {adapter_dir} could not be loaded by the rollout workers")

    def _load_on_driver(self, load: Callable[[], list[int]], failure: str) -> list[int]:
        """An adapter version loaded by `load()` on the driver: its counts on every rank of the node, or on every
        rank `RolloutError(f"{failure}: <the driver's error>")`; counts the version published. Collective."""
        counts, error = None, None
        if self.is_driver:
            try:
                counts = load()
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        if self.distributed:
            import torch.distributed as dist

            box = [{"counts": counts, "error": error}]
            dist.broadcast_object_list(box, src=self.node_root, group=self.node_group)
            counts, error = box[0]["counts"], box[0]["error"]
        if error:
            raise RolloutError(f"{failure}: {error}")
        self.versions_published += 1
        return counts

    # ---- overlapped rollouts, lagged rollouts and the tensor sync (the trainers' path) ------------------------
    def _release_trainer_cache(self) -> None:
        if self.shares_gpu:
            torch.cuda.empty_cache()

    def _node_gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value` on the driver (in node-rank order), None elsewhere. Collective over the node."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size(self.node_group) if self.is_driver else None
        dist.gather_object(value, gathered, dst=self.node_root, group=self.node_group)
        return gathered

    def _node_scatter(self, parts: list[Any] | None) -> Any:
        """This rank's entry of the driver's `parts` (one per rank of the node, in node-rank order; None on the
        other ranks). Collective over the node."""
        if not self.distributed:
            return parts[0]
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(box, parts if self.is_driver else None, src=self.node_root, group=self.node_group)
        return box[0]

    @property
    def has_pending(self) -> bool:
        """A rollout was submitted and not yet collected (on every rank of the node alike)."""
        return self._pending is not None

    def submit(self, request: RolloutRequest, *, payload: Any = None,
               consumer: Callable[[list[Any], list[int]], Any] | None = None) -> None:
        """Start this rank's share of the node's next rollout and return without waiting for it. Collective over the
        node's ranks: the requests (and each rank's `payload`, plain data such as what scoring needs) go to the
        driver, which submits them as one request. On the driver, `consumer(payloads, sizes)` (optional) builds the
        object that sees every chunk as the workers stream it (`on_chunk(first_row, part)`, called from reader
        threads, rows of the node's combined request) and whose `finish()` returns one value per rank at `collect`
        (`close()` at the end, in every case). At most one rollout is pending; `collect` ends it. An error on the
        driver is reported to every rank by `collect`."""
        if self._pending is not None:
            raise RolloutError("a rollout is already pending on this rank: collect it first")
        self._release_trainer_cache()
        gathered = self._node_gather({"request": request.to_dict(), "payload": payload})
        state: dict[str, Any] = {"request": request, "versions": self.versions_published,
                                 "submitted": time.monotonic()}
        if self.is_driver:
            try:
                requests = [RolloutRequest.from_dict(g["request"]) for g in gathered]
                state["sizes"] = [len(r) for r in requests]
                if consumer is not None:
                    state["stream"] = consumer([g["payload"] for g in gathered], state["sizes"])
                on_chunk = state["stream"].on_chunk if consumer is not None else None
                state["rollout"] = self.group.submit(RolloutRequest.concat(requests), on_chunk=on_chunk)
            except Exception as e:  # every rank hears of it at collect
                state["error"] = e
        self._pending = state

    def finish_pending(self) -> None:
        """Driver: wait until the pending rollout's last chunk is in (its consumer may still be working), so that
        the workers are free, e.g. for the next adapter version. Other ranks: nothing. Errors wait for `collect`."""
        state = self._pending
        if state is not None and self.is_driver and "rollout" in state and "error" not in state:
            try:
                state["rollout"].drain()
            except Exception as e:
                state["error"] = e

    def collect(self, request: RolloutRequest, *, lagged: bool = False) -> tuple[RolloutResult, Any, dict[str, float]]:
        """This rank's rows of the pending rollout (which must have been submitted with this `request`), the
        consumer's value for this rank (None without a consumer) and the driver's timings. Collective over all
        ranks. Timings (seconds, wall clock on the node's driver): `timing_s/gen` the wait for the samples
        from `submit` (or from this call when `lagged`: the samples came while the ranks trained),
        `timing_s/gen_sampling` submit to last chunk, `timing_s/reward` the consumer's work left after the last chunk
        (the part not hidden behind sampling), `timing_s/reward_total` the consumer's busy span (`busy_s()`);
        `rollout/policy_lag` the adapter versions loaded since the submit; `rollout/worker_mem_*_gib` the largest
        worker's CUDA peak / held memory after the request."""
        state = self._pending
        if state is None:
            raise RolloutError("collect: no rollout is pending (submit one first)")
        if state["request"].seeds != request.seeds or state["request"].prompts != request.prompts:
            raise RolloutError("collect: the pending rollout was submitted for other rows (seeds or prompts differ)")
        self._pending = None
        began = time.monotonic()
        lag = {"rollout/policy_lag": float(self.versions_published - state["versions"])}

        def driver_work() -> tuple[list[Any], Exception | None]:
            parts: list[Any] = []
            stream = state.get("stream")
            try:
                if "error" in state:
                    raise state["error"]
                pending = state["rollout"]
                result = pending.wait()
                sampled = pending.last_chunk_at or time.monotonic()
                values = stream.finish() if stream is not None else [None] * len(state["sizes"])
                scored = time.monotonic()
                stats = {"timing_s/gen": max(0.0, sampled - (began if lagged else state["submitted"])),
                         "timing_s/gen_sampling": sampled - state["submitted"]}
                if stream is not None:
                    stats["timing_s/reward"] = max(0.0, scored - max(sampled, began))
                    stats["timing_s/reward_total"] = float(stream.busy_s())
                for key in ("peak_gib", "reserved_gib"):
                    held = [m[key] for m in pending.memory if key in m]
                    if held:
                        stats[f"rollout/worker_mem_{key.replace('_gib', '')}_gib"] = max(held)
                start = 0
                for size, value in zip(state["sizes"], values):
                    parts.append({"result": result.select(range(start, start + size)).to_dict(), "value": value,
                                  "stats": stats})
                    start += size
                return parts, None
            except Exception as e:  # every rank of the node must hear about it, not hang in the scatter
                sizes = state.get("sizes") or [None] * self._node_world
                return [{"error": f"{type(e).__name__}: {e}"}] * len(sizes), e
            finally:
                if stream is not None:
                    stream.close()

        parts, driver_error = self._while_drivers_work(driver_work,
                                                       lambda: "rollout" in state and state["rollout"].done())
        mine_part = self._node_scatter(parts)
        if driver_error is not None:
            raise driver_error
        if "error" in mine_part:
            raise RolloutError(f"rollout or its scoring failed on this node: {mine_part['error']}")
        return RolloutResult(**mine_part["result"]), mine_part["value"], {**mine_part["stats"], **lag}

    def _while_drivers_work(self, work: Callable[[], tuple[list[Any], Exception | None]],
                            sampled: Callable[[], bool] = lambda: False) -> tuple[list[Any], Exception | None]:
        """`work()` on this node's driver (a rollout's sampling and scoring: the parts for the node's ranks and its
        error) while every rank of every node waits; ([], None) on the others. The wait is rounds of one all_reduce
        over all ranks (a CPU tensor: gloo, which the trainers' default group has) of at most `keepalive_s` each,
        so a rollout may outlast the collective timeout; a frozen rank still ends the others (its round never
        comes), and scoring still running `scoring_limit_s` after `sampled()` turned true ends them all alike."""
        if not self.distributed:
            return work()
        import torch.distributed as dist

        outcome: dict[str, Any] = {}
        thread, sampled_at, late = None, None, False
        if self.is_driver:
            thread = threading.Thread(target=lambda: outcome.update(value=work()), name="rollout-driver", daemon=True)
            thread.start()
        while True:
            if thread is not None:
                thread.join(self.keepalive_s)
                sampled_at = sampled_at or (time.monotonic() if sampled() else None)
                late = sampled_at is not None and time.monotonic() - sampled_at > self.scoring_limit_s
            working = torch.tensor([float(thread is not None and thread.is_alive() and not late)])
            dist.all_reduce(working, op=dist.ReduceOp.MAX)
            if working.item() == 0:
                break
        if thread is None or "value" in outcome:
            return outcome.get("value", ([], None))
        error = RolloutError(f"the rollout's scoring was still running {self.scoring_limit_s:.0f} s after its last "
                             "sample" if late else "the rollout driver's thread ended without a result (see above)")
        return [{"error": f"RolloutError: {error}"}] * self._node_world, error

    def load_adapter_tensors(self, buffer: AdapterBuffer | None, layout: list, config: dict[str, Any],
                             version: str) -> list[int]:
        """The tensor sync: every worker of the node binds the adapter from its source rank's `buffer`
        (`adapter_sources`; None on ranks that feed no worker) without a disk round trip; returns this node's
        per-worker bound-module counts on every rank of the node. Collective over the node's ranks; the buffers
        may be freed once it returns."""
        # one share per worker fed: each CUDA IPC share carries its own reference count for its reader
        fed = self.adapter_sources.count(self._local_rank)
        shares = self._node_gather([buffer.share() for _ in range(fed)] if buffer is not None else None)

        def load() -> list[int]:
            missing = sorted({s for s in self.adapter_sources if not shares[s]})
            if missing:
                raise RolloutError(f"local ranks {missing} shared no adapter tensors")
            return self.group.load_adapter_tensors([shares[s].pop() for s in self.adapter_sources], layout, config,
                                                   version)

        return self._load_on_driver(load, f"adapter {version} (tensors) could not be loaded by the rollout workers")

    def close(self) -> None:
        state, self._pending = self._pending, None
        if state is not None and state.get("stream") is not None:  # a rollout never collected (the run stopped)
            state["stream"].close()
        if self.group is not None:
            self.group.close()


if __name__ == "__main__":  # a rollout worker or the environment probe (engines/worker.py)
    from engines.worker import main

    main()
