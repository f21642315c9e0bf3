#!/usr/bin/env bash
# The CPU demo: DiffusionNFT on a tiny random-weight Qwen-Image (real layout, built on first use), our own OCR-style
# prompts, the jpeg_compressibility reward, 2 trainer ranks (torchrun, gloo, FSDP2) + 1 rollout worker process.
# A few minutes on 2 cores; the mean reward rises (critic/rewards/mean in the progress line and TensorBoard).
#   bash scripts/run_demo.sh [extra train_nft.py flags]
#   tensorboard --logdir outputs/demo/tensorboard
set -euo pipefail
cd "$(dirname "$0")/.."
export TINY_MODELS_DIR=${TINY_MODELS_DIR:-.cache/tiny_models}
OUT=${OUT:-outputs/demo}
python3 tools/build_tiny_models.py --out "$TINY_MODELS_DIR" --only qwen_image
python3 data_prep/make_demo_data.py --model qwen_image --output_dir "$OUT/data"
# torchrun SIGKILLs the ranks this long after forwarding a SIGTERM / SIGINT (its default: 30 s). The last finished
# step is written at once on the signal; this leaves the step in progress time to finish and save too. torch
# 2.14's torchrun reads it as the default of its --shutdown-timeout.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}
OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 train_nft.py \
  --model_path "$TINY_MODELS_DIR/qwen_image" --train_files "$OUT/data/train.parquet" --val_files "$OUT/data/test.parquet" \
  --device cpu --rollout_devices cpu --rollout_threads 1 \
  --height 64 --width 64 --num_inference_steps 4 --val_num_inference_steps 4 --true_cfg_scale 1.0 \
  --train_batch_size 2 --rollout_n 8 --micro_batch_size 8 --lora_rank 8 --lora_alpha 16 --lr 5e-2 \
  --mix_beta 0.1 --adv_clip_max 1.0 \
  --total_training_steps 20 --test_freq 10 --val_before_train --save_freq 10 --val_max_samples 8 \
  --resume never --output_dir "$OUT" "$@"
