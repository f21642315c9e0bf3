"""Layer 6 of the rollout code: the rollout worker process (`python rollout.py --worker ...`, started by
`rollout.RolloutGroup`) and the model-free environment probe (`python rollout.py --probe`, run by
`check_rollout_python`): engine construction, the request loop, and the launch environment of both.

Imports torch, `models/` and the lower layers of `engines/` (contract, layout, native, vllm_omni, protocol, and the
leaf `profiler`); never `rollout`. `rollout.py` stays the processes' entry script (its `__main__` calls
`main` here), so the command line of a worker is unchanged.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engines.contract import ENGINES, RolloutRequest
from engines.layout import release_memory
from engines.native import NativeEngine
from engines.protocol import ChannelBroken, ProtocolError, recv_message, send_message, handshake_error, peer_info
from engines.vllm_omni import VllmOmniEngine, import_vllm_omni

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_SCRIPT = os.path.join(REPO, "rollout.py")  # what a worker / probe process runs (its __main__ calls `main`)


def build_engine(engine: str, model_path: str, **kwargs: Any):
    """The engine named `engine` ("native" or "vllm_omni")."""
    if engine == "native":
        return NativeEngine(model_path, **kwargs)
    if engine == "vllm_omni":
        return VllmOmniEngine(model_path, **kwargs)
    raise ValueError(f"unknown rollout engine {engine!r}; choose from {ENGINES}")


def _die_with_parent(parent_pid: int = 0) -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (no orphans even if the trainer is
    SIGKILLed); elsewhere the worker still exits on EOF of its stdin. `parent_pid`: the pid of the trainer that
    started this worker; if it died before the signal was armed (this process was already re-parented), exit now."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)  # the trainer is gone: nobody will ever read this worker


def _private_stdout():
    """The channel: a private copy of fd 1, with fd 1 itself (and sys.stdout) pointed at stderr, so nothing a
    library prints, from Python or C, or from a child process it starts, can corrupt the message stream."""
    channel = os.fdopen(os.dup(1), "wb")  # os.dup's fd is not inherited by child processes
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


PROBE_MARKER = "FLOWRL_ROLLOUT_PROBE "


def _import_engine(engine: str) -> None:
    """Import everything the engine's worker needs (ImportError / RuntimeError naming the package otherwise)."""
    if engine == "native":
        import diffusers  # noqa: F401
        import peft  # noqa: F401
        import safetensors.torch  # noqa: F401
        import transformers  # noqa: F401

        import importlib

        import models.lora  # noqa: F401
        from models import FAMILIES

        for _, module, _ in FAMILIES.values():  # every family's wrapper (what NativeEngine's model loading imports)
            importlib.import_module(module)
    elif engine == "vllm_omni":
        import_vllm_omni()
        from vllm.lora.request import LoRARequest  # noqa: F401

        import engines.vllm_omni_pipelines  # noqa: F401  (the RL pipelines the engine loads by dotted path)
    else:
        raise ValueError(f"unknown rollout engine {engine!r}; choose from {ENGINES}")


def probe_main(engine: str) -> None:
    """`python rollout.py --probe --engine E`: import what engine E needs in THIS interpreter, then print one line
    `PROBE_MARKER + json(peer_info())` on the real stdout. An import failure exits non-zero with its traceback
    on stderr. Loads no model."""
    channel = _private_stdout()
    _import_engine(engine)
    channel.write((PROBE_MARKER + json.dumps(dict(peer_info(), engine=engine)) + "\n").encode())
    channel.flush()


class RolloutEnvError(RuntimeError):
    """--rollout_python cannot run the rollout workers (raised before any model is loaded)."""


def worker_process_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker / probe process: ours plus `extra`, with this repository first on PYTHONPATH."""
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def check_rollout_python(python: str | None, engine: str, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """The --rollout_python start-up check (model-free; run it before any model is loaded).

    Runs `python rollout.py --probe --engine <engine>`: the interpreter must exist and run, import this
    repository's rollout module and the engine's libraries (native: torch, diffusers, transformers, peft and
    `models/`; vllm_omni: vllm-omni, vLLM and `engines.vllm_omni_pipelines`), and speak our protocol version.
    Returns its `peer_info()` (python / torch / diffusers / transformers / peft / vllm / vllm-omni versions, the
    resolved interpreter) for run_metadata.json; raises `RolloutEnvError` naming --rollout_python and the fix otherwise.
    `python=None` means this interpreter: the native engine's imports are then checked in this process (the
    trainer imports the same packages anyway); vllm_omni is always probed in a subprocess."""
    if engine not in ENGINES:
        raise ValueError(f"unknown rollout engine {engine!r}; choose from {ENGINES}")
    if engine == "native" and python in (None, sys.executable):
        try:
            _import_engine(engine)
        except ImportError as e:
            raise RolloutEnvError(f"--rollout_python (this interpreter, {sys.executable}) cannot import the native "
                                  f"rollout engine: {e}; pip install -r requirements.txt") from e
        return dict(peer_info(), engine=engine)
    flag = f"--rollout_python {python}" if python else f"--rollout_python (default: this interpreter, {sys.executable})"
    path = python or sys.executable
    resolved = path if os.sep in path else shutil.which(path)
    fix = (f"pass the bin/python of an environment that has the {engine} engine's packages "
           + ("(pip install -r requirements.txt)" if engine == "native" else
              "(vllm-omni 0.30 + vLLM 0.30 + diffusers 0.40 + transformers<5.15 + peft; README: two environments)")
           + ", or leave the flag out to use the trainer's own interpreter")
    if not resolved or not os.path.isfile(resolved):
        raise RolloutEnvError(f"{flag}: no such file{'' if os.sep in path else ' on PATH'}; {fix}")
    if not os.access(resolved, os.X_OK):
        raise RolloutEnvError(f"{flag}: {resolved} is not executable; {fix}")
    command = [resolved, ENTRY_SCRIPT, "--probe", "--engine", engine]
    try:
        proc = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s,
                              env=worker_process_env())
    except subprocess.TimeoutExpired:
        raise RolloutEnvError(f"{flag}: importing the {engine} engine took over {timeout_s:.0f} s; {fix}") from None
    except OSError as e:  # e.g. not a program (exec format error), permission denied
        raise RolloutEnvError(f"{flag}: {resolved} could not be run ({e}); {fix}") from None
    lines = proc.stdout.decode(errors="replace").splitlines()
    found = [line[len(PROBE_MARKER):] for line in lines if line.startswith(PROBE_MARKER)]
    if proc.returncode != 0 or not found:
        tail = "\n".join(proc.stderr.decode(errors="replace").strip().splitlines()[-12:]) or "<no output>"
        raise RolloutEnvError(f"{flag} cannot run the {engine} rollout engine: `{' '.join(command)}` exited "
                              f"{proc.returncode}. Its stderr ends:\n{tail}\n{fix}")
    info = json.loads(found[-1])
    problem = handshake_error(peer_info(), dict(info, op="hello"), peer=f"the interpreter of {flag}")
    if problem:
        raise RolloutEnvError(problem)
    return info


@dataclass
class WorkerProcess:
    """The trainer's handle on one started rollout worker process (`rollout.RolloutGroup` holds one per device)."""
    index: int
    devices: str
    process: subprocess.Popen
    log_path: str                 # its stderr
    ipc_index: int | None = None  # this worker's cuda index of the trainer GPU that shares adapter tensors with it

    def stderr_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "<no log>"


def worker_command(python: str | None, *, engine: str, model_path: str, device: str, dtype: str, max_batch_size: int,
                   threads: int, attention_backend: str, cfg_batch: bool, compile_blocks: bool, profile_generate: int,
                   profile_path: str) -> list[str]:
    """The command line of one rollout worker process (`worker_main` parses it), as `RolloutGroup` starts it."""
    return ([python or sys.executable, ENTRY_SCRIPT, "--worker", "--engine", engine, "--model-path", model_path,
             "--device", device, "--dtype", dtype, "--max-batch-size", str(max_batch_size), "--threads", str(threads),
             "--attention-backend", attention_backend, "--parent-pid", str(os.getpid())]
            + (["--cfg-batch"] if cfg_batch else []) + (["--compile-blocks"] if compile_blocks else [])
            + (["--profile-generate", str(profile_generate), "--profile-path", profile_path]
               if profile_generate > 0 else []))


def worker_main(argv: Sequence[str] | None = None) -> None:
    """Entry point of one rollout worker process (`python rollout.py --worker ...`)."""
    parser = argparse.ArgumentParser(description="rollout worker (started by RolloutGroup)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--engine", default="native", choices=ENGINES)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--cfg-batch", action="store_true",
                        help="run CFG as one transformer forward over [cond ; uncond] instead of two")
    parser.add_argument("--attention-backend", default="auto", help="SDPA backend (models.base.attention_backend)")
    parser.add_argument("--compile-blocks", action="store_true",
                        help="native engine: torch.compile each transformer block (models.base.compile_blocks)")
    parser.add_argument("--profile-generate", type=int, default=0,
                        help="record a torch.profiler trace of the N-th generate request (0 = off)")
    parser.add_argument("--profile-path", default="", help="where that trace goes (gzipped Chrome JSON)")
    parser.add_argument("--parent-pid", type=int, default=0, help="the trainer's pid (exit if it is already gone)")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    # a terminal Ctrl-C (same process group) or a scheduler's SIGTERM must not kill the worker before the trainer
    # has finished its step: the parent closes it (stdin EOF, then SIGKILL; PDEATHSIG if the parent dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the trainer saves, then closes the worker
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    channel_in, channel_out = sys.stdin.buffer, _private_stdout()
    ours = peer_info()
    send_message(channel_out, {"op": "hello", **ours})  # before any heavy import: a mismatch is refused within seconds
    try:
        problem = handshake_error(ours, recv_message(channel_in), peer="the trainer")
    except EOFError:
        return
    except ProtocolError as e:
        problem = f"the trainer's handshake was refused: {e}"
    if problem:
        send_message(channel_out, {"ok": False, "error": f"ProtocolError: {problem}", "traceback": ""})
        return
    try:
        engine = build_engine(args.engine, args.model_path, device=args.device, dtype=getattr(torch, args.dtype),
                              max_batch_size=args.max_batch_size, cfg_batch=args.cfg_batch,
                              **({"compile_blocks": True} if args.compile_blocks and args.engine == "native" else {}))
        send_message(channel_out, {"ok": True, "ready": True})
    except Exception as e:  # report the load failure to the parent, then exit
        send_message(channel_out, {"ok": False, "error": f"{type(e).__name__}: {e}",
                                   "traceback": traceback.format_exc()})
        return
    from models.base import attention_backend

    profiler = None
    if args.profile_generate > 0:
        from engines.profiler import step_profiler

        profiler = step_profiler(args.profile_path, step=args.profile_generate, first_step=1,
                                 cuda=args.device.startswith("cuda"))
        profiler.start()
    with attention_backend(args.attention_backend):
        _serve(engine, channel_in, channel_out, args.device, profiler)


def _serve(engine: Any, channel_in, channel_out, device: str, profiler: Any) -> None:
    """The worker's request loop (until the trainer closes the channel); `profiler` (or None) is stepped after
    every generate request."""
    while True:
        try:
            message = recv_message(channel_in)
        except (EOFError, ChannelBroken):
            return
        except ProtocolError as e:  # the frame was consumed: refuse it and stay in step
            send_message(channel_out, {"ok": False, "error": f"ProtocolError: {e}", "traceback": ""})
            continue
        op = message.get("op") if type(message) is dict else None
        try:
            if op == "generate":  # streamed: one message per finished chunk, then "done" (or an error, which ends it)
                with torch.profiler.record_function("timing_s/gen"):
                    for start, part in engine.generate_chunks(RolloutRequest.from_dict(message["request"])):
                        send_message(channel_out, {"ok": True, "chunk": {"start": start, "result": part.to_dict()}})
                if profiler is not None:
                    profiler.step()
                reply = {"ok": True, "done": True, "memory": release_memory(device)}
            elif op == "load_adapter":
                reply = {"ok": True, "bound_modules": engine.load_adapter(message["path"], message["version"])}
            elif op == "load_adapter_tensors":
                if not hasattr(engine, "load_adapter_tensors"):
                    raise RuntimeError(f"the {engine.name} engine reads adapters from PEFT directories only; use "
                                       "--rollout_sync disk")
                reply = {"ok": True, "bound_modules": engine.load_adapter_tensors(message)}
                release_memory(device)
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        try:
            send_message(channel_out, reply)
        except ProtocolError as e:  # refused before a byte was written: report it instead of the reply
            send_message(channel_out, {"ok": False, "error": f"ProtocolError: the worker's reply to {op!r}: {e}",
                                "traceback": ""})


def main(argv: Sequence[str] | None = None) -> None:
    """The entry of `python rollout.py --worker ...` (`worker_main`) and `python rollout.py --probe --engine E`
    (`probe_main`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--worker" in argv:
        worker_main(argv)
    elif "--probe" in argv:
        probe = argparse.ArgumentParser(description="rollout environment probe (see check_rollout_python)")
        probe.add_argument("--probe", action="store_true")
        probe.add_argument("--engine", default="native")
        probe_main(probe.parse_args(argv).engine)
    else:
        sys.exit("rollout.py is started by the trainers' RolloutGroup (python rollout.py --worker ...) or its "
                 "start-up check (python rollout.py --probe --engine native|vllm_omni)")
