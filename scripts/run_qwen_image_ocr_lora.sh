#!/usr/bin/env bash
# Qwen-Image, Flow-DPPO, OCR scored by the Qwen3-VL-8B-Instruct GenRM. One node, 4 GPUs:
#   cuda:0,1,2  trainer ranks (torchrun, FSDP2 + LoRA), each also running a native rollout worker (policy) on its
#               own GPU (--rollout_devices colocated)                    NPROC_PER_NODE=3
#   cuda:3      GenRM server (vllm serve; the judge keeps its own GPU)   GENRM_GPUS=3 (GENRM_TP GPUs per replica)
# The vllm-omni rollout keeps the reserved layout and verl-omni's exact batch: ROLLOUT_ENGINE=vllm_omni
# (NPROC_PER_NODE=2, ROLLOUT_DEVICES=cuda:2, 16 prompts per GPU = 32, mini 16).
# Scale: NPROC_PER_NODE trainer GPUs per node, NNODES nodes (run this script on every node with its NODE_RANK,
# MASTER_ADDR = node 0, MASTER_PORT), TORCHRUN_ARGS for torchrun itself; the global batch is PROMPTS_PER_GPU x
# trainer GPUs (TRAIN_BATCH / MINI_BATCH set it directly). See scripts/launch.sh and scripts/recipe_lib.sh.
# Recipe: verl-omni's Flow-DPPO Qwen-Image OCR LoRA run: kl_mask_threshold=1e-5,
# add_kl_coefficient, sde_type=sde, noise 1.2, SDE window 2 in [0,5], LoRA 64/128, lr 3e-4, true CFG 4.0 (rollout
# and replay). Old log-probs are recomputed (verl-omni's default, step-1 ratio exactly 1: the first mini-batch's in its
# own update forward, the second's in a replay pass before the update); --old_log_probs rollout is
# its bypass mode (no replay pass before the update; the rollout/trainer gap then enters the ratio, see
# rollout_corr/*). Activation checkpointing of every block (micro 16 with CFG = 32 sequences per forward); frozen
# base weights in bf16. Batch: 3 ranks need a prompt count divisible by 3, so 30 prompts x 16 and mini 15 (2
# optimizer steps per rollout step, as verl-omni's 32 / 16; each rank's mini-batch is 5 x 16 = 80 samples, micro 16).
# Regional torch.compile of the transformer blocks (--compile blocks; trainer and native rollout): 1.35x on one
# H200, after ~2-3 minutes of compilation in the first step (docs/lab/PERFORMANCE_LOG.md); pass --compile off to skip it.
# Flow-GRPO baseline: add `--loss flow_grpo --clip_ratio 1e-5`.
# Data: python data_prep/ocr.py --model qwen_image --input_dir ~/data/ocr --output_dir ~/data/ocr/qwen_image
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen-Image}
REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-Qwen/Qwen3-VL-8B-Instruct}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/ocr/qwen_image/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/ocr/qwen_image/test.parquet}
source scripts/recipe_lib.sh
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-native}
if [ "$ROLLOUT_ENGINE" = native ]; then
  export NPROC_PER_NODE=${NPROC_PER_NODE:-3}; ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-colocated}
  PROMPTS_PER_GPU=${PROMPTS_PER_GPU:-10}; MINI_PROMPTS_PER_GPU=${MINI_PROMPTS_PER_GPU:-5}
else
  export NPROC_PER_NODE=${NPROC_PER_NODE:-2}; ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-cuda:2}
  PROMPTS_PER_GPU=${PROMPTS_PER_GPU:-16}; MINI_PROMPTS_PER_GPU=${MINI_PROMPTS_PER_GPU:-8}
fi
TRAIN_BATCH=$(flowrl_global_batch TRAIN_BATCH "$PROMPTS_PER_GPU" "${TRAIN_BATCH:-}")
MINI_BATCH=$(flowrl_global_batch MINI_BATCH "$MINI_PROMPTS_PER_GPU" "${MINI_BATCH:-}")
OUTPUT_DIR=${OUTPUT_DIR:-outputs/qwen_image_ocr_dppo_lora}
flowrl_require_files TRAIN_FILES="$TRAIN_FILES" VAL_FILES="$VAL_FILES"
[ "${DRY_RUN:-0}" = 1 ] || mkdir -p "$OUTPUT_DIR"

flowrl_start_judges "$REWARD_MODEL_PATH" "$OUTPUT_DIR/genrm_server_node${NODE_RANK:-0}"
trap flowrl_stop_judges EXIT

bash scripts/launch.sh train_dppo.py \
  --model_path "$MODEL_PATH" --train_files "$TRAIN_FILES" --val_files "$VAL_FILES" \
  --rollout_engine "$ROLLOUT_ENGINE" --rollout_devices "$ROLLOUT_DEVICES" --activation_checkpointing --compile blocks \
  --train_batch_size "$TRAIN_BATCH" --rollout_n 16 --ppo_mini_batch_size "$MINI_BATCH" --micro_batch_size 16 \
  --lr 3e-4 --weight_decay 1e-4 --lora_rank 64 --lora_alpha 128 \
  --height 512 --width 512 --num_inference_steps 10 --val_num_inference_steps 50 --max_sequence_length 256 \
  --true_cfg_scale 4.0 \
  --loss flow_dppo --kl_mask_threshold 1e-5 --noise_level 1.2 --sde_type sde \
  --sde_window_size 2 --sde_window_range 0,5 \
  --ocr_backend http --genrm_url "$GENRM_URL" --genrm_model "$REWARD_MODEL_PATH" \
  --genrm_temperature 0.7 --genrm_top_p 0.8 \
  --total_training_steps 300 --test_freq 30 --save_freq 30 --val_max_samples 1018 \
  --output_dir "$OUTPUT_DIR" "$@"
