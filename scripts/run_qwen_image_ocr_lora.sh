#!/usr/bin/env bash
# Qwen-Image, Flow-DPPO, OCR scored by the Qwen3-VL-8B-Instruct GenRM. One node, 4 GPUs:
#   cuda:0,1  trainer ranks (torchrun, FSDP2 + LoRA)   NPROC=2
#   cuda:2    rollout worker (native engine, policy)   ROLLOUT_DEVICES=cuda:2
#   cuda:3    GenRM server (vllm serve)                GENRM_GPUS=3
# Recipe: verl-omni's Flow-DPPO Qwen-Image OCR LoRA run (specs/algorithms.md §8.2): kl_mask_threshold=1e-5,
# add_kl_coefficient, sde_type=sde, noise 1.2, SDE window 2 in [0,5], LoRA 64/128, lr 3e-4, true CFG 4.0.
# Flow-GRPO baseline: add `--loss flow_grpo --clip_ratio 1e-5`.
# Data: python data_prep/qwen_image_ocr.py --input_dir ~/data/ocr --output_dir ~/data/ocr/qwen_image
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen-Image}
REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-Qwen/Qwen3-VL-8B-Instruct}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/ocr/qwen_image/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/ocr/qwen_image/test.parquet}
NPROC=${NPROC:-2}
ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-cuda:2}
GENRM_GPUS=${GENRM_GPUS:-3}
GENRM_PORT=${GENRM_PORT:-8000}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/qwen_image_ocr_dppo_lora}
mkdir -p "$OUTPUT_DIR"

GENRM_PID=$(bash scripts/serve_genrm.sh --model "$REWARD_MODEL_PATH" --port "$GENRM_PORT" --gpus "$GENRM_GPUS" \
  --log "$OUTPUT_DIR/genrm_server.log" | tail -n 1)
trap 'kill "$GENRM_PID" 2>/dev/null || true' EXIT

torchrun --nproc_per_node="$NPROC" train_dppo.py \
  --model_path "$MODEL_PATH" --train_files "$TRAIN_FILES" --val_files "$VAL_FILES" \
  --rollout_devices "$ROLLOUT_DEVICES" \
  --train_batch_size 32 --rollout_n 16 --ppo_mini_batch_size 16 --micro_batch_size 16 \
  --lr 3e-4 --weight_decay 1e-4 --lora_rank 64 --lora_alpha 128 \
  --height 512 --width 512 --num_inference_steps 10 --val_num_inference_steps 50 --max_sequence_length 256 \
  --true_cfg_scale 4.0 \
  --loss flow_dppo --kl_mask_threshold 1e-5 --noise_level 1.2 --sde_type sde \
  --sde_window_size 2 --sde_window_range 0,5 \
  --ocr_backend http --genrm_url "http://127.0.0.1:$GENRM_PORT" --genrm_model "$REWARD_MODEL_PATH" \
  --genrm_temperature 0.7 --genrm_top_p 0.8 \
  --total_training_steps 300 --test_freq 30 --save_freq 30 --val_max_samples 1018 \
  --output_dir "$OUTPUT_DIR" "$@"
