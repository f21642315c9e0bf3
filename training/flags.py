"""The trainers' shared command line and its model-free checks: `add_common_args` (every flag both trainers take),
the device, the batch arithmetic (`check_batch_sizes`), --lora_init_weights, --rollout_policy_lag, and the one
resolution of the run's CFG scale (`resolve_cfg_scale`)."""

from __future__ import annotations

import os

import torch

from engines.contract import ENGINES
from models import SAMPLING_DEFAULTS, sampling_defaults
from models.base import ATTENTION_BACKENDS, COMPILE_MODES

from .adapters import adapter_arg
from .distributed import get_local_world_size
from .model import FSDP_MODES
from .optim import LR_SCHEDULES

__all__ = ["add_common_args", "set_defaults_from_model_folder", "resolve_device", "resolve_cfg_scale", "run_dir_cfg_scale", "check_batch_sizes", "adam_betas",
           "parse_lora_init", "check_rollout_lag"]


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
    g.add_argument("--attention_backend", default="auto", choices=sorted(ATTENTION_BACKENDS),
                   help="SDPA kernel of the trainer's and the rollout workers' attention (torch.nn.attention."
                        "sdpa_kernel): 'auto' = torch's choice (unchanged), or only flash / cudnn / efficient / math "
                        "(an input that backend cannot take raises instead of falling back)")
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
    g.add_argument("--init_adapter", type=adapter_arg, default=None,
                   help="start 'default' from this LoRA (PEFT folder, or CHECKPOINT:default|old) instead of B = 0; "
                        "its rank/alpha/modules must equal the run's (DiffusionNFT's 'old' starts as a copy)")
    g.add_argument("--lr", "--learning_rate", type=float, default=1e-6,
                   help="AdamW peak learning rate (see --lr_scheduler)")
    g.add_argument("--lr_scheduler", default="constant", choices=LR_SCHEDULES,
                   help="lr after the warm-up: constant (verl-omni's default), or linear / cosine decay to "
                        "--min_lr_ratio x lr at --total_training_steps")
    g.add_argument("--lr_warmup_steps", type=int, default=0,
                   help="linear warm-up from 0 over this many steps (step 1 runs at lr 0, as in verl)")
    g.add_argument("--min_lr_ratio", type=float, default=0.0, help="floor of the linear / cosine decay (x lr)")
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--adam_betas", default="0.9,0.999", help="AdamW 'beta1,beta2', each in [0, 1)")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="grad-norm clip; a non-finite norm skips the step")
    g.add_argument("--old_from_update", default="on", choices=["on", "off"],
                   help="'on' = where the update's first mini-batch needs the old policy's outputs and the old "
                        "weights are the ones being trained (Flow-DPPO: always, the step's recomputed old "
                        "log-probs; DiffusionNFT: when the `old` adapter equals the policy), take them from the "
                        "update's own forward (detached) instead of a separate forward: one forward less per sample, the "
                        "same numbers (bit for bit in eager runs; compiled blocks round DiffusionNFT's old velocity "
                        "by bf16 ulps differently); 'off' = always a separate pass (the old path)")
    g.add_argument("--activation_checkpointing", action="store_true", help="recompute block activations in backward")
    g.add_argument("--activation_checkpointing_blocks", type=int, default=None,
                   help="selective checkpointing: checkpoint only N of the transformer's blocks, evenly spaced "
                        "(implies --activation_checkpointing; default: all blocks when it is set)")
    g.add_argument("--base_weights_dtype", default="compute", choices=["compute", "fp32"],
                   help="storage of the frozen base weights on trainer ranks: 'compute' = the --precision compute "
                        "dtype (bf16 on GPU: same numbers, half the memory), 'fp32' = an fp32 copy re-cast every "
                        "forward (the old path, for benchmarks); LoRA weights, grads and AdamW state stay fp32")
    g.add_argument("--fsdp", default="auto", choices=FSDP_MODES,
                   help="'auto' = FSDP2 (fully_shard per block) when the trainer has several ranks; with ONE rank the "
                        "transformer stays whole on its GPU with the same bf16 / fp32-gradient numbers and none of "
                        "FSDP2's per-forward parameter copies (FSDP2 copies every tensor at every unshard even when "
                        "it has nothing to shard); 'always' = FSDP2 at any size (the old path)")
    g.add_argument("--compile", default="off", choices=COMPILE_MODES,
                   help="'blocks' = regional torch.compile of the transformer blocks (the family's "
                        "blocks_to_compile) in the trainer and in the native rollout engine: fewer, fused kernels; the first steps pay the "
                        "compile (each block class once per variant); bf16 results differ from eager by rounding; "
                        "a vllm-omni engine compiles by its own settings. 'off' = eager")
    g = parser.add_argument_group("rollout")
    g.add_argument("--rollout_engine", default="native", choices=ENGINES)
    g.add_argument("--rollout_devices", default="cuda:3",
                   help="rollout workers of EACH node: 'colocated' = one worker per trainer GPU, on that GPU (every "
                        "GPU trains and samples; native engine), or reserved devices, comma-separated: e.g. 'cuda:3' "
                        "(4-GPU node: 3 trainer GPUs), 'cuda:2,cuda:3', or 'cpu,cpu' for CPU runs (cuda:k = the "
                        "trainer's cuda:k, i.e. within its CUDA_VISIBLE_DEVICES)")
    g.add_argument("--rollout_sync", default="auto", choices=["auto", "tensors", "disk"],
                   help="adapter sync to the rollout workers: 'tensors' = in memory from a trainer rank of the same "
                        "node (CUDA IPC, or a memory file on CPU), 'disk' = a versioned PEFT directory; auto = "
                        "tensors for the native engine, disk for vllm-omni")
    g.add_argument("--no_reward_overlap", dest="reward_overlap", action="store_false",
                   help="score the rewards on each rank after the whole rollout, instead of on the node's driver as "
                        "each chunk finishes while the next chunk samples (same rewards either way)")
    g.add_argument("--rollout_dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--rollout_max_batch_size", type=int, default=16, help="samples per rollout forward")
    g.add_argument("--rollout_timeout_s", type=float, default=3600.0, help="a rollout worker silent longer fails")
    g.add_argument("--rollout_startup_timeout_s", type=float, default=1800.0,
                   help="a rollout worker that has not loaded its model (and answered) after this long fails")
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
                   help="Qwen-Image true CFG (None = 4.0 for train_dppo.py, 1.0 for train_nft.py as verl-omni's "
                        "recipes; needs negative prompts when > 1)")
    g.add_argument("--seed", type=int, default=42, help="seeds rollouts (per-row streams), sampling and re-noising")
    g = parser.add_argument_group("validation, logging, checkpoints")
    g.add_argument("--val_num_inference_steps", type=int, default=50)
    g.add_argument("--val_seed", type=int, default=42)
    g.add_argument("--test_freq", type=int, default=0, help="validate every N steps (0 = only at the end)")
    g.add_argument("--val_before_train", action="store_true")
    g.add_argument("--num_val_images", type=int, default=8, help="validation samples shown in the image grid")
    g.add_argument("--rollout_image_freq", type=int, default=10,
                   help="every N training steps, rank 0's first --num_rollout_images training samples (whole groups, "
                        "one prompt per row, with their rewards and judge replies) go to TensorBoard as "
                        "rollout/samples (0 = never)")
    g.add_argument("--num_rollout_images", type=int, default=8,
                   help="training samples in the rollout/samples grid (rounded to whole groups of --rollout_n)")
    g.add_argument("--total_training_steps", type=int, default=300)
    g.add_argument("--save_freq", type=int, default=30, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep_last", type=int, default=3, help="complete checkpoints to keep")
    g.add_argument("--resume", default="auto",
                   help="'auto' = latest complete checkpoint under <output_dir>/checkpoints if any; 'never' = start at "
                        "step 0 (existing checkpoints and logs are moved to <output_dir>/previous/, not deleted); or a "
                        "checkpoint directory")
    g.add_argument("--resume_force", action="store_true",
                   help="resume even if flags that change the objective or the data order differ (warns, naming them)")
    g.add_argument("--max_consecutive_skips", type=int, default=3,
                   help="stop when this many optimizer steps in a row were skipped as non-finite (0 = never stop)")
    g.add_argument("--max_wall_time_s", type=float, default=0.0,
                   help="stop cleanly (checkpoint, exit 0) at the first step boundary after this many seconds since "
                        "start-up (0 = no limit)")
    g.add_argument("--stop_save_budget_s", type=float, default=0.0,
                   help="after SIGTERM/SIGINT/SIGHUP the run finishes its step and saves there; with a budget > 0 it skips "
                        "that save when the step ended later than this many seconds after the signal (0 = always save)")
    g.add_argument("--save_on_exit", default="last_step", choices=["last_step", "off"],
                   help="last_step: rank 0 holds the last finished step's state in host memory (one gather of the "
                        "LoRA-sized state per step) and writes it at once on SIGTERM/SIGINT/SIGHUP (within the launcher's "
                        "shutdown window, whatever the step is doing), on a fatal judge or rollout-worker error, and "
                        "when the torchrun agent dies; off: only --save_freq checkpoints and the stop at a step end")
    g.add_argument("--output_dir", default="outputs/run",
                   help="TensorBoard logs, checkpoints, adapters; one live run per folder (<output_dir>/RUN_LOCK)")
    g.add_argument("--log_every", type=int, default=1)
    g.add_argument("--logger", default="tensorboard", choices=["tensorboard", "wandb"],
                   help="'wandb' also mirrors every logged scalar, image and text to Weights & Biases (needs `pip "
                        "install wandb`; WANDB_MODE=offline logs locally under <output_dir>/wandb, `wandb sync` "
                        "uploads later); the TensorBoard files are always written")
    g.add_argument("--wandb_project", default="flow-rl", help="W&B project (--logger wandb)")
    g.add_argument("--wandb_name", default=None,
                   help="W&B run name (None = the basename of --output_dir); a resume continues the same W&B run "
                        "(its id is kept in <output_dir>/wandb_run_id.txt)")
    g.add_argument("--wandb_entity", default=None,
                   help="W&B entity, a user or team (None = the default entity of the logged-in account)")
    g.add_argument("--judge_log_freq", type=int, default=10,
                   help="every N training steps, append every judge reply of the step (verbatim, with the row, "
                        "ground truth and reward) to <output_dir>/judge_replies.jsonl; validation's are always "
                        "appended (0 = training steps never)")
    g.add_argument("--profile_step", type=int, default=0,
                   help="record a torch.profiler trace of this training step (CPU + CUDA) into "
                        "<output_dir>/profile/ (each trainer rank) and <output_dir>/rollout_logs/ (each rollout "
                        "worker's N-th generate request, N = this step - the start step: the step's rollout unless "
                        "a validation or --rollout_policy_lag 1 sent requests in between); 0 = off. "
                        "tools/bench_step.py --profile reads them")
    g.add_argument("--profile_micro_steps", type=int, default=2,
                   help="the trainer's trace of --profile_step ends after this many update micro-steps (one loss, "
                        "its backward and the next forwards each), so that a long update costs seconds of tracing, "
                        "not minutes; 0 = the whole step")
    g.add_argument("--judge_max_unusable_frac", "--judge_max_empty_frac", dest="judge_max_unusable_frac",
                   type=float, default=0.9,
                   help="stop the run, the last finished step saved, when more than this fraction of a step's OCR "
                        "judge replies are not readings: empty, over-long (cut at --genrm_max_tokens, or larger) or "
                        "refusals (a judge that does not read trains on zeros); the message names "
                        "<output_dir>/judge_replies.jsonl (1 = never stop). Applies to the generative judges "
                        "(--ocr_backend http / local); rapidocr reading no text in an illegible image is a correct "
                        "reading. (--judge_max_empty_frac is its former name)")
    g.add_argument("--collective_timeout_s", type=float, default=0.0,
                   help="timeout of the process groups (main and per node); 0 = the longest per-phase timeout "
                        "(--rollout_timeout_s, --rollout_startup_timeout_s, a judge request with its retries) + "
                        "600 s, so that a phase's error reaches every rank before a collective times out; a "
                        "validation's scoring on one rank must finish within it (a longer training rollout is "
                        "waited for in rounds of a tenth of it)")
    rewards.add_reward_args(parser)


def resolve_device(flag: str) -> str:
    if flag == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return flag


def resolve_cfg_scale(family: str, args, default: float | None = None) -> float:
    """THE resolution of a run's CFG scale, model-free: the family's own flag (--guidance_scale for Boogu-Image,
    --true_cfg_scale for Qwen-Image; the other family's flag is a ValueError), else `default` (a trainer's own
    default for the family, e.g. train_nft.py's `CFG_SCALE_DEFAULTS`), else the model's
    (`models.base.DEFAULT_CFG_SCALE`). `setup_run` stores the result as `args.cfg_scale` (in the run's config)."""
    from models import cfg_scale

    return cfg_scale(family, args.guidance_scale, args.true_cfg_scale, default=default)


def run_dir_cfg_scale(family: str, args) -> float:
    """The CFG scale of scripts/sample.py and scripts/evaluate.py: an explicit --guidance_scale / --true_cfg_scale,
    else the --run_dir run's recorded one (`args.run_cfg_scale`, its config's cfg_scale), else (no --run_dir) the
    model's default. A --run_dir run that recorded none (written by an older version) and no explicit flag is a
    ValueError naming the flag to pass, never a silent default: such a run may have sampled without CFG."""
    from models import cfg_argument

    own = cfg_argument(family)
    if args.run_dir and args.run_cfg_scale is None and getattr(args, own) is None:
        raise ValueError(f"--run_dir {args.run_dir} records no cfg_scale (written by an older version): pass --{own} "
                         f"(a train_nft.py run on Qwen-Image without --true_cfg_scale sampled at 1.0, others at 4.0)")
    return resolve_cfg_scale(family, args, args.run_cfg_scale)


def adam_betas(text: str) -> tuple[float, float]:
    """--adam_betas 'beta1,beta2' -> (beta1, beta2), each in [0, 1); ValueError naming the flag otherwise."""
    try:
        betas = tuple(float(v) for v in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"--adam_betas {text}: expected two numbers 'beta1,beta2', each in [0, 1) (e.g. 0.9,0.999)")
    return betas


def check_batch_sizes(train_batch_size: int, mini_batch_prompts: int, n: int, micro_batch_size: int,
                      world: int) -> None:
    """verl-omni batching: prompts x n per step, mini-batches in prompts, micro-batches in samples per GPU. Raises
    ValueError naming the flag and a value that would work."""
    from models.base import nearest_multiples

    for flag, value in (("train_batch_size", train_batch_size), ("ppo_mini_batch_size", mini_batch_prompts)):
        if value % world:
            lo, hi = nearest_multiples(value, world)
            raise ValueError(f"--{flag} {value} must be divisible by the {world} trainer ranks: use {lo} or {hi} "
                             f"(a multiple of {world})")
    if train_batch_size % mini_batch_prompts:
        fits = max(d for d in range(world, mini_batch_prompts + 1, world) if train_batch_size % d == 0)
        raise ValueError(f"--ppo_mini_batch_size {mini_batch_prompts} must divide --train_batch_size "
                         f"{train_batch_size}: use {fits}, or leave it unset (= --train_batch_size)")
    per_rank = (mini_batch_prompts // world) * n
    if per_rank % micro_batch_size:
        fits = max(d for d in range(1, micro_batch_size + 1) if per_rank % d == 0)
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must divide the per-rank mini-batch of {per_rank} "
                         f"samples (ppo_mini_batch_size / world x rollout_n): use --micro_batch_size {fits}")


def parse_lora_init(value: str) -> bool | str:
    """--lora_init_weights: 'gaussian' (verl-omni's default) or 'true'/'false' (peft's kaiming / zero A)."""
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return value


def check_rollout_lag(args) -> str | None:
    """Why --rollout_policy_lag 1 cannot run with these flags (None when it can): sampling step k+1 while step k
    trains needs rollout GPUs that no trainer rank uses (on a shared GPU both would run at once, in one GPU's
    memory), and no local judge that samples (its RNG fork would race the update's draws)."""
    if not getattr(args, "rollout_policy_lag", 0):
        return None
    devices = [d.strip() for d in args.rollout_devices.split(",")]
    local_world = get_local_world_size()
    import rollout

    shared = [d for d in devices if d == rollout.COLOCATED or (rollout.gpu_index(d) is not None
                                                                 and rollout.gpu_index(d) < local_world)]
    if shared and resolve_device(args.device) == "cuda":
        return (f"--rollout_policy_lag 1 needs rollout GPUs of their own: --rollout_devices {args.rollout_devices} "
                f"puts workers on trainer GPUs ({', '.join(shared)}; this node trains on "
                f"cuda:0..cuda:{local_world - 1}), where the lagged rollout would sample during the update on the same "
                "GPU; reserve rollout GPUs "
                "(e.g. --rollout_devices cuda:3 with 3 trainer ranks) or drop the lag")
    if getattr(args, "ocr_backend", None) == "local" and getattr(args, "genrm_temperature", 0.0) > 0:
        return (f"--rollout_policy_lag 1 with --ocr_backend local and --genrm_temperature {args.genrm_temperature:g}: "
                "the lagged rollout's rewards are scored during the update, and the local judge's sampling RNG "
                "would rewind the update's noise draws; use --genrm_temperature 0 (greedy), --ocr_backend http, or "
                "drop the lag")
    return None


def set_defaults_from_model_folder(parser, argv, *, steps_dest: str = "num_inference_steps",
                                   ) -> tuple[dict[str, int | float], str | None]:
    """Without --run_dir among argv: the model folder's own sampling defaults (`models.sampling_defaults`: size,
    steps, CFG) become the parser's defaults, ahead of the family's (the steps under `steps_dest`); flags given
    still win. Returns (those defaults, the line saying where they come from), ({}, None) with --run_dir or without
    the file; a bad file is `parser.error` naming it. The parser must define --run_dir and --model_path."""
    known, _ = parser.parse_known_args(argv)
    if known.run_dir:
        return {}, None
    try:
        trained = sampling_defaults(known.model_path)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if not trained:
        return {}, None
    parser.set_defaults(**{steps_dest if key == "num_inference_steps" else key: v for key, v in trained.items()})
    return trained, f"settings: the defaults of {os.path.join(known.model_path, SAMPLING_DEFAULTS)}"
