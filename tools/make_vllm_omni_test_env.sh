#!/usr/bin/env bash
# Build a SEPARATE virtual environment with vllm-omni 0.30's own library stack, on CPU: vllm-omni 0.30 + vLLM 0.30
# with THEIR pinned torch 2.13.0 / torchvision 0.28.0 / transformers 5.14.1 / tokenizers 0.22.2 / accelerate 1.12.0
# (vllm-omni 0.30 needs transformers<5.15; the trainer's environment has torch 2.14.1 / transformers 5.17.0).
#
#   bash tools/make_vllm_omni_test_env.sh [VENV_DIR]      (default: <repo>/.venv-vllm-omni, git-ignored)
#   VLLM_OMNI_VENV=/some/dir bash tools/make_vllm_omni_test_env.sh
#
# Used by .ci/run for two things: (1) tests/vllm_omni_env/ runs IN this env (vllm-omni's real types, request
# building, output parsing, LoRA binding); (2) tests/test_rollout_env.py runs in the trainer's env and starts
# rollout workers with --rollout_python <VENV_DIR>/bin/python (the cross-environment protocol, a different torch on
# each side).
#
# How: vLLM 0.30's full dependency set (CUDA kernels, flashinfer, ...) cannot be installed here, so the venv is
# created with --system-site-packages and installs, all with --no-deps and pinned, (a) vllm-omni + vllm and the small
# pure-Python packages their imports need and (b) the libraries whose versions vllm-omni/vLLM pin differently from
# the trainer's requirements.txt, which then shadow the system copies inside the venv. Everything else (numpy,
# pillow, diffusers 0.40.0 = vllm-omni's pin, peft, safetensors, pytest, and the CUDA 13.0 runtime wheels that
# torch 2.13.0 links against: same cuda-toolkit 13.0.3 as torch 2.14.1) comes from the system python's
# `pip install -r requirements.txt`. torch is the CUDA build (pinned with === so a local "+cpu" build is never
# taken): torchvision 0.28.0's kernels only load beside it, and it runs on CPU. The system python is never modified.
#
# Idempotent: a stamp file holds the hash of the pinned list; when it matches and the import check passes the
# script exits at once. A stale or broken venv is deleted and rebuilt. Any failure exits non-zero.
# Afterwards: "$VENV_DIR/bin/python" -m pytest -o addopts=-ra -m vllm_omni_env tests/vllm_omni_env -q
#             ROLLOUT_PYTHON="$VENV_DIR/bin/python" python3 -m pytest -o addopts=-ra -m rollout_env -q
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-${VLLM_OMNI_VENV:-$REPO_ROOT/.venv-vllm-omni}}"
SYSTEM_PYTHON="${SYSTEM_PYTHON:-python3}"

# Pinned, all installed with --no-deps. First vLLM 0.30 / vllm-omni 0.30's own pins that differ from the system's
# (torch==2.13.0, torchvision==0.28.0, accelerate==1.12.0, transformers>=5.13,<5.15 and the tokenizers<=0.23.0 that
# transformers 5.14.1 requires). Then vllm / vllm-omni, the two wheels under test, and exactly what their import
# chains (below) need beyond what the system python already has. Versions respect vLLM 0.30's own specifiers
# where it has one (fastapi<0.137, openai>=2.25, starlette>=1.0.1); a newer fastapi pulls in opentelemetry and
# openai 3.x pulls in httpx2.
PINNED="
torch===2.13.0
torchvision==0.28.0
transformers==5.14.1
tokenizers==0.22.2
accelerate==1.12.0
vllm-omni==0.30.0
vllm==0.30.0
aenum==3.1.16
msgspec==0.23.0
cbor2==6.3.0
pyzmq==27.3.0
pybase64==1.5.1
cachetools==8.0.2
uvloop==0.23.0
prometheus_client==0.26.0
fastapi==0.136.3
starlette==1.10.0
openai==2.54.0
distro==1.9.0
openai-harmony==0.0.8
partial-json-parser==0.2.1.1.post7
aiohttp==3.14.5
multidict==7.2.1
yarl==1.25.1
propcache==0.5.4
aiohappyeyeballs==2.7.1
aiosignal==1.4.0
frozenlist==1.8.0
xgrammar==0.2.9
apache-tvm-ffi==0.1.11
llguidance==1.7.6
compressed-tensors==0.17.0
tiktoken==0.14.0
loguru==0.7.3
einops==0.8.2
prettytable==3.18.0
janus==2.0.0
"

# What must import afterwards (module:attribute). Kept in sync with tests/vllm_omni_env/test_vllm_omni_env.py.
IMPORT_CHECK='
import importlib
names = [
    ("vllm.lora.request", "LoRARequest"),
    ("vllm_omni.inputs.data", "OmniDiffusionSamplingParams"),
    ("vllm_omni.inputs.data", "OmniTextPrompt"),
    ("vllm_omni.inputs.data", "OmniCustomPrompt"),
    ("vllm_omni.outputs", "OmniRequestOutput"),
    ("vllm_omni.diffusion.data", "DiffusionOutput"),
    ("vllm_omni.diffusion.request", "OmniDiffusionRequest"),
    ("vllm_omni.diffusion.worker.request_batch", "DiffusionRequestBatch"),
    ("vllm_omni.diffusion.lora.manager", "DiffusionLoRAManager"),
    ("vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image", "QwenImagePipeline"),
    ("vllm_omni.diffusion.models.boogu_image.pipeline_boogu_image", "BooguImagePipeline"),
    ("vllm_omni.entrypoints.omni", "Omni"),
    ("vllm_omni.entrypoints.async_omni", "AsyncOmni"),
]
failed = []
for module, attr in names:
    try:
        getattr(importlib.import_module(module), attr)
    except Exception as exc:  # report every failure, not just the first
        failed.append(f"{module}.{attr}: {type(exc).__name__}: {exc}")
if failed:
    raise SystemExit("vllm-omni import check FAILED:\n  " + "\n  ".join(failed))
import os, sys
import accelerate, diffusers, peft, tokenizers, torch, torchvision, transformers
import vllm, vllm_omni
expected = {torch: "2.13.0", torchvision: "0.28.0", transformers: "5.14.1", tokenizers: "0.22.2",
            accelerate: "1.12.0", diffusers: "0.40.0", vllm: "0.30.0", vllm_omni: "0.30.0"}
wrong = [f"{m.__name__} {m.__version__} from {os.path.dirname(m.__file__)} (expected {v})"
         for m, v in expected.items() if str(m.__version__).split("+")[0] != v]
if wrong:
    raise SystemExit("vllm-omni env version check FAILED (a system copy shadows the pin?):\n  " + "\n  ".join(wrong))
print(f"vllm-omni import check OK (vllm {vllm.__version__}, vllm-omni {vllm_omni.__version__}, torch "
      f"{torch.__version__}, transformers {transformers.__version__}, diffusers {diffusers.__version__}, "
      f"python {sys.version.split()[0]})")
'

die() { echo "make_vllm_omni_test_env: ERROR: $*" >&2; exit 1; }

start_s=$SECONDS
stamp_file="$VENV_DIR/.vllm_omni_env_stamp"
stamp="$(printf '%s' "$PINNED$IMPORT_CHECK" | sha256sum | cut -d' ' -f1)"
venv_py="$VENV_DIR/bin/python"

if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" && -x "$venv_py" ]]; then
    if "$venv_py" -c "$IMPORT_CHECK"; then
        echo "make_vllm_omni_test_env: up to date at $VENV_DIR ($((SECONDS - start_s)) s)"
        exit 0
    fi
    echo "make_vllm_omni_test_env: existing venv fails the import check; rebuilding" >&2
fi

# Refuse to delete anything that does not look like a venv we made (or an empty/missing dir).
if [[ -e "$VENV_DIR" ]]; then
    if [[ -f "$VENV_DIR/pyvenv.cfg" ]] || [[ -z "$(ls -A "$VENV_DIR")" ]]; then
        rm -rf "$VENV_DIR"
    else
        die "$VENV_DIR exists and is not a virtual environment; refusing to delete it (pass another path)"
    fi
fi

"$SYSTEM_PYTHON" -c 'import torch, transformers, diffusers, peft, safetensors, numpy, PIL, pytest' \
    || die "the system python ($SYSTEM_PYTHON) lacks requirements.txt's packages (pip install -r requirements.txt)"
"$SYSTEM_PYTHON" -m venv --system-site-packages "$VENV_DIR" || die "python -m venv failed"
[[ -x "$venv_py" ]] || die "venv python missing at $venv_py"

# The machine's pip config lists file:// indexes that lack most of these names; drop pip's per-name notice
# about them (noise only) and keep every other line, checking pip's own exit status. (grep exits 1 when pip prints
# nothing, hence the `|| true`: only pip's status counts.)
# shellcheck disable=SC2086
set +o pipefail
"$venv_py" -m pip install --quiet --no-deps --disable-pip-version-check $PINNED 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
pip_status=${PIPESTATUS[0]}
set -o pipefail
[[ $pip_status -eq 0 ]] || die "pip install into $VENV_DIR failed (exit $pip_status)"

"$venv_py" -c "$IMPORT_CHECK" || die "imports fail in the fresh venv (see above)"
echo "$stamp" > "$stamp_file"
echo "make_vllm_omni_test_env: built $VENV_DIR in $((SECONDS - start_s)) s ($(du -sh "$VENV_DIR" | cut -f1))"
