#!/usr/bin/env bash
# Boogu-Image-0.1-Base, DiffusionNFT, OCR scored by the Qwen3-VL-8B-Instruct GenRM. One node, 4 GPUs:
#   cuda:0,1,2  trainer ranks (torchrun, FSDP2 + LoRA), each also running a native rollout worker on its own GPU
#               (--rollout_devices colocated: no GPU idles while the others train)       NPROC_PER_NODE=3
#   cuda:3      GenRM server (vllm serve; GENRM_TP GPUs per replica)                     GENRM_GPUS=3
# The judge keeps its own GPU: an 8B VLM with its KV cache next to a trainer rank and a rollout worker would leave
# less than the 15% memory headroom, and it scores while the next chunk samples.
# The vllm-omni rollout keeps the reserved layout: ROLLOUT_ENGINE=vllm_omni (NPROC_PER_NODE=2,
# ROLLOUT_DEVICES=cuda:2, micro-batch 12); any of NPROC_PER_NODE / ROLLOUT_DEVICES / MICRO_BATCH can be set.
# Scale: NPROC_PER_NODE trainer GPUs per node, NNODES nodes (run this script on every node with its NODE_RANK,
# MASTER_ADDR = node 0, MASTER_PORT), TORCHRUN_ARGS for torchrun itself; the global batch is PROMPTS_PER_GPU x
# trainer GPUs (TRAIN_BATCH / MINI_BATCH set it directly). See scripts/launch.sh and scripts/recipe_lib.sh.
# Recipe: the rebalanced objective mix_beta=0.1, ref_kl_coef=10, adv_clip_max=1.0 (clip_ratio is inert for
# DiffusionNFT), guidance 4.0, lr 1e-4 (verl-omni's Boogu DiffusionNFT recipe). Guidance 4
# also in the training forwards (--train_cfg rollout, the default: the verl-omni Boogu NFT adapter applies text CFG to
# the policy / old / reference forwards); --train_cfg off is DiffusionNFT's CFG-free design and halves the update's
# transformer passes, but has no learning comparison yet (docs/lab/PERFORMANCE_LOG.md). Activation checkpointing of every
# block: without it a micro-batch of 6 guided samples needs > 136 GiB. Frozen base weights in bf16
# (--base_weights_dtype compute, the default). Batch: 8 prompts x 16 per GPU (24 on 3 GPUs), mini 4 per GPU (2
# optimizer steps per rollout step); a rank's mini-batch is 4 x 16 = 64 samples, so micro 8.
# Regional torch.compile of the double- and single-stream blocks (--compile blocks; trainer and native rollout):
# 1.37x on one H200 after ~4 minutes of compilation in the first step (docs/lab/PERFORMANCE_LOG.md); --compile off skips it.
# Data: python data_prep/ocr.py --model boogu_image --input_dir ~/data/ocr --output_dir ~/data/ocr/boogu_image
# Extra flags go to train_nft.py: bash scripts/run_boogu_image_ocr_lora.sh --total_training_steps 100
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_PATH=${MODEL_PATH:-Boogu/Boogu-Image-0.1-Base}
REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-Qwen/Qwen3-VL-8B-Instruct}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/ocr/boogu_image/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/ocr/boogu_image/test.parquet}
source scripts/recipe_lib.sh
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-native}
if [ "$ROLLOUT_ENGINE" = native ]; then
  export NPROC_PER_NODE=${NPROC_PER_NODE:-3}; ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-colocated}
  MICRO_BATCH=${MICRO_BATCH:-8}; PROMPTS_PER_GPU=${PROMPTS_PER_GPU:-8}; MINI_PROMPTS_PER_GPU=${MINI_PROMPTS_PER_GPU:-4}
else
  export NPROC_PER_NODE=${NPROC_PER_NODE:-2}; ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-cuda:2}
  MICRO_BATCH=${MICRO_BATCH:-12}; PROMPTS_PER_GPU=${PROMPTS_PER_GPU:-12}; MINI_PROMPTS_PER_GPU=${MINI_PROMPTS_PER_GPU:-6}
fi
TRAIN_BATCH=$(flowrl_global_batch TRAIN_BATCH "$PROMPTS_PER_GPU" "${TRAIN_BATCH:-}")
MINI_BATCH=$(flowrl_global_batch MINI_BATCH "$MINI_PROMPTS_PER_GPU" "${MINI_BATCH:-}")
OUTPUT_DIR=${OUTPUT_DIR:-outputs/boogu_image_ocr_nft_lora}
flowrl_require_files TRAIN_FILES="$TRAIN_FILES" VAL_FILES="$VAL_FILES"
[ "${DRY_RUN:-0}" = 1 ] || mkdir -p "$OUTPUT_DIR"

flowrl_start_judges "$REWARD_MODEL_PATH" "$OUTPUT_DIR/genrm_server_node${NODE_RANK:-0}"
trap flowrl_stop_judges EXIT

bash scripts/launch.sh train_nft.py \
  --model_path "$MODEL_PATH" --train_files "$TRAIN_FILES" --val_files "$VAL_FILES" \
  --rollout_engine "$ROLLOUT_ENGINE" --rollout_devices "$ROLLOUT_DEVICES" --activation_checkpointing --compile blocks \
  --train_batch_size "$TRAIN_BATCH" --rollout_n 16 --ppo_mini_batch_size "$MINI_BATCH" --micro_batch_size "$MICRO_BATCH" \
  --lr 1e-4 --weight_decay 1e-4 --lora_rank 64 --lora_alpha 128 \
  --height 512 --width 512 --num_inference_steps 10 --val_num_inference_steps 40 --max_sequence_length 256 \
  --guidance_scale 4.0 --train_cfg rollout \
  --mix_beta 0.1 --ref_kl_coef 10.0 --adv_clip_max 1.0 --timestep_fraction 1.0 --adv_mode continuous \
  --old_policy_decay_schedule delayed_linear_to_0_999 --old_policy_update_interval 2 \
  --ocr_backend http --genrm_url "$GENRM_URL" --genrm_model "$REWARD_MODEL_PATH" \
  --genrm_temperature 0.7 --genrm_top_p 0.8 \
  --total_training_steps 30 --test_freq 5 --save_freq 20 --val_max_samples 256 \
  --output_dir "$OUTPUT_DIR" "$@"
