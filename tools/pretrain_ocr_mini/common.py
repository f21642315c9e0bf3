"""Shared by the modules of the package: the repository root on sys.path (the product modules, and tools/ for
build_tiny_models), the state format and its file names, the time the package's import started."""

from __future__ import annotations

import time

T_IMPORT = time.monotonic()  # before torch and diffusers load: the first log line reports the imports' seconds

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
for _p in (str(REPO), str(REPO / "tools")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

FORMAT = "pretrain_ocr_mini/1"
STATE_FILE = "state.json"
VAE_FILE = "vae.safetensors"
TRANSFORMER_FILE = "transformer.safetensors"
LOG_FILE = "log.txt"
SHIP_VAE_FILE = "compact_bf16.safetensors"  # the shipped VAE weights, frame convs cut to their one live tap
