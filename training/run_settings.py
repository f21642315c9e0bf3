"""A trainer run's settings as the defaults of the after-training scripts (`--run_dir`): read from the run's newest
complete checkpoint (its trainer_state.json, which the checkpoint's sha256 manifest covers), with
`<run_dir>/run_metadata.json` a convenience that must agree, and the flags given on the command line winning over
both."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Iterable, Mapping, Sequence

from .checkpoint import MARKER, CheckpointError, complete_steps, read_trainer_state, step_dir, verify_checkpoint

__all__ = ["verified_run_config", "run_settings", "explicit_flags", "set_defaults_from_checkpoint",
           "read_run_config", "CFG_FLAGS"]


def verified_run_config(ckpt: str) -> dict[str, Any]:
    """The config checkpoint `ckpt` was written with (its trainer_state.json's fingerprinted and logged values:
    every flag of the run), after checking the manifest (sizes of every file, sha256 of trainer_state.json). {} for
    a checkpoint that records none. Raises CheckpointError naming the checkpoint."""
    verify_checkpoint(ckpt, only="trainer_state.json", contents=False)
    state = read_trainer_state(ckpt)
    return {**state.get("logged_config", {}), **state.get("fingerprinted_config", {})}


CFG_FLAGS = ("guidance_scale", "true_cfg_scale")  # the flags that set the resolved "cfg_scale" of a run


def read_run_config(run_dir: str) -> dict[str, Any]:
    """The trainer flags a run was started with: `<run_dir>/run_metadata.json` ["config"] (`write_run_metadata`)."""
    path = os.path.join(run_dir, "run_metadata.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: --run_dir must be a trainer's --output_dir (it holds "
                                "run_metadata.json)")
    with open(path, encoding="utf-8") as f:
        return dict(json.load(f)["config"])


def run_settings(run_dir: str, mapping: Mapping[str, str],
                 explicit: Iterable[str] = ()) -> tuple[dict[str, Any], str]:
    """({dest: value}, the line saying where they come from): the settings of the trainer run `run_dir` for the
    flags `mapping` names ({dest: run config key}), taken from its newest complete checkpoint (`verified_run_config`:
    the trainer_state.json its COMPLETE manifest covers). `<run_dir>/run_metadata.json` is a convenience that must
    agree: a key it records otherwise (an edit, another run) is a ValueError naming both values and both files,
    unless its flag is in `explicit` (given on the command line: that value is used, the recorded ones are not).
    Without a checkpoint that records settings, they come from run_metadata.json and the line says they are not
    verified. Model-free; raises ValueError / CheckpointError / FileNotFoundError naming the file and the fix."""
    meta_path = os.path.join(run_dir, "run_metadata.json")
    ckpt_root = os.path.join(run_dir, "checkpoints")
    steps = complete_steps(ckpt_root)  # the newest complete one (find_latest's warning and refusal are a resume's)
    ckpt = step_dir(ckpt_root, steps[-1]) if steps else None
    verified = verified_run_config(ckpt) if ckpt else {}
    if not verified:
        reason = (f"checkpoint {ckpt} records no settings" if ckpt else
                  f"{run_dir}/checkpoints holds no complete checkpoint to check them against")
        metadata = read_run_config(run_dir)
        return ({dest: metadata[key] for dest, key in mapping.items() if key in metadata},
                f"settings: from {meta_path}, not verified ({reason})")
    metadata = read_run_config(run_dir) if os.path.isfile(meta_path) else {}
    skip = set(explicit)
    differ = {dest: key for dest, key in mapping.items()
              if dest not in skip and key in verified and key in metadata and metadata[key] != verified[key]}
    if differ:
        diffs = [f"{key}: {metadata[key]!r} in run_metadata.json, {verified[key]!r} in the checkpoint"
                 for key in differ.values()]
        flags = ", ".join("/".join(f"--{f}" for f in CFG_FLAGS) if dest == "run_cfg_scale" else f"--{dest}"
                          for dest in differ)
        raise ValueError(
            f"--run_dir {run_dir}: {meta_path} disagrees with the settings its checkpoint {ckpt} was written with "
            f"(trainer_state.json, verified by its {MARKER} manifest): {'; '.join(diffs)}; the checkpoint's are what "
            f"the run used: restore run_metadata.json, or choose the values yourself with {flags}")
    settings = {dest: verified[key] if key in verified else metadata[key] for dest, key in mapping.items()
                if key in verified or key in metadata}
    agrees = f"; {meta_path} is missing" if not metadata else "; run_metadata.json agrees" + (
        " (flags given on the command line win over both)" if skip & set(mapping) else "")
    return settings, f"settings: from {ckpt}/trainer_state.json (verified by its {MARKER} manifest){agrees}"


def explicit_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None, dests: Iterable[str]) -> set[str]:
    """Which of `dests` the command line `argv` gives explicitly (argparse leaves a value already in the namespace
    alone unless the flag is given, abbreviations and `--flag=value` included). "run_cfg_scale" counts as given
    with either CFG flag (`CFG_FLAGS`)."""
    unset = object()
    known, _ = parser.parse_known_args(argv, argparse.Namespace(**{d: unset for d in dests}))
    given = {d for d in dests if getattr(known, d, unset) is not unset}
    if given & set(CFG_FLAGS):
        given.add("run_cfg_scale")
    return given


def set_defaults_from_checkpoint(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                                 mapping: Mapping[str, str]) -> str | None:
    """With `--run_dir DIR` among argv, make the run's settings (`run_settings`: its newest checkpoint's, verified;
    run_metadata.json must agree) the parser's defaults for the flags `mapping` names ({dest: run config key});
    flags given explicitly still win. Returns the line saying where the settings come from (None without
    --run_dir), for rank 0 to print; a refusal is `parser.error` (one line). The parser must define --run_dir."""
    known, _ = parser.parse_known_args(argv)
    if not known.run_dir:
        return None
    try:
        settings, line = run_settings(known.run_dir, mapping, explicit_flags(parser, argv, mapping))
    except (ValueError, OSError, CheckpointError) as e:
        parser.error(str(e))
    parser.set_defaults(**settings)
    return line
