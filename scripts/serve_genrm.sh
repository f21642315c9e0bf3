#!/usr/bin/env bash
# Start an OpenAI-compatible GenRM server (vLLM) for the OCR reward and wait until it answers.
#
#   scripts/serve_genrm.sh [--model Qwen/Qwen3-VL-8B-Instruct] [--port 8000] [--gpus 7] [--tp 1]
#                          [--timeout 900] [--log genrm.log] [-- EXTRA VLLM ARGS]
#
# Runs `vllm serve` in the background on the GPUs given by --gpus (CUDA_VISIBLE_DEVICES), then polls
# http://127.0.0.1:PORT/health and /v1/models until both answer. Prints the server PID and exits 0 once healthy;
# exits 1 (printing the log tail) if the server dies or is not healthy within --timeout seconds. Point the trainer
# at it with --ocr_backend http --genrm_url http://HOST:PORT --genrm_model <the --model value>.
# Stop it with: kill <PID>.
set -euo pipefail

MODEL="Qwen/Qwen3-VL-8B-Instruct"
PORT=8000
GPUS="${CUDA_VISIBLE_DEVICES:-0}"
TP=1
TIMEOUT=900
LOG="genrm_server.log"
VLLM="${VLLM_BIN:-vllm}"
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --tp) TP="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --log) LOG="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "serve_genrm.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

if ! command -v "$VLLM" >/dev/null 2>&1; then
  echo "serve_genrm.sh: '$VLLM' not found; install vLLM (pip install vllm) or use --ocr_backend local/rapidocr" >&2
  exit 1
fi

# One image per request; the transcription prompt plus an image fits easily in 8k tokens.
CUDA_VISIBLE_DEVICES="$GPUS" nohup "$VLLM" serve "$MODEL" --host 0.0.0.0 --port "$PORT" \
  --tensor-parallel-size "$TP" --max-model-len 8192 --limit-mm-per-prompt '{"image": 1}' \
  ${EXTRA[@]+"${EXTRA[@]}"} >"$LOG" 2>&1 &
PID=$!
echo "serve_genrm.sh: started $VLLM serve $MODEL on port $PORT (GPUs $GPUS), pid $PID, log $LOG"

deadline=$(( $(date +%s) + TIMEOUT ))
probe() {
  python3 - "$1" <<'PY'
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(sys.argv[1], timeout=5) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}
while true; do
  if ! kill -0 "$PID" 2>/dev/null; then
    echo "serve_genrm.sh: the server exited before becoming healthy; last log lines:" >&2
    tail -n 40 "$LOG" >&2 || true
    exit 1
  fi
  if probe "http://127.0.0.1:$PORT/health" && probe "http://127.0.0.1:$PORT/v1/models"; then
    echo "serve_genrm.sh: healthy at http://127.0.0.1:$PORT (pid $PID)"
    echo "$PID"
    exit 0
  fi
  if [[ $(date +%s) -ge $deadline ]]; then
    echo "serve_genrm.sh: not healthy after ${TIMEOUT}s; stopping pid $PID; last log lines:" >&2
    tail -n 40 "$LOG" >&2 || true
    kill "$PID" 2>/dev/null || true
    exit 1
  fi
  sleep 2
done
