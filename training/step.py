"""The parts of an online RL step both trainers share: flags, rollout requests, rewards, global advantages,
validation, and the adapter sync to the rollout workers (with its bound-module check)."""

from __future__ import annotations

import os
import shutil
from typing import Any, Sequence
import torch
import torch.distributed as dist
import losses

from .distributed import all_gather_cat, barrier, get_rank, get_world_size, is_main_process
from .model import adapter_state_dict, save_adapter_dir
from .checkpoint import CheckpointError, find_latest
from .logs import image_grid, reward_metrics, timer, validation_metrics

__all__ = [
    "add_common_args", "resolve_device", "guidance_of", "rollout_request", "score_samples", "global_advantages",
    "sync_rollout_adapter", "parse_lora_init", "load_flow_model", "check_batch_sizes", "resume_path", "validate"
]


# =================================================================================================================


def add_common_args(parser) -> None:
    """Flags shared by train_nft.py and train_dppo.py (defaults: verl-omni's where it has one)."""
    import rewards

    g = parser.add_argument_group("model")
    g.add_argument("--model_path", default=os.environ.get("MODEL_PATH"),
                   help="pipeline folder (Boogu-Image or Qwen-Image; model_index.json decides) or a Hub id; "
                        "default $MODEL_PATH")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="trainer device")
    g.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="FSDP2 compute dtype on GPU (master LoRA weights stay fp32); CPU always computes in fp32")
    g.add_argument("--max_sequence_length", type=int, default=512, help="Qwen-Image prompt token budget")
    g = parser.add_argument_group("data")
    g.add_argument("--train_files", default=os.environ.get("TRAIN_FILES"), help="train.parquet (data_prep/)")
    g.add_argument("--val_files", default=os.environ.get("VAL_FILES"), help="test.parquet for validation")
    g.add_argument("--train_batch_size", type=int, default=32, help="prompts per rollout step (global)")
    g.add_argument("--rollout_n", type=int, default=16, help="samples per prompt (one group per prompt)")
    g.add_argument("--ppo_mini_batch_size", type=int, default=None,
                   help="prompts per optimizer step (global); default = train_batch_size (one step per rollout)")
    g.add_argument("--micro_batch_size", type=int, default=4, help="samples per GPU per forward/backward")
    g.add_argument("--ppo_epochs", type=int, default=1, help="passes over each rollout batch")
    g.add_argument("--val_max_samples", type=int, default=256, help="validation prompts (0 = all)")
    g = parser.add_argument_group("LoRA and optimizer")
    g.add_argument("--lora_rank", type=int, default=64)
    g.add_argument("--lora_alpha", type=float, default=64.0)
    g.add_argument("--lora_target_modules", default=None,
                   help="comma-separated; default = the model's validated list (Boogu: 18 names, Qwen: 12)")
    g.add_argument("--lora_init_weights", default="gaussian", help="peft init for A ('gaussian' or 'true'); B = 0")
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--adam_betas", default="0.9,0.999")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="grad-norm clip; a non-finite norm skips the step")
    g.add_argument("--activation_checkpointing", action="store_true", help="recompute block activations in backward")
    g = parser.add_argument_group("rollout")
    g.add_argument("--rollout_engine", default="native", choices=["native", "vllm_omni"])
    g.add_argument("--rollout_devices", default="cuda:3",
                   help="rollout workers of EACH node, comma-separated: e.g. 'cuda:3' (4-GPU node: 3 trainer GPUs), "
                        "'cuda:2,cuda:3', or 'cpu,cpu' for CPU runs")
    g.add_argument("--rollout_dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--rollout_max_batch_size", type=int, default=16, help="samples per rollout forward")
    g.add_argument("--rollout_timeout_s", type=float, default=3600.0, help="a rollout worker silent longer fails")
    g.add_argument("--rollout_threads", type=int, default=0, help="CPU threads per rollout worker (0 = default)")
    g.add_argument("--rollout_python", default=None,
                   help="Python interpreter of the rollout workers (default: the trainer's own), e.g. the bin/python "
                        "of a separate vllm-omni environment for --rollout_engine vllm_omni; checked at start-up "
                        "before any model loads, its versions go into run_metadata.json")
    g.add_argument("--cfg_batch", action="store_true",
                   help="run the conditional and unconditional CFG branches as ONE batched forward, in rollout and in "
                        "training alike (same result within float tolerance; faster when the GPU is not saturated)")
    g.add_argument("--height", type=int, default=512)
    g.add_argument("--width", type=int, default=512)
    g.add_argument("--num_inference_steps", type=int, default=10, help="rollout steps (training)")
    g.add_argument("--guidance_scale", type=float, default=None,
                   help="Boogu-Image text CFG (None = 4.0, the released default; 1.0 disables CFG)")
    g.add_argument("--true_cfg_scale", type=float, default=None,
                   help="Qwen-Image true CFG (None = 4.0; needs negative prompts when > 1)")
    g.add_argument("--seed", type=int, default=42, help="seeds rollouts (per-row streams), sampling and re-noising")
    g = parser.add_argument_group("validation, logging, checkpoints")
    g.add_argument("--val_num_inference_steps", type=int, default=50)
    g.add_argument("--val_seed", type=int, default=42)
    g.add_argument("--test_freq", type=int, default=0, help="validate every N steps (0 = only at the end)")
    g.add_argument("--val_before_train", action="store_true")
    g.add_argument("--num_val_images", type=int, default=8, help="validation samples shown in the image grid")
    g.add_argument("--total_training_steps", type=int, default=300)
    g.add_argument("--save_freq", type=int, default=30, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep_last", type=int, default=3, help="complete checkpoints to keep")
    g.add_argument("--resume", default="auto",
                   help="'auto' = latest complete checkpoint under <output_dir>/checkpoints if any, 'never', or a "
                        "checkpoint directory")
    g.add_argument("--output_dir", default="outputs/run", help="TensorBoard logs, checkpoints, adapters")
    g.add_argument("--log_every", type=int, default=1)
    rewards.add_reward_args(parser)


def resolve_device(flag: str) -> str:
    if flag == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return flag


def guidance_of(model, args) -> float:
    """The CFG scale of the run from --guidance_scale (Boogu-Image) / --true_cfg_scale (Qwen-Image)."""
    return model.resolve_guidance(args.guidance_scale, args.true_cfg_scale)


def rollout_request(rows: Sequence[Any], *, n: int, first_row: int, seed: int, step: int, num_inference_steps: int,
                    height: int, width: int, family: str, scale: float, **algo: Any):
    """The rollout request for this rank's prompts: each prompt repeated n times (interleaved, a group per prompt),
    per-sample seeds `rollout.row_seed(seed, step, global row)` with global rows numbered from `first_row`."""
    import rollout

    prompts, negatives, images = [], [], []
    edit = any(row.images for row in rows)
    for row in rows:
        for _ in range(n):
            prompts.append(row.prompt)
            negatives.append(row.negative_prompt)
            images.append(row.images[0] if row.images else None)
    guided = scale > 1.0
    if guided and any(neg is None for neg in negatives):
        raise ValueError("guidance is on but a prompt has no negative prompt (the dataset loader should have refused it)")
    knob = {"guidance_scale": scale} if family == "boogu_image" else {"true_cfg_scale": scale}
    return rollout.RolloutRequest(
        prompts=prompts, negative_prompts=negatives if guided else None, images=images if edit else None,
        seeds=[rollout.row_seed(seed, step, first_row + i) for i in range(len(prompts))],
        num_inference_steps=num_inference_steps, height=height, width=width, **knob, **algo)


def score_samples(scorer, images: torch.Tensor, rows: Sequence[Any], n: int):
    """Rewards (B,) for this rank's samples (prompt-major, n per prompt), chosen by each row's data_source."""
    gts = [row.ground_truth for row in rows for _ in range(n)]
    sources = [row.data_source for row in rows for _ in range(n)]
    infos = [row.extra_info for row in rows for _ in range(n)]
    return scorer.score_batch(images, gts, sources, infos)


def global_advantages(scored, n: int, *, global_std: bool, norm_by_std: bool,
                      num_steps: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """Group advantages over the GLOBAL batch (every rank's rewards; a group never spans ranks) plus the
    `critic/*` metrics (reward extras included, NaN where a reward did not score a sample); returns this rank's
    slice of the advantages. Collective."""
    all_rewards = all_gather_cat(scored.rewards.float())
    group_ids = [i // n for i in range(all_rewards.shape[0])]
    advantages = losses.group_advantages(all_rewards, group_ids, global_std=global_std, norm_by_std=norm_by_std,
                                         num_steps=num_steps)
    extras = {key: all_gather_cat(values.float()).tolist() for key, values in sorted(scored.extras.items())}
    metrics = reward_metrics(all_rewards, group_ids, advantages, extras=extras)
    start = get_rank() * scored.rewards.shape[0]
    return advantages[start:start + scored.rewards.shape[0]], metrics


def sync_rollout_adapter(rollout_client, transformer, adapter: str, lora_config, root: str, version: int,
                         expected_modules: int, *, engine_names: bool, keep: int = 2) -> dict[str, float]:
    """Publish `adapter` (the rollout policy: "old" for DiffusionNFT, "default" for DPPO/GRPO) to the rollout
    workers: every rank gathers the full tensors, rank 0 writes a versioned PEFT directory atomically, every node's
    workers load it, and the bound-module count must equal the actor's number of LoRA modules (a dropped sync would
    otherwise leave the rollout sampling an old policy while the run looks healthy). Collective."""
    timings: dict[str, float] = {}
    with timer("update_weights", timings):
        state = adapter_state_dict(transformer, adapter, all_ranks=False)  # only rank 0 writes
        path = os.path.join(root, f"v{version:08d}")
        if is_main_process():  # an atomic write: workers never see a half-written version
            save_adapter_dir(state, lora_config, path, engine_names=engine_names)
            for old in sorted(d for d in os.listdir(root) if d.startswith("v"))[:-keep]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        barrier()
        counts = rollout_client.load_adapter(path, f"v{version}")
    bad = [c for c in counts if c != expected_modules]
    if bad:
        raise RuntimeError(
            f"the rollout workers bound {counts} LoRA modules of adapter {path}, the actor has {expected_modules}: the "
            "weight sync is incomplete (name translation or target_modules mismatch); refusing to continue")
    return {**timings, "rollout/bound_modules": float(counts[0]) if counts else 0.0}


def parse_lora_init(value: str) -> bool | str:
    """--lora_init_weights: 'gaussian' (verl-omni's default) or 'true'/'false' (peft's kaiming / zero A)."""
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return value


def load_flow_model(path: str, args, device: torch.device):
    """The trainer's model wrapper: the transformer only (fp32 master weights; FSDP2 casts to --precision for
    compute). Prompt embeddings, reference latents and images come from the rollout workers, so trainer ranks skip
    the text encoder and the VAE (`models.base.NotLoaded`)."""
    from models import load_model, model_family

    kwargs = {"max_sequence_length": args.max_sequence_length} if model_family(path) == "qwen_image" else {}
    # Loaded on the CPU: `prepare_transformer`'s fully_shard moves one block at a time to `device` and shards it,
    # so no GPU ever holds the whole fp32 transformer (Qwen-Image: ~80 GB). The wrapper's inputs go to `device`.
    model = load_model(path, device="cpu", dtype=torch.float32, cfg_batch=args.cfg_batch, transformer_only=True,
                       **kwargs)
    model.device = torch.device(device)
    return model


def check_batch_sizes(train_batch_size: int, mini_batch_prompts: int, n: int, micro_batch_size: int,
                      world: int) -> None:
    """verl-omni batching: prompts x n per step, mini-batches in prompts, micro-batches in samples per GPU."""
    if train_batch_size % world or mini_batch_prompts % world:
        raise ValueError(f"train_batch_size ({train_batch_size}) and ppo_mini_batch_size ({mini_batch_prompts}) "
                         f"must be divisible by the {world} trainer ranks")
    if train_batch_size % mini_batch_prompts:
        raise ValueError(f"ppo_mini_batch_size ({mini_batch_prompts}) must divide train_batch_size ({train_batch_size})")
    if (mini_batch_prompts // world) * n % micro_batch_size:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must divide the per-rank mini-batch of "
                         f"{(mini_batch_prompts // world) * n} samples (ppo_mini_batch_size / world x rollout_n)")


def resume_path(resume: str, ckpt_root: str) -> str | None:
    """--resume: 'auto' -> the latest complete checkpoint (None if there is none), 'never' -> None, else a path."""
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(ckpt_root)
    if not os.path.isdir(resume):
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    return resume


def validate(model, rollout_client, scorer, dataset, args, step: int, scale: float, logger) -> dict[str, float]:
    """Validation on the test split: ODE (noise 0), --val_num_inference_steps, seeds from --val_seed, one sample
    per prompt; logs `val-core/<data_source>/reward/mean@1` (+ val-aux extras) and an image grid. Collective."""
    world, rank = get_world_size(), get_rank()
    total = len(dataset) if not args.val_max_samples else min(len(dataset), args.val_max_samples)
    per_rank = total // world
    if per_rank == 0:
        raise ValueError(f"validation needs at least {world} prompts (one per rank), the test split has {total}")
    rows = [dataset[i] for i in range(rank * per_rank, (rank + 1) * per_rank)]
    timings: dict[str, float] = {}
    with timer("testing", timings):
        request = rollout_request(rows, n=1, first_row=rank * per_rank, seed=args.val_seed, step=1,
                                  num_inference_steps=args.val_num_inference_steps, height=args.height,
                                  width=args.width, family=model.family, scale=scale, noise_level=0.0)
        result = rollout_client.generate(request)
        scored = score_samples(scorer, result.images, rows, 1)
    local = {"reward": scored.rewards.tolist()}
    for key, values in scored.extras.items():
        local[key] = values.tolist()
    gathered: list[Any] = [None] * world
    payload = (local, [row.data_source for row in rows])
    if dist.is_initialized() and world > 1:
        dist.all_gather_object(gathered, payload)
    else:
        gathered = [payload]
    sources = [s for _, ds in gathered for s in ds]
    keys = sorted({k for scores, _ in gathered for k in scores})
    scores = {k: [v for sc, ds in gathered for v in sc.get(k, [float("nan")] * len(ds))] for k in keys}
    metrics = validation_metrics(sources, {k: v for k, v in scores.items()})
    metrics = {k: v for k, v in metrics.items() if v == v}  # extras absent for a data source give NaN: drop them
    metrics.update(timings)
    if rank == 0:
        logger.log_scalars(metrics, step)
        k = min(args.num_val_images, len(rows))
        user_text = lambda row: next((m["content"] for m in row.prompt if m.get("role") == "user"), "")  # noqa: E731
        captions = [f"r={float(r):.3f} | {user_text(row)[:100]}" for row, r in zip(rows[:k], scored.rewards[:k])]
        logger.log_image("val/samples", image_grid(result.images[:k], captions), step)
        core = {key: v for key, v in metrics.items() if key.startswith("val-core/")}
        print(f"validation @ step {step}: " + ", ".join(f"{key} {v:.4f}" for key, v in core.items()), flush=True)
    return metrics
