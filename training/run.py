"""`setup_run` / `Run`: the setup both trainers do before their loop and the tail of every step (log, validate,
checkpoint), so each trainer file holds only its algorithm. The run's checkpoints and its ways out (stop signals,
--max_wall_time_s, the at-once write of the last finished step, the divergence stop, the run lock) are the `Lifeboat`
that a `Run` holds (training/lifeboat.py)."""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping
import torch
from models import lora
from models.base import attention_backend

from .distributed import (RankFailed, cleanup_distributed, collective_timeout_s, get_rank, init_distributed,
                          on_rank0, raise_if_any_rank_failed, run_phase, seed_everything)
from .lifecycle import (RunLock, RunLockError, install_collective_explainer, say_from_thread, start_heartbeats,
                        stop_at_once_on_signals, watch_parent)
from .lifeboat import Lifeboat
from .preflight import PreflightError, check_flags, run_preflight
from .profiling import ProfileWindow
from .model import ADAPTER_DEFAULT, load_flow_model, prepare_transformer
from .optim import (GradStepper, build_lr_scheduler, build_optimizer, load_lr_scheduler_state_,
                    lr_scheduler_state)
from .data import PromptSampler
from .checkpoint import GatheredState, checkpoint_on_rank0, gather_checkpoint, load_checkpoint
from .resume_policy import content_fingerprints
from .resume import ResumePlan, prepare_resume
from .console import discard_console_log, tee_console
from .logs import (Progress, TensorBoardLogger, WandbLogger, WandbSetupError, all_gather_objects, run_summary,
                   write_run_metadata)
from .perf import perf_metrics
from .flags import adam_betas, parse_lora_init, resolve_device
from .adapters import clean_rollout_adapters, load_init_adapter, sync_rollout_adapter
from .validation import validate

__all__ = ["Run", "setup_run", "prepare_output_dir"]


@dataclass
class Run:
    """Everything a trainer builds before its loop (see `setup_run`) plus the per-step tail both trainers share.

    The trainer files keep what differs between the algorithms: the rollout request, the advantages, the update,
    and which adapter the rollout workers sample with (`sync_rollout`). The run's checkpoints and its ways out
    (stop signals, --max_wall_time_s, the at-once write of the last finished step, the divergence stop, the run
    lock) are its `lifeboat` (training/lifeboat.py)."""

    args: Any
    config: dict[str, Any]
    device: torch.device
    rank: int
    world: int
    logger: TensorBoardLogger | WandbLogger  # --logger
    model: Any                     # the FlowModel wrapper (transformer only: trainer ranks never encode or decode)
    adapter_names: tuple[str, ...]
    lora_config: Any
    num_lora_modules: int          # the rollout workers must bind exactly this many modules at every sync
    optimizer: torch.optim.Optimizer
    stepper: GradStepper
    train_data: Any
    val_data: Any
    sampler: PromptSampler
    mini_prompts: int              # prompts per optimizer step (global)
    scorer: Any
    rollout: Any                   # rollout.DistributedRollout
    adapters_root: str
    start_step: int
    progress: Progress
    lifeboat: Lifeboat             # checkpoints, stops, the divergence stop, the run lock (training/lifeboat.py)
    lr_scheduler: Any = None       # torch LambdaLR (training.optim.build_lr_scheduler), stepped once per step
    rollout_adapter: str | None = None  # what the rollout workers sample with, and its version (last sync_rollout)
    rollout_version: int = 0
    ckpt_config: dict[str, Any] = field(default_factory=dict)  # config + content fingerprints (what resume checks)
    started_at: float = field(default_factory=time.monotonic)  # the training loop's start (`steps`)
    last_val_metrics: dict[str, float] = field(default_factory=dict)  # the last validation's metrics (summary)

    def steps(self) -> Iterator[int]:
        """The steps still to run: start_step + 1 .. total_training_steps. Before each one, every rank checks
        together whether a stop was asked for (SIGTERM/SIGINT/SIGHUP on any rank, --max_wall_time_s) and, if so,
        ends the run at this step boundary (`Lifeboat.stop_if_asked`), so all ranks stop at the same step.
        --max_wall_time_s counts from the first step of this process (set-up, model loading and validation before
        training excluded), so at least one step runs. The loop runs under --attention_backend; with --profile_step
        the profiler records that step from its start to the end of its first --profile_micro_steps update
        micro-steps (`training.profiling.ProfileWindow`, <output_dir>/profile/trainer-rank<r>.json.gz)."""
        args = self.args
        self.started_at = time.monotonic()
        if self.start_step >= args.total_training_steps and self.rank == 0:
            print(f"nothing to do: the run is at step {self.start_step}, --total_training_steps is "
                  f"{args.total_training_steps}", flush=True)
        profiling = self.start_step < args.profile_step <= args.total_training_steps
        window = ProfileWindow(os.path.join(args.output_dir, "profile", f"trainer-rank{self.rank}.json.gz"),
                               micro_steps=args.profile_micro_steps, cuda=self.device.type == "cuda")
        with attention_backend(args.attention_backend):
            for step in range(self.start_step + 1, args.total_training_steps + 1):
                self.lifeboat.stop_if_asked(step - 1, self.started_at)
                if profiling and step == args.profile_step:
                    window.start()
                    self.stepper.on_backward = window.tick
                try:
                    yield step
                finally:
                    if window.recording:
                        self.stepper.on_backward = None
                        window.stop()
        if self.rank == 0 and args.total_training_steps > self.start_step:  # the last step's tail is done
            print(run_summary(self.start_step + 1, args.total_training_steps, time.monotonic() - self.started_at,
                              self.last_val_metrics, self.lifeboat.last_checkpoint, args.output_dir), flush=True)

    def gather(self, step: int) -> GatheredState:
        """The state of finished step `step`, gathered to rank 0 (`gather_checkpoint`); what the lifeboat saves.
        Collective."""
        return gather_checkpoint(step, transformer=self.model.transformer, optimizer=self.optimizer,
                                 lora_config=self.lora_config, config=self.ckpt_config,
                                 sampler=self.sampler, adapter_names=self.adapter_names,
                                 trainer_state={"grad_stepper": self.stepper.state_dict(),
                                                "last_update_step": self.lifeboat.last_update_step,
                                                "lr_scheduler": lr_scheduler_state(self.lr_scheduler)})

    def sync_rollout(self, adapter: str, step: int) -> dict[str, float]:
        """Publish `adapter` to the rollout workers as version `step` (see `sync_rollout_adapter`). Collective: a
        failure on any rank (a rollout worker that died) ends every rank with its message, after the last finished
        step was written (`raise_fatal`)."""
        self.rollout_adapter, self.rollout_version = adapter, step
        return run_phase(lambda: sync_rollout_adapter(self.rollout, self.model.transformer, adapter, self.lora_config,
                                                      self.adapters_root, step, self.num_lora_modules,
                                                      engine_names=self.args.rollout_engine == "vllm_omni"),
                         f"the adapter sync of step {step}", self.raise_fatal)

    def raise_fatal(self, error: BaseException | None, what: str) -> None:
        """Collective: every rank hears whether any rank failed in phase `what` (`raise_if_any_rank_failed`); if one
        did, the last finished step is written (`Lifeboat.fail_with_checkpoint`) and every rank raises."""
        try:
            raise_if_any_rank_failed(error, what)
        except Exception as e:
            self.lifeboat.fail_with_checkpoint(e, what, agreed=e is error or isinstance(e, RankFailed))
            raise

    @property
    def cfg_scale(self) -> float:
        """The run's one CFG scale (rollout, replay, validation; 1.0 = unguided), resolved by `setup_run`."""
        return self.args.cfg_scale

    def validate(self, step: int) -> dict[str, float]:
        """ODE validation on the test split (see `validate`). Collective.

        With --val_adapter (DiffusionNFT) naming another adapter than the rollout workers sample with, the workers
        load it for the validation only (version "val-<adapter>-v<step>" under <output_dir>/val_adapters, the same
        gather + bound-module check as every sync) and get the rollout adapter back afterwards, re-synced under its
        own version: it has not changed since its last sync (the trainers sync right after every change), so the
        next training rollout samples exactly what it would have without validation."""
        val_adapter = getattr(self.args, "val_adapter", None)
        swap = val_adapter is not None and self.rollout_adapter is not None and val_adapter != self.rollout_adapter
        if swap:
            published = self.rollout.versions_published
            run_phase(lambda: sync_rollout_adapter(
                self.rollout, self.model.transformer, val_adapter, self.lora_config,
                os.path.join(self.args.output_dir, "val_adapters"), step, self.num_lora_modules,
                engine_names=self.args.rollout_engine == "vllm_omni", label=f"val-{val_adapter}-v{step}"),
                f"the validation adapter load of step {step}", self.raise_fatal)
        metrics = validate(self.rollout, self.scorer, self.val_data, self.args, step, self.cfg_scale, self.logger,
                           fail=self.raise_fatal)
        if swap:
            self.sync_rollout(self.rollout_adapter, self.rollout_version)
            self.rollout.versions_published = published  # the same policy again: no new version for policy_lag
        self.last_val_metrics = dict(metrics)
        return metrics

    def end_step(self, step: int, metrics: dict[str, float], timings: Mapping[str, float], step_start: float,
                 epoch: int) -> None:
        """The tail of a step: timing and throughput metrics, TensorBoard (flushed), the progress line, a line per
        skipped (non-finite) optimizer step and the --max_consecutive_skips stop, a checkpoint every --save_freq steps
        and at the end (one due on a step that ended skipped is deferred to the next applied one;
        `Lifeboat.note_updates`, `Lifeboat.checkpoint`), then validation every --test_freq steps and at the end.
        Collective."""
        args = self.args
        if self.lr_scheduler is not None:  # the step's updates are done (actor/lr logged the lr they used)
            self.lr_scheduler.step()
        step_time = time.perf_counter() - step_start
        metrics.update(self.stepper.counters())
        metrics.update(timings)
        metrics.update(perf_metrics(args.train_batch_size * args.rollout_n, step_time, self.world))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(epoch)
        if step % args.log_every == 0:
            self.logger.log_scalars(metrics, step)
        if self.rank == 0:
            print(self.progress.line(step, step_time, metrics), flush=True)
        self.logger.flush()  # a crash later loses no logged step (a resume purges the replayed ones)
        skipped_now = self.lifeboat.note_updates(step, self.model.transformer)  # the divergence stop
        last = step == args.total_training_steps
        # the checkpoint first: a validation that fails (a judge down) then loses nothing of this step
        self.lifeboat.checkpoint(step, due=step % args.save_freq == 0 or last, skipped=skipped_now, last=last)
        if self.val_data is not None and ((args.test_freq and step % args.test_freq == 0) or last):
            self.validate(step)

    def close(self) -> None:
        self.rollout.close()
        self.logger.close()
        cleanup_distributed()
        self.lifeboat.release_lock()


def setup_run(args, *, adapter_names: tuple[str, ...], cfg_defaults: Mapping[str, float] | None = None) -> Run:
    """Both trainers' setup, one named phase per line, in this order (each phase's docstring says what it does):
    the start-up guards (a stop signal or the torchrun agent's death before the loop ends the rank at once); the
    model-free checks and the process group (`start_checks`: a refusal exits with its one line); the run lock of
    --output_dir, the console log and the heartbeats (`hold_output_dir`); seeds; --rollout_python checked;
    `--resume` decided model-free (`prepare_output_dir`); TensorBoard (or W&B) and the run metadata (`open_logs`);
    the model with its LoRA adapters `adapter_names` under FSDP2 (`build_model`); AdamW, the skip-checking step and
    the lr schedule (`build_optimizer_and_schedule`); the data and this rank's shard of the sampler
    (`load_data`); the reward scorer; the checkpoint to resume (`resume_state`); the rollout workers of this node
    (`start_rollout_workers`); then the `Run` and its `Lifeboat` (training/lifeboat.py: the checkpoints, the run
    lock, the divergence stop), armed with the SIGTERM/SIGINT/SIGHUP handling (`StopSignals`, with the at-once
    write of the last finished step) and the orphan handler. Adapters are NOT yet synced to the workers: the
    trainer does that with the adapter its algorithm samples from.
    `cfg_defaults`: the trainer's CFG scale per model family where it differs from the model's default
    (`flags.resolve_cfg_scale`); the resolved scale is `args.cfg_scale` (in the run's config) and `Run.cfg_scale`."""
    import rewards
    from models import resolve_model_path
    from rollout import check_rollout_python

    config = vars(args)
    on_orphaned = guard_start_up()
    dist_info, found, group_timeout_s = start_checks(args, cfg_defaults)
    device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
    run_lock = hold_output_dir(args, found, rank, world)
    seed_everything(args.seed)
    rollout_env = check_rollout_python(args.rollout_python, args.rollout_engine) if dist_info.is_local_main \
        else None                  # model-free, on the rank of each node that starts its rollout workers
    plan, ckpt_config = prepare_output_dir(args, config, adapter_names)  # --resume decided and checked
    logger = open_logs(args, config, plan, rollout_env)
    model_path = resolve_model_path(args.model_path)
    model, lora_config, num_lora_modules = build_model(args, model_path, device, adapter_names)
    optimizer, stepper, lr_scheduler = build_optimizer_and_schedule(args, model)
    train_data, val_data, sampler, mini_prompts = load_data(args, rank, world)
    scorer = rewards.RewardScorer(rewards.RewardConfig.from_args(args))
    start_step, last_update_step = resume_state(args, plan, ckpt_config, model, optimizer, stepper, lr_scheduler,
                                                sampler, adapter_names, rank)
    rollout = start_rollout_workers(args, model_path, device, group_timeout_s, start_step, rank)
    lifeboat = Lifeboat(args, rank=rank, world=world, device=device, start_step=start_step, stepper=stepper,
                        ckpt_root=os.path.join(args.output_dir, "checkpoints"), last_update_step=last_update_step,
                        run_lock=run_lock)
    run = Run(args=args, config=config, device=device, rank=rank, world=world, logger=logger, model=model,
              adapter_names=tuple(adapter_names), lora_config=lora_config,
              num_lora_modules=num_lora_modules, optimizer=optimizer, stepper=stepper, train_data=train_data,
              val_data=val_data, sampler=sampler, mini_prompts=mini_prompts, scorer=scorer, rollout=rollout,
              adapters_root=os.path.join(args.output_dir, "rollout_adapters"),
              start_step=start_step, progress=Progress(args.total_training_steps, start_step),
              lifeboat=lifeboat, lr_scheduler=lr_scheduler, ckpt_config=ckpt_config)
    lifeboat.arm(run.gather, run.close, on_orphaned)  # the stop signals and the orphan handler, from now on
    return run


def guard_start_up() -> list[Any]:
    """A stop signal before the loop ends the rank with one line and exit 128 + signal (training.cli.run_cli);
    under torchrun, a rank whose agent died (kill -9) exits instead of training on unsupervised. Returns the
    one-element list holding the orphan handler, which `setup_run` replaces with `Lifeboat.on_orphaned` once the
    Run exists (it writes the last finished step first)."""
    stop_at_once_on_signals()

    def die(old: int, new: int) -> None:
        say_from_thread(f"the torchrun agent (pid {old}) died during start-up: exiting", sys.stderr)
        os._exit(1)

    on_orphaned: list[Any] = [die]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        watch_parent(lambda old, new: on_orphaned[0](old, new))
    return on_orphaned


def start_checks(args, cfg_defaults: Mapping[str, float] | None) -> tuple[Any, dict[str, Any], float]:
    """The model-free checks (training/preflight.py) around the process group's start: the flags on every rank,
    then inputs, output folder and judge on rank 0, its error raised on every rank. The process groups time out
    only after every phase's own timeout, so that the traceback of any start-up error goes to
    <output_dir>/train.log (training.cli.run_cli), held in memory until this run holds the folder's run lock: a
    run refused by it never writes into the live run's log. Sets `args.cfg_scale`, the run's one CFG scale
    (recorded in its config). Returns (the DistInfo, preflight's findings, the collective timeout)."""
    tee_console(args.output_dir, hold=True)
    check_flags(args, int(os.environ.get("WORLD_SIZE", "1")))
    group_timeout_s = collective_timeout_s(args)  # the main group's and the rollout node subgroups'
    dist_info = init_distributed(resolve_device(args.device), timeout_s=group_timeout_s)
    found = on_rank0(lambda: run_preflight(args, dist_info.world_size, cfg_defaults=cfg_defaults),
                     catch=(ValueError, OSError), exc_type=PreflightError)
    args.cfg_scale = found["cfg_scale"]
    return dist_info, found, group_timeout_s


def hold_output_dir(args, found: Mapping[str, Any], rank: int, world: int) -> RunLock | None:
    """One live run per --output_dir: the run lock (`lifecycle.RunLock`, rank 0; before the console log,
    TensorBoard, the resume tidying or any model), then <output_dir>/train.log (rank 0's console and every rank's
    errors, the held lines first), the heartbeats that name a frozen rank (several ranks), and rank 0's report of
    the start-up checks (with the prompts the text encoder will cut). Returns the lock (rank 0)."""
    ranks = all_gather_objects({"host": socket.gethostname(), "pid": os.getpid()})
    try:
        run_lock = on_rank0(lambda: RunLock.acquire(args.output_dir, ranks=ranks), catch=(RunLockError, OSError),
                            exc_type=RunLockError, share=False)  # the lock's file stays with rank 0
    except RunLockError:
        discard_console_log()  # the folder's train.log is the live run's
        raise
    if rank == 0:  # a start-up that ends (an error, a stop signal) leaves the lock empty, like a clean end does
        atexit.register(run_lock.release)
    tee_console(args.output_dir)
    if world > 1:  # a rank frozen (SIGSTOP) or hung is named by rank 0, and in a collective's timeout error
        start_heartbeats(args.output_dir, rank, world, say=lambda line: say_from_thread(line, sys.stdout))
        install_collective_explainer(args.output_dir, world)
    if rank == 0:
        if run_lock.message:
            print(run_lock.message, flush=True)
        probe = f", judge answered in {found['judge_probe_s']:.2f} s" if "judge_probe_s" in found else ""
        print(f"preflight: flags, {found['family']} size {args.height}x{args.width}, every dataset row, rewards "
              f"{', '.join(found['rewards'])}, output folder ok{probe}", flush=True)
        cut = found.get("truncated_prompts")
        if cut:  # once per run, here: the rollout workers would cut them silently
            print(f"WARNING: {cut['count']} of {cut['total']} prompts are longer than --max_sequence_length "
                  f"{args.max_sequence_length} tokens (the longest {cut['longest']}) and are cut to it by the text "
                  f"encoder (e.g. {', '.join(cut['rows'])}); raise --max_sequence_length (up to 1024) or shorten "
                  f"them", flush=True)
    return run_lock


def open_logs(args, config: Mapping[str, Any], plan: ResumePlan, rollout_env) -> TensorBoardLogger | WandbLogger:
    """TensorBoard under <output_dir>/tensorboard (a resume purges the steps after its checkpoint), mirrored to W&B
    with --logger wandb (a refusal there is a start-up refusal, on every rank), and run_metadata.json (config,
    seeds, versions, git commit, the rollout environment)."""
    logger: TensorBoardLogger | WandbLogger = TensorBoardLogger(os.path.join(args.output_dir, "tensorboard"),
                                                                purge_step=plan.purge_step)
    if args.logger == "wandb":  # mirrors to W&B; the TensorBoard files are written all the same
        try:  # collective: rank 0's error is raised on every rank, a start-up refusal like preflight's
            logger = WandbLogger(logger, args.output_dir, config=config, project=args.wandb_project,
                                 name=args.wandb_name, entity=args.wandb_entity, resume=plan.path is not None)
        except WandbSetupError as e:
            raise PreflightError(str(e)) from None
    write_run_metadata(args.output_dir, config, seeds={"seed": args.seed, "val_seed": args.val_seed}, logger=logger,
                       rollout_env=rollout_env)
    return logger


def build_model(args, model_path: str, device: torch.device, adapter_names) -> tuple[Any, Any, int]:
    """The transformer (the trainer ranks never encode or decode), its LoRA adapters `adapter_names` on the
    targets, FSDP2, activation checkpointing and --compile (`prepare_transformer`), `default` from --init_adapter
    when given. Returns (the model wrapper, the LoRA config, the number of LoRA modules the workers must bind)."""
    if get_rank() == 0:
        print(f"loading the transformer from {model_path}", flush=True)
    model = load_flow_model(model_path, args, device)
    targets = args.lora_target_modules.split(",") if args.lora_target_modules else list(model.default_lora_targets)
    lora_config = prepare_transformer(
        model.transformer, block_prefixes=model.lora_block_prefixes, target_modules=targets,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, adapter_names=adapter_names, device=device,
        precision=args.precision, activation_checkpointing=args.activation_checkpointing,
        init_lora_weights=parse_lora_init(args.lora_init_weights),
        checkpoint_blocks=args.activation_checkpointing_blocks, base_weights=args.base_weights_dtype, fsdp=args.fsdp,
        compile=args.compile, compile_prefixes=model.blocks_to_compile)
    num_lora_modules = len(lora.lora_layers(model.transformer, ADAPTER_DEFAULT))
    load_init_adapter(model.transformer, args.init_adapter, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                      expected_modules=num_lora_modules)  # a no-op without --init_adapter
    return model, lora_config, num_lora_modules


def build_optimizer_and_schedule(args, model) -> tuple[torch.optim.Optimizer, GradStepper, Any]:
    """AdamW over the `default` adapter, the optimizer step that skips a non-finite one (`GradStepper`, with
    --max_grad_norm clipping) and the lr schedule (stepped once per RL step)."""
    optimizer = build_optimizer(model.transformer, lr=args.lr, weight_decay=args.weight_decay,
                                betas=adam_betas(args.adam_betas))
    stepper = GradStepper(args.max_grad_norm)
    lr_scheduler = build_lr_scheduler(optimizer, schedule=args.lr_scheduler, warmup_steps=args.lr_warmup_steps,
                                      total_steps=args.total_training_steps, min_lr_ratio=args.min_lr_ratio)
    return optimizer, stepper, lr_scheduler


def load_data(args, rank: int, world: int) -> tuple[Any, Any, PromptSampler, int]:
    """The train and validation prompts (with negatives when CFG is on), this rank's shard of the resumable prompt
    sampler, and the prompts per optimizer step (the preflight checked them against the other batch sizes and the
    world size: `preflight.check_flags`)."""
    from data_prep.dataset import PromptDataset

    train_data = PromptDataset(args.train_files, guidance=args.cfg_scale > 1.0)
    val_data = PromptDataset(args.val_files, guidance=args.cfg_scale > 1.0) if args.val_files else None
    sampler = PromptSampler(len(train_data), args.train_batch_size, seed=args.seed, rank=rank, world_size=world)
    mini_prompts = args.ppo_mini_batch_size or args.train_batch_size
    return train_data, val_data, sampler, mini_prompts


def resume_state(args, plan: ResumePlan, ckpt_config: Mapping[str, Any], model, optimizer, stepper: GradStepper,
                 lr_scheduler, sampler: PromptSampler, adapter_names, rank: int) -> tuple[int, int]:
    """The checkpoint `prepare_output_dir` chose (sha256 and config already checked), loaded exactly: adapters,
    optimizer, every rank's RNG, the sampler cursor, the skip counts and the lr schedule. Returns (the step to
    continue after, the last step whose update was applied); (0, 0) for a fresh run."""
    if not plan.path:
        return 0, 0
    state = load_checkpoint(plan.path, transformer=model.transformer, optimizer=optimizer, config=ckpt_config,
                            sampler=sampler, adapter_names=adapter_names, force=args.resume_force,
                            verify_sha256=False)
    stepper.load_state_dict(state["trainer_state"]["grad_stepper"])
    load_lr_scheduler_state_(lr_scheduler, state["trainer_state"].get("lr_scheduler"))
    if rank == 0:
        print(f"resumed from {plan.path} at step {state['step']}", flush=True)
    return state["step"], int(state["trainer_state"]["last_update_step"])


def start_rollout_workers(args, model_path: str, device: torch.device, group_timeout_s: float, start_step: int,
                          rank: int):
    """This node's rollout workers (`rollout.DistributedRollout`: the whole pipeline on --rollout_devices, which
    can take a while, so rank 0 says so)."""
    from rollout import DistributedRollout

    if rank == 0:
        print(f"rollout: starting the workers of each node ({args.rollout_engine} engine on {args.rollout_devices})",
              flush=True)
    started = time.monotonic()
    rollout = DistributedRollout(model_path, args.rollout_devices.split(","), engine=args.rollout_engine,
                                 dtype=args.rollout_dtype if device.type == "cuda" else "float32",
                                 max_batch_size=args.rollout_max_batch_size, timeout_s=args.rollout_timeout_s,
                                 log_dir=os.path.join(args.output_dir, "rollout_logs"),
                                 threads_per_worker=args.rollout_threads, cfg_batch=args.cfg_batch,
                                 trainer_device=device.type, sync=args.rollout_sync,
                                 python=args.rollout_python, startup_timeout_s=args.rollout_startup_timeout_s,
                                 collective_timeout_s=group_timeout_s, attention_backend=args.attention_backend,
                                 compile_blocks=args.compile == "blocks",
                                 profile_generate=max(0, args.profile_step - start_step))
    if rank == 0:
        print(f"rollout: the workers are ready ({time.monotonic() - started:.1f} s)", flush=True)
    return rollout


def prepare_output_dir(args, config: Mapping[str, Any], adapter_names) -> tuple[ResumePlan, dict[str, Any]]:
    """Model-free, before TensorBoard opens: content fingerprints of the data and model folders (computed on rank
    0, shared), the `--resume` decision (`prepare_resume`: orphans of a killed save, --resume never, sha256, config),
    and the removal of rollout adapters left by earlier runs; rank 0 prints what was done. Collective. Returns the
    plan and the config that checkpoints record (the flags plus "<path flag>@content")."""
    fingerprints = checkpoint_on_rank0(lambda: content_fingerprints(config),
                                       "cannot fingerprint an input for --resume: ")
    ckpt_config = {**config, **fingerprints}
    out = args.output_dir
    plan = prepare_resume(args.resume, os.path.join(out, "checkpoints"), ckpt_config, adapter_names=adapter_names,
                          force=args.resume_force, set_aside_with_checkpoints=(
                              os.path.join(out, "tensorboard"), os.path.join(out, "run_metadata.json")))
    if plan.path and plan.step > args.total_training_steps:
        raise PreflightError(f"--total_training_steps {args.total_training_steps} is below the step of the "
                         f"checkpoint to resume ({plan.path}, step {plan.step}): pass --total_training_steps "
                         f"{plan.step} or more to continue it, or --resume never to start over (its checkpoints are "
                         f"moved aside)")
    if plan.path and plan.step == args.total_training_steps:
        if get_rank() == 0:
            print(f"nothing to do: {plan.path} is at step {plan.step} = --total_training_steps (pass a larger value "
                  f"to continue the run)", flush=True)
        raise SystemExit(0)
    if get_rank() == 0:
        cleaned = clean_rollout_adapters(os.path.join(out, "rollout_adapters"))
        for line in [*plan.messages, *([cleaned] if cleaned else [])]:
            print(line, flush=True)
    return plan, ckpt_config
