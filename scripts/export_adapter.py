#!/usr/bin/env python3
"""Export a trained LoRA adapter for the loader you use.

    python3 scripts/export_adapter.py outputs/demo/checkpoints/step_00000020:default outputs/demo/peft_default
    python3 scripts/export_adapter.py outputs/demo/checkpoints/step_00000020:old lora_vllm --format vllm_omni

The source is a PEFT adapter folder or a checkpoint folder with `:default` / `:old` (as for sample.py), read as
every tool reads an adapter (`training.verify_adapter_spec`): an adapter of a checkpoint must match the checkpoint's
COMPLETE manifest (refused without one), every tensor must be finite, and a standalone folder, which has no
checksum, is exported with one line saying it was not verified. A
checkpoint's `adapters/<name>/` folder is in diffusers' form (tensor keys `transformer.<module>...`): diffusers'
`pipe.load_lora_weights(folder)` loads it as it is, but plain PEFT does not find those keys and loads a zero
adapter (it only warns). The formats:

  peft       keys `base_model.model.<module>...`: `PeftModel.from_pretrained(pipe.transformer, folder)` (default)
  diffusers  keys `transformer.<module>...`: `pipe.load_lora_weights(folder)` (the checkpoint's own form)
  vllm_omni  diffusers' form with vllm-omni's module names (for vllm-omni's LoRA manager)

Every form keeps r, lora_alpha and the target modules, so each loader applies the same scale (alpha / r).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import lora  # noqa: E402

FORMATS = {"peft": dict(key_prefix="base_model.model.", engine_names=False),
           "diffusers": dict(key_prefix="transformer.", engine_names=False),
           "vllm_omni": dict(key_prefix="transformer.", engine_names=True)}


def export(source_dir: str, config: dict, modules: dict[str, dict], out_dir: str, fmt: str) -> int:
    """Write the adapter read from `source_dir` (`config`, `modules` as `training.verify_adapter_spec` returns
    them, any name form) as `out_dir` in format `fmt`; returns the number of LoRA modules. Refuses a source where a
    module lacks its A or B matrix."""
    tensors = {}
    for module, pair in sorted(modules.items()):
        missing = sorted({"A", "B"} - set(pair))
        if missing:
            raise ValueError(f"{source_dir}: module {module} has no lora_{missing[0]} tensor; the adapter is incomplete")
        tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = pair["A"], pair["B"]
    config = dict(config, target_modules=sorted(set(lora.from_engine_targets(config["target_modules"]))))
    lora.write_adapter_dir(tensors, config, out_dir, **FORMATS[fmt])
    return len(modules)


def main(argv=None) -> None:
    import training as T

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a PEFT adapter folder, or CHECKPOINT:default|old")
    parser.add_argument("out_dir", help="the folder to write (replaced atomically if it exists)")
    parser.add_argument("--format", default="peft", choices=sorted(FORMATS), help="default: peft")
    args = parser.parse_args(argv)
    try:
        source, config, modules = T.verify_adapter_spec(args.source)  # where it is, its manifest, finiteness
        if os.path.abspath(source) == os.path.abspath(args.out_dir):
            raise ValueError(f"{args.out_dir} is the source folder: write the export somewhere else")
        count = export(source, config, modules, args.out_dir, args.format)
    except (ValueError, OSError, T.CheckpointError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    unverified = T.unverified_adapter_line(source)
    if unverified:
        print(unverified, file=sys.stderr)
    print(f"wrote {args.out_dir} ({args.format} form, {count} LoRA modules) from {source}")


if __name__ == "__main__":
    main()
