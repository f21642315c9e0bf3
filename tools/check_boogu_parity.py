"""Numerical parity of our `models.boogu_image_transformer.BooguImageTransformer2DModel` against the upstream
Boogu-Image implementation, on tiny random configs (fp32, CPU).

The same random state dict is loaded (strict, zero missing/unexpected keys) into both models, which then run
T2I and edit (reference-image) inputs with padded instruction masks of different lengths, per-sample timesteps
and non-square latents. Prints the max relative error (max |ours - upstream| / max |upstream|) per case and
exits non-zero when any exceeds --tol.

With `--pipeline DIR` (a Boogu pipeline directory, e.g. the tiny one from tools/build_tiny_models.py) it also
checks our `BooguImageModel` wrapper end to end against the released `BooguImagePipeline` built from the same
components: a T2I batch with the default negative "" and an edit sample, both with text CFG 4.0, a few Euler steps
from the same initial noise (and the same seeded VAE sample for the reference), compared on the decoded images.
This exercises the system-prompt rule, right padding, the VLM features, the reference image's two paths,
t = 1 - sigma, the sign, the CFG order and the schedule together.

Usage (the upstream repo is never vendored or installed; it is imported from the path you give; it needs
`einops`, e.g. `pip install --target /tmp/boogu_deps einops` and PYTHONPATH=/tmp/boogu_deps):
    PYTHONPATH=/tmp/boogu_deps python tools/check_boogu_parity.py --upstream /path/to/Boogu-Image \
        [--pipeline .cache/tiny_models/boogu_image_edit]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models.boogu_image_transformer import BooguImageTransformer2DModel  # noqa: E402

TINY_CONFIGS = {
    # GQA (2 query heads, 1 kv head), one block of each kind.
    "gqa_1x1x1": dict(patch_size=2, in_channels=4, hidden_size=48, num_layers=2, num_double_stream_layers=1,
                      num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1, multiple_of=16,
                      axes_dim_rope=(8, 8, 8), axes_lens=(96, 32, 32),
                      instruction_feature_configs=dict(instruction_feat_dim=32, reduce_type="mean",
                                                       num_instruction_feat_layers=1),
                      timestep_scale=1000.0),
    # More heads, 2 double + 2 single + 2 refiners, uneven rope axes, ffn multiplier, 16 latent channels.
    "mha_2x2x2": dict(patch_size=2, in_channels=16, hidden_size=64, num_layers=4, num_double_stream_layers=2,
                      num_refiner_layers=2, num_attention_heads=4, num_kv_heads=2, multiple_of=32,
                      ffn_dim_multiplier=0.75, axes_dim_rope=(4, 6, 6), axes_lens=(128, 32, 32),
                      instruction_feature_configs=dict(instruction_feat_dim=24, reduce_type="mean",
                                                       num_instruction_feat_layers=1),
                      timestep_scale=1000.0),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Deterministic non-degenerate weights (the released init zeroes adaLN and the output layer)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:  # norm weights
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))


def make_inputs(cfg: dict, edit: bool, seed: int):
    """Batch of 3: different instruction lengths (right-padded), per-sample t, non-square 8x12 latents.
    Edit: sample 0 one 6x8 reference, sample 1 two references (8x8, 4x6), sample 2 one 8x4 reference."""
    gen = torch.Generator().manual_seed(seed)
    c = cfg["in_channels"]
    feat = cfg["instruction_feature_configs"]["instruction_feat_dim"]
    lengths = [7, 12, 3]
    mask = torch.zeros(3, max(lengths), dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    instruction = torch.randn(3, max(lengths), feat, generator=gen)
    latents = torch.randn(3, c, 8, 12, generator=gen)
    timestep = torch.tensor([0.05, 0.5, 0.93])
    refs = None
    if edit:
        refs = [[torch.randn(c, 6, 8, generator=gen)],
                [torch.randn(c, 8, 8, generator=gen), torch.randn(c, 4, 6, generator=gen)],
                [torch.randn(c, 8, 4, generator=gen)]]
    return latents, timestep, instruction, mask, refs


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def pipeline_parity(pipeline_dir: str, seed: int) -> dict[str, float]:
    """Our wrapper's sampling loop vs the released pipeline on the same components; max rel err per case."""
    import PIL.Image
    from boogu.pipelines.boogu.pipeline_boogu import BooguImagePipeline
    from boogu.schedulers.scheduling_flow_match_euler_discrete_time_shifting import FlowMatchEulerDiscreteScheduler
    from boogu.models.transformers.transformer_boogu import BooguImageTransformer2DModel as UpstreamModel
    from transformers import Qwen3VLForConditionalGeneration

    from models.boogu_image import BooguImageModel

    ours = BooguImageModel.from_pretrained(pipeline_dir)
    with open(os.path.join(pipeline_dir, "scheduler", "scheduler_config.json")) as f:
        import json

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(json.load(f))
    pipe = BooguImagePipeline(
        transformer=UpstreamModel.from_pretrained(os.path.join(pipeline_dir, "transformer")).eval(),
        vae=ours.vae, scheduler=scheduler, processor=ours.processor,
        mllm=Qwen3VLForConditionalGeneration.from_pretrained(os.path.join(pipeline_dir, "mllm")).eval(),
    )
    steps, scale = 6, 4.0

    def our_images(prompts, height, width, noise, refs=None, images=None):
        prompt = ours.encode_prompt(prompts, images)
        negative = ours.encode_prompt([""] * len(prompts))  # text-only default negative
        sigmas = ours.schedule(steps, height, width)
        x = noise.clone()
        for i in range(steps):
            v = ours.guided_velocity(x, sigmas[i].expand(len(prompts)), prompt, negative, scale, ref_latents=refs)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        with torch.no_grad():
            decoded = ours.vae.decode(x / ours.scaling_factor + ours.shift_factor, return_dict=False)[0]
        return (decoded / 2 + 0.5).clamp(0, 1)

    def upstream_images(**kwargs):
        with torch.no_grad():
            return pipe(num_inference_steps=steps, text_guidance_scale=scale, output_type="pt", device="cpu",
                        return_dict=False, **kwargs)

    errs = {}
    gen = torch.Generator().manual_seed(seed)
    prompts = ["a red cat", 'A neon sign that reads "OPEN ALL NIGHT" above a rainy street, 35mm photo']
    noise = torch.randn(2, 16, 8, 12, generator=gen)
    ref = upstream_images(instruction=prompts, height=64, width=96, latents=noise.clone())
    errs["pipeline_t2i"] = rel_err(our_images(prompts, 64, 96, noise), ref)

    rng = torch.Generator().manual_seed(seed + 1)
    image = PIL.Image.fromarray((torch.rand(80, 112, 3, generator=rng) * 255).to(torch.uint8).numpy())
    h, w = 80, 112  # multiples of 16 under every cap: the VAE copy keeps this size (align_res output size)
    vae_seed = seed + 2
    refs = ours.encode_reference([image], [torch.Generator().manual_seed(vae_seed)])

    def seeded_encode_vae(img):  # upstream samples the VAE posterior without a generator; seed it identically
        z = ours.vae.encode(img.to(ours.vae.dtype)).latent_dist.sample(generator=torch.Generator().manual_seed(vae_seed))
        return ((z - ours.vae.config.shift_factor) * ours.vae.config.scaling_factor).to(ours.vae.dtype)

    pipe.encode_vae = seeded_encode_vae
    noise = torch.randn(1, 16, h // 8, w // 8, generator=gen)
    ref = upstream_images(instruction=["make the sky green"], input_images=[[image]], height=h, width=w,
                          latents=noise.clone())
    errs["pipeline_edit"] = rel_err(our_images(["make the sky green"], h, w, noise, refs, [image]), ref)
    return errs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="path to a Boogu-Image checkout (contains boogu/)")
    parser.add_argument("--tol", type=float, default=1e-5, help="max allowed relative error")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipeline", default=None,
                        help="also compare our BooguImageModel sampling loop with the released pipeline on this "
                             "Boogu pipeline directory (e.g. the tiny one)")
    parser.add_argument("--pipeline-tol", type=float, default=1e-4,
                        help="max allowed relative error of the decoded images in the pipeline check")
    args = parser.parse_args()

    if not os.path.isdir(os.path.join(args.upstream, "boogu")):
        raise SystemExit(f"--upstream {args.upstream!r} has no boogu/ package")
    # Upstream picks flash-attn / triton kernels when its `device` env var contains "cuda"; pin its SDPA path.
    os.environ["device"] = "cpu"
    sys.path.insert(0, os.path.abspath(args.upstream))
    warnings.filterwarnings("ignore")
    from boogu.models.transformers.rope import BooguImageRotaryPosEmbed
    from boogu.models.transformers.transformer_boogu import BooguImageTransformer2DModel as UpstreamModel

    # The released configuration, built on the meta device: identical key sets and shapes.
    released = dict(TINY_CONFIGS["gqa_1x1x1"], in_channels=16, hidden_size=3360, num_layers=40,
                    num_double_stream_layers=8, num_refiner_layers=2, num_attention_heads=28, num_kv_heads=7,
                    multiple_of=256, axes_dim_rope=(40, 40, 40), axes_lens=(2048, 1664, 1664),
                    instruction_feature_configs=dict(instruction_feat_dim=4096, reduce_type="mean",
                                                     num_instruction_feat_layers=1))
    with torch.device("meta"):
        ours_shapes = {k: tuple(v.shape) for k, v in BooguImageTransformer2DModel(**released).state_dict().items()}
        up_shapes = {k: tuple(v.shape) for k, v in UpstreamModel(**released).state_dict().items()}
    if ours_shapes != up_shapes:
        print(f"released config: state-dict mismatch ({len(set(ours_shapes) ^ set(up_shapes))} key differences)")
        return 1
    print(f"released config: {len(ours_shapes)} tensors, {sum(math.prod(s) for s in ours_shapes.values()) / 1e9:.4f}B "
          "parameters, identical names and shapes")

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    worst = 0.0
    for cfg_name, cfg in TINY_CONFIGS.items():
        ours = BooguImageTransformer2DModel(**cfg).eval()
        randomize_(ours, args.seed)
        upstream = UpstreamModel(**cfg).eval()
        missing, unexpected = upstream.load_state_dict(ours.state_dict(), strict=False)
        if missing or unexpected:
            print(f"[{cfg_name}] state-dict mismatch: missing={missing} unexpected={unexpected}")
            return 1
        if dict(ours.config) | {"_use_default_values": None} != dict(upstream.config) | {"_use_default_values": None}:
            print(f"[{cfg_name}] config mismatch:\n ours={dict(ours.config)}\n upstream={dict(upstream.config)}")
            return 1
        freqs_cis = BooguImageRotaryPosEmbed.get_freqs_cis(cfg["axes_dim_rope"], cfg["axes_lens"], theta=10000)
        for case in ("t2i", "edit", "mixed"):  # mixed: sample 1 has no reference (T2I and edit in one batch)
            latents, timestep, instruction, mask, refs = make_inputs(cfg, case != "t2i", args.seed + 1)
            if case == "mixed":
                refs[1] = None
            with torch.no_grad():
                ref_out = upstream(latents, timestep, instruction, freqs_cis, mask, ref_image_hidden_states=refs)
                our_out = ours(latents, timestep, instruction, instruction_attention_mask=mask,
                               ref_image_hidden_states=refs)
                our_tab = ours(latents, timestep, instruction, freqs_cis, mask, ref_image_hidden_states=refs)
                # Variable-size list input (the released API accepts lists of (C, h, w)).
                lat_list = [latents[0], latents[1, :, :6, :10], latents[2, :, :4, :]]
                ref_list = upstream(lat_list, timestep, instruction, freqs_cis, mask, ref_image_hidden_states=refs)
                our_list = ours(lat_list, timestep, instruction, instruction_attention_mask=mask,
                                ref_image_hidden_states=refs)
            errs = {
                "tensor": rel_err(our_out, ref_out),
                "given_freqs_cis": rel_err(our_tab, ref_out),
                "list": max(rel_err(o, r) for o, r in zip(our_list, ref_list)),
            }
            worst = max(worst, *errs.values())
            print(f"[{cfg_name}] {case:5s} max rel err: " + ", ".join(f"{k}={v:.3e}" for k, v in errs.items())
                  + f"  (|upstream| max {ref_out.abs().max().item():.3f})")
    ok = worst <= args.tol
    print(f"transformer: worst max relative error {worst:.3e} -> {'PASS' if ok else 'FAIL'} (tol {args.tol:.0e})")
    if args.pipeline:
        errs = pipeline_parity(args.pipeline, args.seed)
        pipe_worst = max(errs.values())
        print("pipeline: " + ", ".join(f"{k}={v:.3e}" for k, v in errs.items()) + f" -> "
              f"{'PASS' if pipe_worst <= args.pipeline_tol else 'FAIL'} (tol {args.pipeline_tol:.0e})")
        ok = ok and pipe_worst <= args.pipeline_tol
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
