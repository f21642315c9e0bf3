#!/usr/bin/env bash
# Boogu-Image-0.1-Edit (TI2I), DiffusionNFT, PickScore on the edit instruction. One node, 4 GPUs:
#   cuda:0-3  trainer ranks (torchrun, FSDP2 + LoRA; PickScore runs in each trainer process), each also running a
#             native rollout worker on its GPU (--rollout_devices colocated; edit requests carry the reference)
#             NPROC_PER_NODE=4
# The vllm-omni rollout keeps the reserved layout: ROLLOUT_ENGINE=vllm_omni (NPROC_PER_NODE=3, ROLLOUT_DEVICES=cuda:3).
# Scale: NPROC_PER_NODE trainer GPUs per node, NNODES nodes (run this script on every node with its NODE_RANK,
# MASTER_ADDR = node 0, MASTER_PORT), TORCHRUN_ARGS for torchrun itself; the global batch is PROMPTS_PER_GPU x
# trainer GPUs (TRAIN_BATCH / MINI_BATCH set it directly). See scripts/launch.sh and scripts/recipe_lib.sh.
# Recipe: the T2I recipe's objective (guidance 4.0 in rollout and training forwards, --train_cfg rollout; see
# run_boogu_image_ocr_lora.sh), activation checkpointing of every block (edit sequences carry the reference tokens
# too), frozen base weights in bf16. Batch: 6 prompts x 16 per GPU (24 on 4 GPUs), mini 3 per GPU (48 samples per
# rank and mini-batch), micro 8; the vllm-omni layout keeps 24 / 12 on 3 GPUs (8 / 4 per GPU).
# No reward server: PickScore (open_clip ViT-H-14 with the PickScore_v1 weights) is local.
# Data: python data_prep/boogu_image_edit_ocr.py --input_dir ~/data/ocr_edit \
#         --output_dir ~/data/ocr/boogu_image_edit_pickscore --image_size 512 --reward pickscore
#   (or synthesize one: python data_prep/make_text_edit_data.py --output_dir ~/data/ocr_edit ...)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_PATH=${MODEL_PATH:-Boogu/Boogu-Image-0.1-Edit}
REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-yuvalkirstain/PickScore_v1}
PICKSCORE_PROCESSOR_PATH=${PICKSCORE_PROCESSOR_PATH:-laion/CLIP-ViT-H-14-laion2B-s32B-b79K}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/ocr/boogu_image_edit_pickscore/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/ocr/boogu_image_edit_pickscore/test.parquet}
source scripts/recipe_lib.sh
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-native}
if [ "$ROLLOUT_ENGINE" = native ]; then
  export NPROC_PER_NODE=${NPROC_PER_NODE:-4}; ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-colocated}
  PROMPTS_PER_GPU=${PROMPTS_PER_GPU:-6}; MINI_PROMPTS_PER_GPU=${MINI_PROMPTS_PER_GPU:-3}
else
  export NPROC_PER_NODE=${NPROC_PER_NODE:-3}; ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-cuda:3}
  PROMPTS_PER_GPU=${PROMPTS_PER_GPU:-8}; MINI_PROMPTS_PER_GPU=${MINI_PROMPTS_PER_GPU:-4}
fi
TRAIN_BATCH=$(flowrl_global_batch TRAIN_BATCH "$PROMPTS_PER_GPU" "${TRAIN_BATCH:-}")
MINI_BATCH=$(flowrl_global_batch MINI_BATCH "$MINI_PROMPTS_PER_GPU" "${MINI_BATCH:-}")
MICRO_BATCH=${MICRO_BATCH:-8}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/boogu_image_edit_nft_lora}
flowrl_require_files TRAIN_FILES="$TRAIN_FILES" VAL_FILES="$VAL_FILES"
# resolved before torchrun, so that a failed download stops the script (set -e does not see a $(...) inside arguments)
PICKSCORE=$(flowrl_resolve_model REWARD_MODEL_PATH "$REWARD_MODEL_PATH")
PICKSCORE_PROCESSOR=$(flowrl_resolve_model PICKSCORE_PROCESSOR_PATH "$PICKSCORE_PROCESSOR_PATH")

bash scripts/launch.sh train_nft.py \
  --model_path "$MODEL_PATH" --train_files "$TRAIN_FILES" --val_files "$VAL_FILES" \
  --rollout_engine "$ROLLOUT_ENGINE" --rollout_devices "$ROLLOUT_DEVICES" --activation_checkpointing \
  --train_batch_size "$TRAIN_BATCH" --rollout_n 16 --ppo_mini_batch_size "$MINI_BATCH" --micro_batch_size "$MICRO_BATCH" \
  --lr 1e-4 --weight_decay 1e-4 --lora_rank 64 --lora_alpha 128 \
  --height 512 --width 512 --num_inference_steps 10 --val_num_inference_steps 40 --max_sequence_length 512 \
  --guidance_scale 4.0 --train_cfg rollout \
  --mix_beta 0.1 --ref_kl_coef 10.0 --adv_clip_max 1.0 --timestep_fraction 1.0 --adv_mode continuous \
  --old_policy_decay_schedule delayed_linear_to_0_999 --old_policy_update_interval 2 \
  --pickscore_path "$PICKSCORE" --pickscore_processor_path "$PICKSCORE_PROCESSOR" \
  --total_training_steps 30 --test_freq 5 --save_freq 20 --val_max_samples 256 \
  --output_dir "$OUTPUT_DIR" "$@"
