"""Optimizer: AdamW over the trainable LoRA tensors, the learning-rate schedule (warm-up, then constant / linear /
cosine; `torch.optim.lr_scheduler.LambdaLR`), grad-norm clipping on FSDP2 DTensor grads (a non-finite loss,
grad norm or updated parameter skips the step on every rank), and the DiffusionNFT `old` adapter copy / EMA
refresh."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
import torch
import torch.distributed as dist
from torch import nn
import losses
from models import lora

from .model import ADAPTER_DEFAULT, ADAPTER_OLD, adapter_pattern, full_tensor, adapter_params

__all__ = [
    "build_optimizer", "LR_SCHEDULES", "lr_multiplier", "build_lr_scheduler", "lr_scheduler_state",
    "load_lr_scheduler_state_", "GradStepper", "ema_adapter_", "adapters_equal", "old_policy_refresh",
    "check_lr_schedule", "local_shard",
]


def build_optimizer(
    transformer: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    adapter: str = ADAPTER_DEFAULT,
) -> torch.optim.AdamW:
    """AdamW over `adapter`'s LoRA tensors that require grad (fused kernel on CUDA). Build after sharding."""
    params = [p for _, p in adapter_params(transformer, adapter) if p.requires_grad]
    if not params:
        raise ValueError(f"no trainable LoRA parameters for adapter {adapter!r}; call add_lora_adapters first")
    frozen_trainable = [n for n, p in transformer.named_parameters() if p.requires_grad and not adapter_pattern(adapter).search(n)]
    if frozen_trainable:
        raise ValueError(f"parameters outside adapter {adapter!r} require grad: {frozen_trainable[:3]}; freeze them")
    fused = params[0].device.type == "cuda"
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)


LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The factor m(s) on the base lr after s scheduler steps (s = 0 for the first training step; verl's convention).

    Warm-up (s < W): m = s / W (so step 1 runs at lr 0 when W > 0, as in verl / transformers). After it, with
    p = min(1, (s - W) / max(1, T - W)) and floor r = min_lr_ratio:
        constant  m = 1
        linear    m = r + (1 - r) (1 - p)
        cosine    m = r + (1 - r) (1 + cos(pi p)) / 2
    T = total_steps (the run's --total_training_steps); the last step s = T - 1 stays just above the floor.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"need --lr_warmup_steps >= 0 and 0 <= --min_lr_ratio <= 1, got {warmup_steps}, {min_lr_ratio}")
    if step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def check_lr_schedule(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
    """ValueError naming the flags unless `lr_multiplier` takes these settings and a decaying schedule has steps
    left after its warm-up (model-free: the preflight runs it before anything loads)."""
    lr_multiplier(0, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps,
                  min_lr_ratio=min_lr_ratio)  # validates the arguments
    if schedule != "constant" and total_steps <= warmup_steps:
        raise ValueError(f"--lr_scheduler {schedule} decays after the warm-up, but --lr_warmup_steps "
                         f"({warmup_steps}) >= --total_training_steps ({total_steps})")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str = "constant", warmup_steps: int = 0,
                       total_steps: int, min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """`LambdaLR` with `lr_multiplier`, stepped once per training step (after the step's updates, as verl does).
    Build it right after the optimizer and BEFORE a checkpoint restores the optimizer (LambdaLR sets the lr at
    construction); restore it with `load_lr_scheduler_state_`."""
    check_lr_schedule(schedule, warmup_steps, total_steps, min_lr_ratio)

    def factor(step: int) -> float:
        return lr_multiplier(step, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps,
                             min_lr_ratio=min_lr_ratio)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    scheduler.spec = {"schedule": schedule, "warmup_steps": int(warmup_steps), "total_steps": int(total_steps),
                      "min_lr_ratio": float(min_lr_ratio)}
    return scheduler


def lr_scheduler_state(scheduler: torch.optim.lr_scheduler.LambdaLR) -> dict[str, Any]:
    """JSON-able state for the checkpoint's trainer_state: LambdaLR's own state (step count, last lrs) + the spec."""
    return {"spec": dict(scheduler.spec), "state": scheduler.state_dict()}


def load_lr_scheduler_state_(scheduler: torch.optim.lr_scheduler.LambdaLR, saved: Mapping[str, Any] | None) -> None:
    """Restore `lr_scheduler_state` so the next lr equals the uninterrupted run's. A decaying schedule depends on
    --total_training_steps, which may otherwise change on resume: a different value is refused."""
    if saved is None:
        raise ValueError("the checkpoint holds no lr scheduler state (trainer_state['lr_scheduler'])")
    spec, now = saved["spec"], scheduler.spec
    if spec["schedule"] != "constant" and spec["total_steps"] != now["total_steps"]:
        raise ValueError(
            f"--lr_scheduler {spec['schedule']} was laid out over --total_training_steps {spec['total_steps']}; this "
            f"run asks for {now['total_steps']}, which would change the lr of every remaining step. Resume with "
            f"--total_training_steps {spec['total_steps']} or start a new run")
    state = dict(saved["state"])
    state.pop("base_lrs", None)  # the peak lr is this run's --lr (equal on a plain resume; --resume_force may change it)
    scheduler.load_state_dict(state)
    # LambdaLR sets the groups' lr only when stepped; the optimizer restore keeps this run's construction-time lr
    # (factor(0), 0 under a warm-up), so set the lr the uninterrupted run would use at this step
    for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly DTensor) tensor, sharing its storage (no communication)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _any_rank(flag: bool, param: torch.Tensor | None) -> bool:
    """True when `flag` is True on any rank sharing `param`'s FSDP2 mesh (one all_reduce of one element, every such
    rank calls it); a plain (rank-local) parameter needs no agreement."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or not dist.is_initialized():
        return flag
    mesh = param.device_mesh
    group = mesh.get_group() if mesh.ndim == 1 else None
    t = torch.tensor([1.0 if flag else 0.0], device=param.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


@dataclass
class GradStepper:
    """Clip, check and apply one optimizer step; a non-finite loss, gradient or updated parameter skips it.

    The trainer back-propagates every loss through `backward` (NaN/inf losses too, so every rank runs the same FSDP
    collectives), which ands its finiteness into one device flag; `step` reads that flag once, with the grad norm.
    Every rank takes the same decision: a non-finite loss on any rank (one all_reduce), a non-finite total grad norm
    (`torch.nn.utils.clip_grad_norm_` reduces FSDP2 DTensor grads across ranks, verified on gloo/CPU against an
    unsharded model), or a non-finite parameter / optimizer state after `optimizer.step()` on any rank (one
    all_reduce) -> the step is skipped: grads dropped, and in the last case the update undone from a
    copy of this rank's parameter and optimizer-state shards taken just before it (exact; costs one copy of the
    LoRA parameters and AdamW moments per rank). `skipped_steps` counts skips over the whole run,
    `consecutive_skips` the current streak (both restored from the checkpoint's trainer state), `last_skip_reason`
    says why the latest one happened.
    """

    max_grad_norm: float = 1.0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    applied_steps: int = 0
    last_skip_reason: str = ""
    _finite: torch.Tensor | None = field(default=None, repr=False)  # all losses since the last step finite (device)
    _batch_problem: str = field(default="", repr=False)
    on_backward: Callable[[], None] | None = field(default=None, repr=False)  # `ProfileWindow.tick` while profiling

    def reject_batch(self, reason: str) -> None:
        """The current rollout batch cannot be trained on (`reason`, e.g. non-finite samples): every `step` until
        the next call skips, as for a non-finite loss. "" accepts the new batch. Call it on every rank per rollout
        (each rank's flag is OR-ed over the ranks in `step`)."""
        self._batch_problem = reason

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` for one micro-step of the update, and-ing ``isfinite(loss)`` into the device flag that
        `step` reads (no host read here). `on_backward`, when set, is called first (the profiler window counts the
        update's micro-steps by it)."""
        if self.on_backward is not None:
            self.on_backward()
        finite = torch.isfinite(loss.detach())
        self._finite = finite if self._finite is None else self._finite & finite
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Returns {"actor/grad_norm", "actor/lr", "actor/step_skipped"} (the running counts are `counters`, logged
        once per RL step: averaged over a step's mini-batches they would read as fractions)."""
        all_params = [p for group in optimizer.param_groups for p in group["params"]]
        params = [p for p in all_params if p.grad is not None]
        first = all_params[0] if all_params else None
        max_norm = self.max_grad_norm if self.max_grad_norm and self.max_grad_norm > 0 else float("inf")
        norm = (full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)) if params
                else torch.zeros(()))
        finite = torch.ones((), dtype=torch.bool) if self._finite is None else self._finite
        grad_norm, loss_finite = torch.stack([norm, finite.to(norm)]).tolist()  # the step's one host read of both
        self._finite = None
        reason = ""
        if _any_rank(bool(self._batch_problem or not loss_finite), first):
            reason = self._batch_problem or "non-finite loss" + ("" if not loss_finite else " on another rank")
        elif not math.isfinite(grad_norm):
            reason = f"non-finite gradient norm ({grad_norm})"
        else:
            backup = self._backup(optimizer)
            optimizer.step()
            if _any_rank(not self._all_finite(optimizer), first):
                self._restore(optimizer, backup)
                reason = "non-finite parameters after the update (the update was undone)"
        if reason:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.last_skip_reason = reason
        else:
            self.applied_steps += 1
            self.consecutive_skips = 0
        optimizer.zero_grad(set_to_none=True)
        return {
            "actor/grad_norm": grad_norm,
            "actor/lr": float(optimizer.param_groups[0]["lr"]),
            "actor/step_skipped": float(bool(reason)),
        }

    def counters(self) -> dict[str, float]:
        """{"actor/skipped_steps": skipped optimizer steps so far, "actor/consecutive_skips": of them in a row now}."""
        return {"actor/skipped_steps": float(self.skipped_steps),
                "actor/consecutive_skips": float(self.consecutive_skips)}

    @staticmethod
    @torch.no_grad()
    def _backup(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[tuple[list[int], torch.Tensor]],
                                                            dict[Any, Any]]:
        """(live tensors, [(their indices, one flat copy of them)], other state) just before `optimizer.step()`: this rank's parameter and
        optimizer-state shards, copied into one flat buffer per device and dtype (a few large copies instead of
        one kernel per tensor: 5,760 for Qwen-Image's 1,440 LoRA tensors); `other` maps each parameter without
        state (AdamW creates it lazily) to None and each non-tensor state value to its value."""
        live: list[torch.Tensor] = []
        other: dict[Any, Any] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                live.append(local_shard(p))
                state = optimizer.state.get(p)
                if not state:
                    other[p] = None
                    continue
                for k, v in state.items():
                    if torch.is_tensor(v):
                        live.append(local_shard(v))
                    else:
                        other[(p, k)] = v
        by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(live):
            by_kind.setdefault((t.device, t.dtype), []).append(i)
        copies = [(indices, torch.cat([live[i].reshape(-1) for i in indices])) for indices in by_kind.values()]
        return live, copies, other

    @staticmethod
    @torch.no_grad()
    def _restore(optimizer: torch.optim.Optimizer, backup) -> None:
        live, copies, other = backup
        for indices, flat in copies:
            for i, piece in zip(indices, flat.split([live[i].numel() for i in indices])):
                live[i].copy_(piece.view(live[i].shape))
        for key, value in other.items():
            if isinstance(key, tuple):
                optimizer.state[key[0]][key[1]] = value
            else:
                optimizer.state.pop(key, None)  # back to "never stepped"

    @staticmethod
    @torch.no_grad()
    def _all_finite(optimizer: torch.optim.Optimizer) -> bool:
        """Every parameter and floating optimizer-state tensor of this rank is finite: their total 1-norm
        (`torch.nn.utils.get_total_norm`: multi-tensor kernels, one host read) is finite iff no element is NaN or
        inf (a finite sum could only overflow past 3.4e38, far beyond any LoRA tensor or AdamW moment)."""
        tensors = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                tensors.append(local_shard(p))
                tensors += [local_shard(v) for k, v in optimizer.state.get(p, {}).items()
                            if k != "step" and torch.is_tensor(v) and v.is_floating_point()]  # step: a counter
        if not tensors:
            return True
        return bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, norm_type=1.0)).item())

    def state_dict(self) -> dict[str, Any]:
        return {"max_grad_norm": self.max_grad_norm, "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "applied_steps": self.applied_steps,
                "last_skip_reason": self.last_skip_reason}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.applied_steps = int(state["applied_steps"])
        self.last_skip_reason = str(state["last_skip_reason"])


def ema_adapter_(transformer: nn.Module, decay: float, src: str = ADAPTER_DEFAULT, dst: str = ADAPTER_OLD) -> None:
    """dst <- decay * dst + (1 - decay) * src on the LoRA A/B tensors (`losses.ema_update_`; decay 0 = hard copy,
    which `models.lora.copy_adapter_` also does). Works on FSDP2 shards: both adapters of a layer share a placement."""
    old, new = [], []
    for path, layer in lora.lora_layers(transformer, src).items():
        if dst not in layer.lora_A:
            raise ValueError(f"adapter {dst!r} is missing on {path}")
        for mod in (layer.lora_A, layer.lora_B):
            old.append(mod[dst].weight.data)
            new.append(mod[src].weight.data)
    if not old:
        raise ValueError(f"the transformer has no LoRA adapter {src!r}")
    losses.ema_update_(old, new, decay)


@torch.no_grad()
def adapters_equal(transformer: nn.Module, a: str = ADAPTER_DEFAULT, b: str = ADAPTER_OLD) -> bool:
    """Whether adapters `a` and `b` hold bit-identical LoRA tensors on every rank (each rank compares its shards as
    one flat copy per adapter, one host read; one all_reduce agrees, so every rank takes the same branch). A NaN
    compares unequal. Collective under FSDP2."""
    mine, theirs, first = [], [], None
    for path, layer in lora.lora_layers(transformer, a).items():
        if b not in layer.lora_A:
            raise ValueError(f"adapter {b!r} is missing on {path}")
        for mod in (layer.lora_A, layer.lora_B):
            first = mod[a].weight if first is None else first
            mine.append(local_shard(mod[a].weight).reshape(-1))
            theirs.append(local_shard(mod[b].weight).reshape(-1))
    if not mine:
        raise ValueError(f"the transformer has no LoRA adapter {a!r}")
    return not _any_rank(not torch.equal(torch.cat(mine), torch.cat(theirs)), first)


def old_policy_refresh(
    transformer: nn.Module,
    step: int,
    *,
    interval: int = 1,
    schedule: str = "copy",
    decay: float | None = None,
) -> dict[str, float]:
    """DiffusionNFT's old-adapter refresh after the actor update of rollout step `step` (1-based, verl-omni).

    Applied when `step % interval == 0`: d = `decay` if given else `losses.old_policy_decay(step, schedule)`;
    d == 0 -> hard copy, else EMA. Returns the `old_policy/*` metrics exactly as verl-omni logs them (all 0.0 when
    the refresh is not due).
    """
    if interval < 1:
        raise ValueError(f"old_policy_update_interval must be >= 1, got {interval}")
    metrics = {"old_policy/update_applied": 0.0, "old_policy/copy_update": 0.0, "old_policy/ema_update": 0.0,
               "old_policy/decay": 0.0}
    if step % interval != 0:
        return metrics
    d = float(decay) if decay is not None else losses.old_policy_decay(step, schedule)
    metrics["old_policy/update_applied"] = 1.0
    metrics["old_policy/decay"] = d
    if d == 0.0:
        lora.copy_adapter_(transformer, ADAPTER_DEFAULT, ADAPTER_OLD)
        metrics["old_policy/copy_update"] = 1.0
    else:
        ema_adapter_(transformer, d)
        metrics["old_policy/ema_update"] = 1.0
    return metrics
