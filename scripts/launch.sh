#!/usr/bin/env bash
# The launch line of every recipe (scripts/run_*.sh, scripts/slurm_train.sbatch): torchrun on this node for one
# node of an N-node run, from the environment.
#
#   NPROC_PER_NODE=3 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 \
#     bash scripts/launch.sh train_dppo.py --model_path ... [trainer flags]
#
#   NPROC_PER_NODE  trainer processes (GPUs) on this node            default 1
#   NNODES          nodes in the run                                 default 1
#   NODE_RANK       this node's index, 0 .. NNODES-1                 default 0
#   MASTER_ADDR     node 0's address, reachable from every node      default 127.0.0.1
#   MASTER_PORT     a free port on node 0                            default 29500
#   TORCHRUN_ARGS   more torchrun flags, e.g. "--shutdown-timeout 900 --max-restarts 0"
#   PYTHON          the interpreter that runs torchrun               default python3
#   SHUTDOWN_TIMEOUT seconds torchrun waits after forwarding a SIGTERM / SIGINT / SIGHUP before it SIGKILLs the ranks
#                   (its own default: 30 s); the last finished step is written at once on the signal, and this
#                   leaves the step in progress time to finish and save too      default 300
# Every node runs the same line with its own NODE_RANK (static rendezvous: node 0 hosts it). The line is printed
# before it runs. scripts/torchrun.py is torchrun with a failed run summed up in one line (TORCHRUN_VERBOSE=1: all of
# torchrun's own report).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "launch.sh: usage: bash scripts/launch.sh TRAINER.py [flags] (the layout comes from NPROC_PER_NODE, NNODES, ...)" >&2
  exit 2
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
for name in NPROC_PER_NODE NNODES NODE_RANK MASTER_PORT; do
  value=${!name}
  if ! [[ "$value" =~ ^[0-9]+$ ]]; then
    echo "launch.sh: $name=$value is not a whole number" >&2
    exit 2
  fi
done
if [ "$NPROC_PER_NODE" -lt 1 ] || [ "$NNODES" -lt 1 ] || [ "$NODE_RANK" -ge "$NNODES" ]; then
  echo "launch.sh: need NPROC_PER_NODE >= 1, NNODES >= 1 and 0 <= NODE_RANK < NNODES (got $NPROC_PER_NODE, $NNODES, $NODE_RANK)" >&2
  exit 2
fi
# torch 2.14's torchrun reads this as the default of its --shutdown-timeout
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}}
read -r -a extra <<< "${TORCHRUN_ARGS:-}"
command=("${PYTHON:-python3}" scripts/torchrun.py --nnodes "$NNODES" --node_rank "$NODE_RANK"
         --nproc_per_node "$NPROC_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
         ${extra[@]+"${extra[@]}"} "$@")
shown=$((12 + ${#extra[@]} + 1))  # torchrun and its flags, then the trainer script
if [ "${DRY_RUN:-0}" = 1 ]; then  # the resolved launch, nothing started
  echo "launch.sh: dry run, node $NODE_RANK of $NNODES, $NPROC_PER_NODE trainer process(es) ($(( NPROC_PER_NODE * NNODES )) in all); would run:"
  printf '%q ' "${command[@]}"
  echo
  exit 0
fi
echo "launch.sh: node $NODE_RANK of $NNODES, $NPROC_PER_NODE trainer process(es): ${command[*]:0:$shown} ..." >&2
if [ -t 0 ] || [ -t 2 ]; then  # started from a terminal: closing it (SIGHUP) stops the run, with a checkpoint
  echo "launch.sh: closing this terminal stops the run at the end of its step, with a checkpoint; to keep it running" \
       "start it under tmux / screen, or detached: setsid nohup <the command> > run.out 2>&1 &" >&2
fi
exec "${command[@]}"
