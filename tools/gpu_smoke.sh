#!/usr/bin/env bash
# GPU smoke test of the CUDA paths the CPU suite cannot reach: NCCL(+gloo) process group, FSDP2 with bf16 mixed
# precision, fused AdamW, rollout workers on their own GPU (CUDA_VISIBLE_DEVICES per worker), bf16 rollouts.
# Runs both trainers for a few steps on tiny checkpoints; needs >= 2 GPUs (trainer on cuda:0, rollout on cuda:1).
#   bash tools/gpu_smoke.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_smoke}
mkdir -p "$OUT"
export TINY_MODELS_DIR=${TINY_MODELS_DIR:-.cache/tiny_models}
python3 tools/build_tiny_models.py --out "$TINY_MODELS_DIR" --only qwen_image boogu_image_base
python3 data_prep/make_demo_data.py --model qwen_image --output_dir "$OUT/data_qwen"
python3 data_prep/make_demo_data.py --model boogu_image --output_dir "$OUT/data_boogu"
COMMON=(--device cuda --precision bf16 --rollout_devices cuda:1 --rollout_dtype bfloat16 --height 128 --width 128
        --num_inference_steps 6 --val_num_inference_steps 6 --train_batch_size 4 --rollout_n 8 --micro_batch_size 8
        --lora_rank 8 --lora_alpha 16 --lr 1e-3 --total_training_steps 3 --save_freq 3 --val_max_samples 4
        --resume never --activation_checkpointing --fsdp always)  # one trainer rank still shards (auto would not)
torchrun --nproc_per_node=1 train_dppo.py --model_path "$TINY_MODELS_DIR/qwen_image" \
  --train_files "$OUT/data_qwen/train.parquet" --val_files "$OUT/data_qwen/test.parquet" \
  --sde_window_size 2 --sde_window_range 0,4 --true_cfg_scale 4.0 "${COMMON[@]}" --output_dir "$OUT/dppo_qwen"
torchrun --nproc_per_node=1 train_nft.py --model_path "$TINY_MODELS_DIR/boogu_image_base" \
  --train_files "$OUT/data_boogu/train.parquet" --val_files "$OUT/data_boogu/test.parquet" \
  --guidance_scale 4.0 --cfg_batch "${COMMON[@]}" --output_dir "$OUT/nft_boogu"
python3 - "$OUT" <<'PY'
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
for run in ("dppo_qwen", "nft_boogu"):
    ea = EventAccumulator(f"{sys.argv[1]}/{run}/tensorboard"); ea.Reload()
    keys = ["critic/rewards/mean", "actor/grad_norm", "actor/ratio_mean", "rollout_corr/logprob_abs_diff_max",
            "actor/policy_loss", "rollout/bound_modules", "perf/time_per_step"]
    logged = {k: [e.value for e in ea.Scalars(k)] for k in keys if k in ea.Tags()["scalars"]}
    for k, v in logged.items():
        print(run, k, [round(x, 6) for x in v])
    # fail, do not just print: every run logs rewards, grad norms and a non-zero adapter sync; DPPO's first update
    # has ratio 1 and the trainer's replay reproduces the rollout's log-probs
    need = ["critic/rewards/mean", "actor/grad_norm", "rollout/bound_modules", "perf/time_per_step"]
    need += ["actor/ratio_mean", "rollout_corr/logprob_abs_diff_max"] if run == "dppo_qwen" else ["actor/policy_loss"]
    missing = [k for k in need if len(logged.get(k, [])) != 3]
    if missing:
        sys.exit(f"gpu_smoke: {run} did not log 3 steps of {missing}")
    if min(logged["rollout/bound_modules"]) <= 0:
        sys.exit(f"gpu_smoke: {run} synced an adapter that bound no module")
    if run == "dppo_qwen" and (abs(logged["actor/ratio_mean"][0] - 1) > 1e-6
                               or max(logged["rollout_corr/logprob_abs_diff_max"]) > 1e-2):
        sys.exit("gpu_smoke: DPPO step-1 ratio != 1 or the replay does not reproduce the rollout's log-probs")
print("gpu_smoke: OK")
PY
