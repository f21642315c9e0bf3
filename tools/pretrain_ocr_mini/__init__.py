"""Pretrain a small text-to-image model in the Qwen-Image on-disk layout that draws short words (docs/LEARNING.md).

The model is a trained small diffusers `AutoencoderKLQwenImage` + a small `QwenImageTransformer2DModel`, with the
frozen random text encoder and the real tokenizer exactly as `tools/build_tiny_models.py` builds them for
`qwen_image` (rebuilt deterministically, never shipped), so `models.load_model`, the native engine and both trainers
use it unchanged. Data: renders of one word each (DejaVu Sans Mono Bold, any text colour, backgrounds at least 0.4
apart in luma, solid, split or gradient) with prompts such as `A sign that says "word"`; the held-out set uses other
templates and other seeds over the same closed vocabulary.

Phases, resumable across calls (each call ends by itself inside `--time_budget_s`, so it fits a job time limit):
  vae          train the VAE on the renders (its 3D causal convs run as the equivalent 2D convs, `Fast2dConvs`)
               until the held-out reconstruction OCR reward reaches --vae_target_reward or --vae_max_s, or stop
               early as collapsed (--vae_plateau_step); then round it to bf16, measure the per-channel latent
               mean/std (written into its config) and freeze it;
  transformer  encode the renders once to packed latents (cached on the device) and train the transformer with
               flow matching through `QwenImageModel.predict_velocity` (x_s = (1-s) x0 + s eps, target eps - x0,
               timestep = sigma, the wrapper's prompt template and packing), EMA weights, bf16 autocast,
               torch.compile of the repeated blocks (--compile auto: when the call has minutes of training
               left); a held-out OCR eval (ODE sampling with the RL schedule, the
               project's rapidocr reward on a process pool, asynchronous) every --eval_every_s decides the stop:
               the first eval with mean reward in --window and >= --stop_reward ends pretraining (if an eval
               overshoots the window, the previous in-window snapshot is kept); --sweep first compares sizes;
  done         nothing left to train; --export_ship writes the checkpoint.
Every call ends with a final eval (held-out templates x --final_seeds at each --final_eval_steps, on the bf16
weights that ship) and prints the held-out reward curve against training seconds.

From the repository root, one GPU; each call writes its state into --state_dir and the next call reads it with
--resume_from:
  python3 -m tools.pretrain_ocr_mini --state_dir s1 --time_budget_s 515 --head_dim 32 --layers 4 --width 160 \
      --sweep 4x160 6x128 3x192 4x160:1e-3 --sweep_s 35           # VAE, then the size sweep
  python3 -m tools.pretrain_ocr_mini --state_dir s2 --resume_from s1 --time_budget_s 540 --head_dim 32 \
      --layers 4 --width 160 --lr 1e-3                               # the transformer, until the start point
Then, on any machine:
  python3 -m tools.pretrain_ocr_mini --state_dir s2 --export_ship assets/ocr_mini
  python3 -m tools.pretrain_ocr_mini --assemble assets/ocr_mini .cache/ocr_mini    # loadable pipeline folder
  python3 -m tools.pretrain_ocr_mini --write_datasets data/ocr_mini                # RL parquet (train/test)
CPU smoke test of the whole pipeline (a few seconds per phase, 64x64, tiny widths):
  python3 -m tools.pretrain_ocr_mini --smoke --state_dir /tmp/ocr_mini_smoke

State files (all a next call needs; <= 16 MiB each): state.json (counters, curves, configs, sha256 of the weights),
vae.safetensors (frame convs stored as their one live tap) and transformer.safetensors (bf16; the EMA weights).
Resumption reloads the bf16 weights into fp32 masters and restarts AdamW with a short warm-up: the optimizer moments
(2x fp32 of the parameters) are not kept, so the state stays small; a resumed run continues the step counter,
data stream and curves but not bit-exactly. Also written per call: log.txt, samples.png, vae_recon.png, curve.png.

Modules: common (paths, the state format), data (vocabulary, templates, seeds, renders), ocr_pool (the CPU pool:
rendering and the rapidocr reward), nets (model configs, the VAE's 2D fast path, flow matching), state (weights and
state.json on disk, the run context), vae_phase, transformer_phase (training, evals, the sweep, the final eval),
pictures (grids, curves), ship (export, assemble, the RL datasets), cli (flags, the phases of a call, main).
"""

from . import common  # noqa: F401  first: its T_IMPORT is taken before torch and diffusers load
from .cli import main

__all__ = ["main"]
