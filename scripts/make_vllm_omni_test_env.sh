#!/usr/bin/env bash
# Build a SEPARATE virtual environment in which vllm-omni 0.30's own Python types import on CPU.
#
#   bash scripts/make_vllm_omni_test_env.sh [VENV_DIR]      (default: <repo>/.venv-vllm-omni, git-ignored)
#   VLLM_OMNI_VENV=/some/dir bash scripts/make_vllm_omni_test_env.sh
#
# Why: vllm-omni 0.30 needs vLLM 0.30 (torch 2.13 CUDA, flashinfer, ...), which cannot be installed here. Its
# dataclasses, request/output types, LoRA request and LoRA manager are plain Python, though, so the rollout
# engine's request building and output parsing can be tested against the REAL classes. The venv is created with
# --system-site-packages so it reuses the system torch / transformers / diffusers (no second torch), and
# installs vllm-omni + vllm with --no-deps plus the small pure-Python packages their imports need, all pinned.
# The system python is never modified.
#
# Idempotent: a stamp file holds the hash of the pinned list; when it matches and the import check passes the
# script exits at once. A stale or broken venv is deleted and rebuilt. Any failure exits non-zero.
# Afterwards: "$VENV_DIR/bin/python" -m pytest tests_vllm_omni -q
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-${VLLM_OMNI_VENV:-$REPO_ROOT/.venv-vllm-omni}}"
SYSTEM_PYTHON="${SYSTEM_PYTHON:-python3}"

# Pinned, all installed with --no-deps. vllm / vllm-omni are the two wheels under test; the rest is exactly what
# their import chains (below) need beyond what the system python already has. Versions respect vLLM 0.30's own
# specifiers where it has one (fastapi<0.137, openai>=2.25, starlette>=1.0.1); a newer fastapi pulls in
# opentelemetry and openai 3.x pulls in httpx2.
PINNED="
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

# What must import afterwards (module:attribute). Kept in sync with tests_vllm_omni/test_vllm_omni_env.py.
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
import vllm, vllm_omni
print(f"vllm-omni import check OK (vllm {vllm.__version__}, vllm-omni {vllm_omni.__version__})")
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

"$SYSTEM_PYTHON" -c 'import torch, transformers, diffusers' \
    || die "the system python ($SYSTEM_PYTHON) must provide torch, transformers and diffusers"
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
