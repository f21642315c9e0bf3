# Sourced by the recipes (scripts/run_*.sh): global batch sizes from per-GPU ones, and the judge replicas.
#
# Batch: a recipe sets PROMPTS_PER_GPU (prompts each trainer GPU rolls out per step) and MINI_PROMPTS_PER_GPU
# (prompts per optimizer step and GPU); the global --train_batch_size / --ppo_mini_batch_size are these times
# NPROC_PER_NODE x NNODES. TRAIN_BATCH / MINI_BATCH set the global sizes directly; one the GPUs do not divide stops
# the recipe with a value that works.
#
# Dry run: DRY_RUN=1 bash scripts/run_....sh prints the resolved layout (the judge replicas it would start, the
# torchrun line with the global batch sizes) and starts nothing.
#
# Judge (OCR recipes): GENRM_URLS="http://host:port,..." uses running servers; otherwise the recipe starts one vLLM
# server per GENRM_TP GPUs of GENRM_GPUS on this node (GENRM_GPUS=4,5,6,7 GENRM_TP=2: two replicas on ports
# GENRM_PORT and GENRM_PORT+1), and the trainer spreads its requests over them (--genrm_url, round-robin, a failing
# replica retried on another). On several nodes each node starts its own replicas and scores with them.

if [ -n "${NPROC:-}" ]; then  # the recipes' earlier name for it: refuse rather than silently ignore it
  echo "recipe: NPROC is now NPROC_PER_NODE (trainer GPUs per node): set NPROC_PER_NODE=$NPROC instead" >&2
  exit 2
fi

# flowrl_world: trainer processes in the run
flowrl_world() {
  echo $(( ${NPROC_PER_NODE:-1} * ${NNODES:-1} ))
}

# flowrl_global_batch NAME PER_GPU [GLOBAL]: GLOBAL when given (checked: a multiple of the world size), else
# PER_GPU x the world size. NAME names the variable in the message.
flowrl_global_batch() {
  local name=$1 per_gpu=$2 global=${3:-} world
  world=$(flowrl_world)
  if [ -z "$global" ]; then
    echo $(( per_gpu * world ))
    return 0
  fi
  if ! [[ "$global" =~ ^[0-9]+$ ]] || [ "$global" -lt 1 ]; then
    echo "recipe: $name=$global is not a positive whole number" >&2
    return 2
  fi
  if (( global % world )); then
    local low=$(( global / world * world )) high=$(( (global / world + 1) * world ))
    [ "$low" -gt 0 ] || low=$high
    echo "recipe: $name=$global is not divisible by the $world trainer GPUs (NPROC_PER_NODE=${NPROC_PER_NODE:-1} x NNODES=${NNODES:-1}): use $name=$low or $name=$high" >&2
    return 2
  fi
  echo "$global"
}

# flowrl_require_files NAME=PATH ...: stop with one line naming the variable when a data file is missing (checked
# before any judge starts: starting one takes minutes)
flowrl_require_files() {
  local pair name path
  for pair in "$@"; do
    name=${pair%%=*}
    path=${pair#*=}
    if [ ! -f "$path" ]; then
      echo "recipe: $name=$path does not exist: write the data first (the data_prep/ command in this recipe's header) or set $name to your file" >&2
      return 2
    fi
  done
}

# flowrl_resolve_model NAME PATH: the local folder of PATH (a folder as is; a Hub id fetched, or found in the Hub
# cache with HF_HUB_OFFLINE=1); one line naming NAME and the fix when it cannot be had
flowrl_resolve_model() {
  python3 - "$1" "$2" <<'PY'
import sys

from models import resolve_model_path

name, path = sys.argv[1], sys.argv[2]
try:
    print(resolve_model_path(path))
except (FileNotFoundError, ValueError) as e:
    reason = str(e).split(" (")[0] if "Hugging Face Hub" in str(e) else str(e)
    sys.exit(f"recipe: {name}={path}: {reason}; download it (huggingface-cli download {path}) on a machine that "
             f"is online and set {name} to the local folder")
PY
}

# flowrl_start_judges MODEL LOG_PREFIX: start the judge replicas on this node (unless GENRM_URLS is set) and set
# GENRM_URL (comma-separated URLs for --genrm_url) and GENRM_PIDS (stopped by flowrl_stop_judges).
flowrl_start_judges() {
  local model=$1 log_prefix=$2 gpus tp port k=0 pid
  GENRM_PIDS=()
  if [ -n "${GENRM_URLS:-}" ]; then
    GENRM_URL=$GENRM_URLS
    return 0
  fi
  if [ "${DRY_RUN:-0}" != 1 ] && ! command -v "${VLLM_BIN:-vllm}" >/dev/null 2>&1; then
    echo "recipe: '${VLLM_BIN:-vllm}' is not installed to serve the OCR judge on this node: pip install vllm, or point the recipe at judge servers that run elsewhere with GENRM_URLS=http://HOST:PORT[,http://HOST2:PORT]" >&2
    return 2
  fi
  IFS=, read -r -a gpus <<< "${GENRM_GPUS:-3}"
  tp=${GENRM_TP:-1}
  port=${GENRM_PORT:-8000}
  if ! [[ "$tp" =~ ^[0-9]+$ ]] || [ "$tp" -lt 1 ] || (( ${#gpus[@]} % tp )); then
    echo "recipe: GENRM_TP=$tp must divide the ${#gpus[@]} judge GPUs of GENRM_GPUS=${GENRM_GPUS:-3}" >&2
    return 2
  fi
  GENRM_URL=""
  while [ $(( k * tp )) -lt ${#gpus[@]} ]; do
    local group
    group=$(IFS=,; echo "${gpus[*]:$(( k * tp )):$tp}")
    if [ "${DRY_RUN:-0}" = 1 ]; then
      echo "recipe: dry run: would start judge replica $k ($model) on GPUs $group, port $(( port + k ))"
    else
      pid=$(bash scripts/serve_genrm.sh --model "$model" --port $(( port + k )) --gpus "$group" --tp "$tp" \
        --log "${log_prefix}_$k.log" | tail -n 1)
      GENRM_PIDS+=("$pid")
    fi
    GENRM_URL="${GENRM_URL:+$GENRM_URL,}http://127.0.0.1:$(( port + k ))"
    k=$(( k + 1 ))
  done
}

flowrl_stop_judges() {
  local pid
  for pid in ${GENRM_PIDS[@]+"${GENRM_PIDS[@]}"}; do
    kill "$pid" 2>/dev/null || true
  done
}
