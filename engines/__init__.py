"""The worker side of the rollouts, in layers; each module imports only the layers before it (never `rollout`):

1. `sampler.py`: per-row seeds, SDE windows and the RL denoising loop (`rl_denoise`), shared by every engine; the
   only rollout module the vllm-omni pipelines import.
2. `contract.py`: `RolloutRequest` / `RolloutResult`, the plain-data contract every engine answers.
3. `layout.py`: which GPU each rollout worker uses, and adapter tensors shared with the workers in memory.
4. `native.py` (diffusers/torch through `models/`) and `vllm_omni.py` (vllm-omni 0.30), the engines;
   `vllm_omni_pipelines.py`, the custom RL pipelines loaded inside vllm-omni's workers (imports only `sampler`).
5. `protocol.py`: the trainer <-> worker messages and the start-up handshake.
6. `worker.py`: the rollout worker process and the environment probe.

The trainers' side (`RolloutGroup`, `DistributedRollout`) is `rollout.py` at the repository root. This file imports
nothing, so that importing one layer loads only that layer and the ones below it.
"""
