#!/usr/bin/env bash
# Boogu-Image-0.1-Base, DiffusionNFT, OCR scored by the Qwen3-VL-8B-Instruct GenRM. One node, 4 GPUs:
#   cuda:0,1,2  trainer ranks (torchrun, FSDP2 + LoRA), each also running a native rollout worker on its own GPU
#               (--rollout_devices colocated: no GPU idles while the others train)       NPROC=3
#   cuda:3      GenRM server (vllm serve)                                                GENRM_GPUS=3
# The judge keeps its own GPU: an 8B VLM with its KV cache next to a trainer rank and a rollout worker would leave
# less than the 15% memory headroom, and it scores while the next chunk samples.
# The vllm-omni rollout keeps the reserved layout: ROLLOUT_ENGINE=vllm_omni (NPROC=2, ROLLOUT_DEVICES=cuda:2, the
# seed's micro-batch 12); any of NPROC / ROLLOUT_DEVICES / MICRO_BATCH can be set explicitly.
# Recipe: the seed's rebalanced objective mix_beta=0.1, ref_kl_coef=10, adv_clip_max=1.0 (clip_ratio is inert for
# DiffusionNFT), guidance 4.0, lr 1e-4 (verl-omni's Boogu DiffusionNFT recipe, specs/algorithms.md §8.3). Guidance 4
# also in the training forwards (--train_cfg rollout, the default: the verl-omni Boogu NFT adapter applies text CFG to
# the policy / old / reference forwards); --train_cfg off is DiffusionNFT's CFG-free design and halves the update's
# transformer passes, but has no learning comparison yet (docs/PERFORMANCE.md). Activation checkpointing of every
# block: without it a micro-batch of 6 guided samples needs > 136 GiB (issue 10). Frozen base weights in bf16
# (--base_weights_dtype compute, the default). Batch: the seed's 24 prompts x 16, mini 12 (2 optimizer steps per
# rollout step); with 3 ranks a rank's mini-batch is 12/3 x 16 = 64 samples, so micro 8 (the seed's 12 needs 2 ranks).
# Data: python data_prep/boogu_image_ocr.py --input_dir ~/data/ocr --output_dir ~/data/ocr/boogu_image
# Extra flags go to train_nft.py: bash scripts/run_boogu_image_ocr_lora.sh --total_training_steps 100
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_PATH=${MODEL_PATH:-Boogu/Boogu-Image-0.1-Base}
REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-Qwen/Qwen3-VL-8B-Instruct}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/ocr/boogu_image/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/ocr/boogu_image/test.parquet}
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-native}
if [ "$ROLLOUT_ENGINE" = native ]; then
  NPROC=${NPROC:-3}; ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-colocated}; MICRO_BATCH=${MICRO_BATCH:-8}
else
  NPROC=${NPROC:-2}; ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-cuda:2}; MICRO_BATCH=${MICRO_BATCH:-12}
fi
GENRM_GPUS=${GENRM_GPUS:-3}
GENRM_PORT=${GENRM_PORT:-8000}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/boogu_image_ocr_nft_lora}
mkdir -p "$OUTPUT_DIR"

GENRM_PID=$(bash scripts/serve_genrm.sh --model "$REWARD_MODEL_PATH" --port "$GENRM_PORT" --gpus "$GENRM_GPUS" \
  --log "$OUTPUT_DIR/genrm_server.log" | tail -n 1)
trap 'kill "$GENRM_PID" 2>/dev/null || true' EXIT

# torchrun SIGKILLs the ranks this long after forwarding a SIGTERM / SIGINT (its default: 30 s). The last finished
# step is written at once on the signal; this leaves the step in progress time to finish and save too. torch
# 2.14's torchrun reads it as the default of its --shutdown-timeout.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}
torchrun --nproc_per_node="$NPROC" train_nft.py \
  --model_path "$MODEL_PATH" --train_files "$TRAIN_FILES" --val_files "$VAL_FILES" \
  --rollout_engine "$ROLLOUT_ENGINE" --rollout_devices "$ROLLOUT_DEVICES" --activation_checkpointing \
  --train_batch_size 24 --rollout_n 16 --ppo_mini_batch_size 12 --micro_batch_size "$MICRO_BATCH" \
  --lr 1e-4 --weight_decay 1e-4 --lora_rank 64 --lora_alpha 128 \
  --height 512 --width 512 --num_inference_steps 10 --val_num_inference_steps 40 --max_sequence_length 256 \
  --guidance_scale 4.0 --train_cfg rollout \
  --mix_beta 0.1 --ref_kl_coef 10.0 --adv_clip_max 1.0 --timestep_fraction 1.0 --adv_mode continuous \
  --old_policy_decay_schedule delayed_linear_to_0_999 --old_policy_update_interval 2 \
  --ocr_backend http --genrm_url "http://127.0.0.1:$GENRM_PORT" --genrm_model "$REWARD_MODEL_PATH" \
  --genrm_temperature 0.7 --genrm_top_p 0.8 \
  --total_training_steps 30 --test_freq 5 --save_freq 20 --val_max_samples 256 \
  --output_dir "$OUTPUT_DIR" "$@"
