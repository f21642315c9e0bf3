#!/usr/bin/env python3
r"""Images from prompts with a base model plus a trained LoRA adapter: Boogu-Image (T2I, and Edit with reference
images) and Qwen-Image, on GPU or CPU, batched and seeded; `torchrun` spreads the prompts over GPUs.

    python3 scripts/sample.py --run_dir outputs/demo --adapter outputs/demo/checkpoints/step_00000020:old \
        --prompt 'A sign that says "OPEN"' --output_dir outputs/demo/samples
    torchrun --nproc_per_node=4 scripts/sample.py --model_path $MODEL_PATH --adapter lora_dir/ \
        --prompts prompts.txt --num_per_prompt 4 --output_dir samples/          # one prompt per line
    python3 scripts/sample.py --model_path $BOOGU_EDIT --parquet test.parquet --output_dir edits/   # rows' images
    python3 scripts/sample.py --model_path $BOOGU_EDIT --prompt 'Change the text to "SALE"' --image ref.png ...

Prompts come from --prompt (repeatable), --prompts (a text file, one per line) or --parquet (a data_prep parquet:
its chat messages, negative prompts and edit reference images are used as the trainers use them). Text prompts are
encoded by the family's released rule (plain strings) with the family's default negative (Boogu "", Qwen " ").
--adapter is a PEFT folder or a checkpoint folder with `:default` / `:old` (omit for the base model); the rollout
engine loads it and fails unless every tensor binds; it is verified first (`training.verify_adapter_spec`: an
adapter of a checkpoint, as `CKPT:NAME` or as its folder, against the checkpoint's COMPLETE manifest, refused without
one; a standalone folder has no checksum and is used with one line saying it was not verified). `--run_dir` takes
the model, size, guidance, validation steps and seed of a trainer's run as defaults: those its newest complete
checkpoint was written with (verified), with which its run_metadata.json must agree.

Sample i (global order: prompt-major, --num_per_prompt per prompt) is drawn with seed `rollout.row_seed(--seed, 1,
i)` by its own generator, the seed in-training validation gives prompt i, so results do not depend on the batch
size or the number of processes, and `--parquet <val_files>` with a run's settings reproduces its validation
images. Writes <output_dir>/<i:05d>.png, samples.jsonl (prompt, seed, file per sample) and grid.png (captioned).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import training as T  # noqa: E402
from models import size_warning  # noqa: E402

# sample.py flag -> the trainer flag of a run (--run_dir) it defaults to
RUN_DEFAULTS = {"model_path": "model_path", "height": "height", "width": "width", "guidance_scale": "guidance_scale",
                "true_cfg_scale": "true_cfg_scale", "num_inference_steps": "val_num_inference_steps",
                "seed": "val_seed", "batch_size": "rollout_max_batch_size", "cfg_batch": "cfg_batch",
                "dtype": "rollout_dtype",
                "run_cfg_scale": "cfg_scale"}  # no flag: the run's resolved CFG scale, for unset CFG flags


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=T.HelpFormatter)
    parser.add_argument("--run_dir", default=None, help="a trainer's --output_dir: its flags become the defaults")
    parser.add_argument("--model_path", default=os.environ.get("MODEL_PATH"), help="pipeline folder or Hub id")
    parser.add_argument("--adapter", type=T.adapter_arg, default=None,
                        help="LoRA: a PEFT folder, or CHECKPOINT:default|old; omit for the base model")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument("--prompts", default=None, help="text file, one prompt per line")
    parser.add_argument("--parquet", default=None, help="a data_prep parquet (messages, negatives, edit images)")
    parser.add_argument("--image", action="append", default=[],
                        help="Boogu edit reference image for the text prompts: one for all, or one per prompt")
    parser.add_argument("--negative_prompt", default=None, help="for text prompts; default: the family's")
    parser.add_argument("--num_per_prompt", type=int, default=1, help="samples per prompt (seeds differ)")
    parser.add_argument("--seed", type=int, default=42, help="base seed of rollout.row_seed(seed, 1, sample index)")
    parser.add_argument("--num_inference_steps", type=int, default=50)
    parser.add_argument("--guidance_scale", type=float, default=None,
                        help="Boogu-Image CFG (None = the --run_dir run's CFG scale, else 4.0)")
    parser.add_argument("--true_cfg_scale", type=float, default=None,
                        help="Qwen-Image true CFG (None = the --run_dir run's CFG scale, e.g. 1.0 for a train_nft.py "
                             "run, else 4.0)")
    parser.set_defaults(run_cfg_scale=None)  # set by --run_dir (RUN_DEFAULTS)
    parser.add_argument("--height", type=int, default=None, help="default: the edit reference's size, else 512")
    parser.add_argument("--width", type=int, default=None, help="default: the edit reference's size, else 512")
    parser.add_argument("--batch_size", type=int, default=16, help="samples per forward (per process)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                        help="model dtype on GPU; CPU always runs float32")
    parser.add_argument("--cfg_batch", action="store_true", help="both CFG branches in one forward")
    parser.add_argument("--num_grid_images", type=int, default=16, help="samples in grid.png (0 = no grid)")
    parser.add_argument("--output_dir", required=True)
    settings_from = T.set_defaults_from_checkpoint(parser, argv, RUN_DEFAULTS)  # the run's checkpoint, verified
    trained, folder_line = T.set_defaults_from_model_folder(parser, argv)  # without a run: the folder's own
    settings_from = settings_from or folder_line
    args = parser.parse_args(argv)
    args.settings_from = settings_from
    args.size_warning = size_warning(trained, args.height, args.width)
    if not args.model_path:
        parser.error("--model_path is required (or $MODEL_PATH, or --run_dir)")
    if sum(bool(x) for x in (args.prompt, args.prompts, args.parquet)) != 1:
        parser.error("give the prompts one way: --prompt (repeatable), --prompts FILE or --parquet FILE")
    if args.image and args.parquet:
        parser.error("--image is for text prompts; a parquet carries its own reference images")
    if args.num_per_prompt < 1:
        parser.error("--num_per_prompt must be >= 1")
    return args


def prompt_rows(args, family: str) -> list:
    """The prompts as `data_prep.dataset.PromptRow`s (what `training.rollout_request` takes): a list, or the
    `PromptDataset` itself (rows and their images decoded on access, so each process decodes only its own)."""
    from PIL import Image

    from data_prep.dataset import PromptDataset, PromptRow
    from models import family_class

    if args.parquet:
        return PromptDataset(args.parquet, guidance=False)  # negatives are checked once the scale is known
    texts = list(args.prompt)
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            texts = [line.strip() for line in f if line.strip()]
        if not texts:
            raise ValueError(f"{args.prompts}: no prompts (one per line)")
    model_class = family_class(family)
    if args.image and not model_class.supports_reference_images:
        raise ValueError(f"--image: reference images are for Boogu-Image edit, {args.model_path} is {family}")
    if len(args.image) not in (0, 1, len(texts)):
        raise ValueError(f"{len(args.image)} --image for {len(texts)} prompts: give one for all or one per prompt")
    images = [Image.open(path).convert("RGB") for path in args.image]
    # the released pipeline's default negative (what data_prep writes too) unless one is given
    negative = model_class.default_negative_prompt if args.negative_prompt is None else args.negative_prompt
    return [PromptRow(index=i, prompt=text, negative_prompt=negative,
                      images=[images[i if len(images) > 1 else 0]] if images else [], ground_truth="",
                      data_source="") for i, text in enumerate(texts)]


def main(argv=None) -> None:
    args = parse_args(argv)
    import rollout
    from data_prep.dataset import PromptDataset
    from models import model_family, resolve_model_path

    info = T.init_distributed(T.resolve_device(args.device))
    rank, world = info.rank, info.world_size
    if rank == 0 and args.settings_from:
        print(args.settings_from, flush=True)
    if rank == 0 and args.size_warning:
        print(args.size_warning, file=sys.stderr, flush=True)
    model_path = resolve_model_path(args.model_path)
    family = model_family(model_path)
    rows = prompt_rows(args, family)  # every model-free check first
    scale = T.run_dir_cfg_scale(family, args)  # an explicit flag, else the --run_dir run's, else 4.0
    if len(rows) < world:
        raise ValueError(f"{len(rows)} prompts for {world} processes: launch at most one process per prompt")
    dtype = getattr(torch, args.dtype) if info.device.type == "cuda" else torch.float32
    engine = rollout.NativeEngine(model_path, device=str(info.device), dtype=dtype, max_batch_size=args.batch_size,
                                  cfg_batch=args.cfg_batch)
    if args.parquet and scale > 1.0:
        PromptDataset(args.parquet, guidance=True)  # guided: every row needs a negative prompt (names the row)
    height, width = args.height, args.width
    if height is None or width is None:
        from models import family_class

        ref_h, ref_w = family_class(family).default_size(rows[0].images[0] if rows[0].images else None)
        height, width = height or ref_h, width or ref_w
    adapter_dir = None
    if args.adapter:
        adapter_dir = T.verify_adapter_spec(args.adapter)[0]  # again where it is read (checked at parse time too)
        bound = engine.load_adapter(adapter_dir, args.adapter)  # raises unless every tensor binds a LoRA module
        if rank == 0:
            print(f"adapter {adapter_dir}: {bound} LoRA modules bound", flush=True)
            unverified = T.unverified_adapter_line(adapter_dir)
            if unverified:
                print(unverified, flush=True)

    start, stop = rank * len(rows) // world, (rank + 1) * len(rows) // world  # this process's prompts
    mine = [rows[i] for i in range(start, stop)]
    n = args.num_per_prompt
    request = T.rollout_request(mine, n=n, first_row=start * n, seed=args.seed, step=1,
                                num_inference_steps=args.num_inference_steps, height=height, width=width,
                                cfg_scale=scale, noise_level=0.0)
    os.makedirs(args.output_dir, exist_ok=True)
    from PIL import Image

    records, leading = [], []
    for chunk in range(0, len(request), args.batch_size):  # written as they come: memory stays one batch
        result = engine.generate(request.select(range(chunk, min(chunk + args.batch_size, len(request)))))
        leading.append(result.images[: max(0, args.num_grid_images - start * n - chunk)])
        for j, image in enumerate(result.images, start=chunk):
            index = start * n + j
            name = f"{index:05d}.png"
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(os.path.join(args.output_dir, name))
            records.append({"index": index, "prompt": T.prompt_text(mine[j // n].prompt), "seed": request.seeds[j],
                            "file": name, "adapter": adapter_dir, "num_inference_steps": args.num_inference_steps,
                            "scale": scale, "height": height, "width": width})
    grid_images = T.gather_first_images(torch.cat(leading), start * n, args.num_grid_images)
    records = [r for part in T.all_gather_objects(records) for r in part]
    if rank == 0:
        with open(os.path.join(args.output_dir, "samples.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        if len(grid_images):
            captions = [f"seed {r['seed']} | {r['prompt']}" for r in records[:len(grid_images)]]  # wrapped at words
            T.image_grid(grid_images, captions).save(os.path.join(args.output_dir, "grid.png"))
        print(f"wrote {len(records)} images, samples.jsonl and grid.png to {args.output_dir}", flush=True)
    T.cleanup_distributed()


if __name__ == "__main__":
    main()
