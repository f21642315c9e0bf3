"""The shared model interface: prompt embeddings and the `FlowModel` base every family wrapper implements.

Conventions the trainer and the rollout engine rely on (each family wrapper hides its own):
- sigmas follow diffusers: sigma = 1 is pure noise, sigma = 0 is data, x_sigma = (1 - sigma) * x0 + sigma * eps;
- velocities are returned in the diffusers convention v = eps - x0, in float32;
- initial noise is drawn per row from that row's own generator, so a sample never depends on its batch.

Only helpers that every family needs live here; the family modules own everything model-specific.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch


@dataclass
class PromptEmbeds:
    """Encoded prompts, right-padded.

    embeds: (B, L, D) in the model dtype; padded positions hold zeros.
    mask:   (B, L) int64, 1 = valid token, 0 = padding. Never None (all-ones when nothing is padded).
    """

    embeds: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.embeds.ndim != 3:
            raise ValueError(f"PromptEmbeds.embeds must be (B, L, D), got shape {tuple(self.embeds.shape)}")
        if self.mask.ndim != 2 or tuple(self.mask.shape) != tuple(self.embeds.shape[:2]):
            raise ValueError(
                f"PromptEmbeds.mask must be (B, L) = {tuple(self.embeds.shape[:2])}, got {tuple(self.mask.shape)}"
            )
        if self.mask.dtype != torch.int64:
            self.mask = self.mask.to(torch.int64)

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def to(self, device: torch.device | str) -> "PromptEmbeds":
        return PromptEmbeds(self.embeds.to(device), self.mask.to(device))

    def index(self, rows: Sequence[int] | torch.Tensor) -> "PromptEmbeds":
        """Select rows (e.g. repeat a prompt for a group: `pe.index([0, 0, 1, 1])`)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.embeds.device)
        return PromptEmbeds(self.embeds.index_select(0, rows), self.mask.index_select(0, rows.to(self.mask.device)))

    @staticmethod
    def cat(parts: Sequence["PromptEmbeds"]) -> "PromptEmbeds":
        """Concatenate along the batch, right-padding every part to the longest sequence."""
        if not parts:
            raise ValueError("PromptEmbeds.cat needs at least one part")
        max_len = max(p.embeds.shape[1] for p in parts)
        embeds, masks = [], []
        for p in parts:
            pad = max_len - p.embeds.shape[1]
            embeds.append(torch.nn.functional.pad(p.embeds, (0, 0, 0, pad)))
            masks.append(torch.nn.functional.pad(p.mask, (0, pad)))
        return PromptEmbeds(torch.cat(embeds), torch.cat(masks))


def read_json(path: str, what: str) -> dict[str, Any]:
    """Read a JSON object from `path`; clear errors for a missing or corrupt file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: {path} does not exist (is this a complete pipeline directory?)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e}); the checkpoint is corrupt, re-download it") from e
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} must hold a JSON object, got {type(data).__name__}")
    return data


@dataclass
class Conditioning:
    """What a velocity forward needs besides latents and sigmas: the prompt embeddings, the negative ones (None
    when unguided) and the edit reference latents (None for text-to-image). Trainers take it from the rollout
    (`RolloutResult.conditioning`) and slice it per micro-batch with `index`."""

    prompt: PromptEmbeds
    negative: PromptEmbeds | None = None
    ref_latents: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> "Conditioning":
        return Conditioning(self.prompt.to(device), None if self.negative is None else self.negative.to(device),
                            None if self.ref_latents is None else self.ref_latents.to(device))

    def index(self, rows: Sequence[int] | torch.Tensor) -> "Conditioning":
        """The given rows of every part."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.prompt.embeds.device)
        ref = None if self.ref_latents is None else self.ref_latents.index_select(0, rows.to(self.ref_latents.device))
        return Conditioning(self.prompt.index(rows), None if self.negative is None else self.negative.index(rows), ref)


class NotLoaded:
    """Stands in for a pipeline component that `from_pretrained(..., transformer_only=True)` skipped.

    Trainer ranks only run the transformer (prompt embeddings, reference latents and images come from the rollout
    workers), so they skip the text encoder and the VAE: for Qwen-Image that saves the 7B Qwen2.5-VL encoder on
    every trainer GPU. `config` keeps the component's config.json (the wrapper reads e.g. the VAE's scale factors
    from it); any other use raises an error that names the component instead of failing deep inside a forward.
    """

    def __init__(self, name: str, config: dict[str, Any] | None = None) -> None:
        self._name = name
        self.config = SimpleNamespace(**(config or {}))

    def _refuse(self) -> RuntimeError:
        return RuntimeError(
            f"the {self._name} was not loaded (transformer_only=True, as on trainer ranks, which only run the "
            "transformer); encode prompts and images in a wrapper loaded without transformer_only (the rollout "
            "workers)")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise self._refuse()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()


def per_row_noise(shape: Sequence[int], generators: Sequence[torch.Generator], device: torch.device | str) -> torch.Tensor:
    """float32 standard normal noise (B, *shape); row b is drawn only from generators[b].

    Each row is drawn on its generator's device (as diffusers' `randn_tensor` does for a generator list), then moved
    to `device`, so the values never depend on the batch composition.
    """
    if len(generators) == 0:
        raise ValueError("per_row_noise needs one torch.Generator per row, got none")
    rows = []
    for g in generators:
        if not isinstance(g, torch.Generator):
            raise TypeError(f"expected torch.Generator per row, got {type(g).__name__}")
        rows.append(torch.randn(tuple(shape), generator=g, device=g.device, dtype=torch.float32).to(device))
    return torch.stack(rows)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Map decoded images in [-1, 1] (B, 3, H, W) to uint8 (B, 3, H, W) the way diffusers' postprocess does
    (x / 2 + 0.5, clamp to [0, 1], x 255, round)."""
    images = (images.float() / 2 + 0.5).clamp(0, 1)
    return (images * 255).round().to(torch.uint8)


# ---- classifier-free guidance: one scale, each family's pipeline argument (`FlowModel.cfg_argument`) -----------
DEFAULT_CFG_SCALE = 4.0  # both released pipelines' default: Boogu-Image `guidance_scale`, Qwen-Image `true_cfg_scale`


def chat_messages(system: str, user: str) -> list[dict[str, str]]:
    """A [system, user] chat-message list, as the data_prep parquet stores prompts."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def nearest_multiples(value: int, k: int) -> tuple[int, int]:
    """The multiples of `k` nearest to `value` from below and above (the lower one is never 0: then both are k)."""
    lo, hi = (value // k) * k, (value // k + 1) * k
    return (lo or hi), hi


def check_image_size(family: str, height: int, width: int, vae_factor: int, max_side: int | None = None) -> None:
    """Raise ValueError naming the fix unless height and width are positive multiples of vae_factor x 2 (the VAE
    factor times the 2x2 patch of both families' transformers), and at most `max_side` when given."""
    m = vae_factor * 2
    for name, v in (("height", height), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
        if v % m != 0:
            lo, hi = nearest_multiples(v, m)
            raise ValueError(
                f"{family}: {name}={v} is not a multiple of {m} (VAE factor {vae_factor} x 2x2 patch); use "
                f"{lo} or {hi}"
            )
        if max_side is not None and v > max_side:
            raise ValueError(f"{family}: {name}={v} exceeds the model's limit of {max_side}")


class FlowModel:
    """Base of the family wrappers (a plain class, not an nn.Module: `transformer` is the module to train/shard).

    Subclasses set the class attributes and implement the methods below; the docstrings state the contract.
    """

    # ---- what the rest of the code asks a family (models/__init__.py `FAMILIES` maps model_index.json to the class)
    family: str = ""  # the family's name, as `models.model_family` returns it and the user-facing tables key it
    default_lora_targets: tuple[str, ...] = ()  # the LoRA target module names when --lora_target_modules is unset
    lora_block_prefixes: tuple[str, ...] = ()  # the transformer's top-level block lists (LoRA, checkpointing, FSDP2)
    # the blocks `--compile blocks` compiles (`compile_blocks`); () = every block of lora_block_prefixes. Each block
    # class costs compilations of its own (one per variant), so a family may leave eager the classes that hold
    # little of the model's work (`blocks_to_compile`)
    compile_block_prefixes: tuple[str, ...] = ()
    vae_scale_factor: int = 8  # the VAE's spatial downsampling; each wrapper sets it from `vae_scale_factor_of`
    max_side: int | None = None  # largest allowed height/width, None = unlimited
    # the keyword the family's pipelines (ours, diffusers', vllm-omni's) take the CFG scale as; also its user flag
    cfg_argument: str = ""
    default_negative_prompt: str = ""  # the released pipeline's negative prompt when none is given
    supports_reference_images: bool = False  # whether prompts may carry reference images (edit)
    vllm_omni_pipeline: str = ""  # dotted path of the family's RL pipeline class vllm-omni's workers load ("" = none)

    transformer: torch.nn.Module
    scheduler_config: dict[str, Any]

    def __init__(self, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 cfg_batch: bool = False) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        # CFG mode of `guided_velocity`: False = two sequential transformer forwards (conditional, then
        # unconditional); True = one forward over the doubled batch [cond ; uncond] (see `cfg_batch_inputs`).
        # Both give the same velocity up to float tolerance; the rollout and the trainer's replay must use the same
        # mode so that their kernels (and hence the rounding) match.
        self.cfg_batch = bool(cfg_batch)

    # ---- family rules that need no model (start-up checks, data_prep, the vllm-omni engine) ------------------
    @classmethod
    def vae_scale_factor_of(cls, vae_config: Any) -> int:
        """The VAE's spatial downsampling factor from its config (attribute access: a diffusers config or a
        SimpleNamespace of vae/config.json). Model-free, so the start-up checks use the formula the wrapper uses."""
        raise NotImplementedError(f"{cls.__name__}: no VAE scale factor rule")

    @classmethod
    def load_kwargs(cls, args: Any) -> dict[str, Any]:
        """The keyword arguments of `from_pretrained` that come from a trainer's flags (`args`); {} = none."""
        return {}

    @classmethod
    def prompt_token_counter(cls, model_path: str) -> Callable[[Sequence[Any]], list[int]] | None:
        """None when the family never truncates prompts; else a function: prompts -> each prompt's token count as
        `--max_sequence_length` cuts it (from the tokenizer of the pipeline folder `model_path` only, no model)."""
        return None

    @classmethod
    def vllm_omni_text(cls, system: str, user: str) -> str:
        """The text prompt the stock vllm-omni encoder takes for the chat [system, user] (string contents), where
        that chat is exactly what the encoder builds from that text; ValueError otherwise."""
        raise ValueError(f"{cls.family or cls.__name__}: the vllm_omni engine takes no message prompts for this model")

    @classmethod
    def released_chat(cls, text: str) -> list[dict[str, str]]:
        """The [system, user] chat the released pipeline encodes for the text prompt `text` (no reference image):
        data_prep's rows store prompts and negatives this way; `vllm_omni_text` is its inverse."""
        raise NotImplementedError(f"{cls.family or cls.__name__}: no released chat layout")

    @property
    def blocks_to_compile(self) -> tuple[str, ...]:
        """The block prefixes that `--compile blocks` hands to `compile_blocks`."""
        return self.compile_block_prefixes or self.lora_block_prefixes

    # ---- sizes -------------------------------------------------------------------------------------------------
    @classmethod
    def default_size(cls, reference: Any | None = None) -> tuple[int, int]:
        """(height, width) to sample at when none is given (scripts/sample.py), for a prompt with the reference
        image `reference` (None: a text prompt): 512x512 here; a family whose released pipeline sizes its output
        by the reference (Boogu-Image edit) says so."""
        return 512, 512

    @property
    def size_multiple(self) -> int:
        """Height/width must be multiples of this: the VAE factor times the 2x2 patch."""
        return self.vae_scale_factor * 2

    def validate_size(self, height: int, width: int) -> None:
        """Raise ValueError naming the fix unless height and width are positive multiples of `size_multiple`
        (and at most `max_side` where the family has a limit); see `check_image_size`."""
        check_image_size(self.family, height, width, self.vae_scale_factor, self.max_side)

    def latent_hw(self, height: int, width: int) -> tuple[int, int]:
        """(H/8, W/8) after validating the size."""
        self.validate_size(height, width)
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    # ---- the contract (see INTERFACES.md) ---------------------------------------------------------------------
    def schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """sigmas (N+1,) float32 from 1 down to a trailing 0, built with losses.flow_sigmas."""
        raise NotImplementedError

    def encode_prompt(self, prompts: Sequence[Any], images: Sequence[Any] | None = None) -> PromptEmbeds:
        raise NotImplementedError

    def prepare_noise(self, height: int, width: int, generators: Sequence[torch.Generator]) -> torch.Tensor:
        raise NotImplementedError

    def encode_reference(self, images: Sequence[Any], generators: Sequence[torch.Generator]) -> torch.Tensor:
        raise NotImplementedError(f"{self.family}: reference images are not supported by this model")

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        prompt: PromptEmbeds,
        ref_latents: torch.Tensor | None = None,
        *,
        height: int | None = None,
        width: int | None = None,
    ) -> torch.Tensor:
        """fp32 velocity v = eps - x0 at per-sample sigmas (B,). height/width: the image size (packed layouts such
        as Qwen-Image's cannot infer a non-square size from the latents; families that can only check it)."""
        raise NotImplementedError

    def guided_velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        prompt: PromptEmbeds,
        negative: PromptEmbeds | None,
        scale: float,
        ref_latents: torch.Tensor | None = None,
        *,
        height: int | None = None,
        width: int | None = None,
    ) -> torch.Tensor:
        """The family's CFG (scale <= 1: `predict_velocity`; scale > 1 without `negative`: ValueError)."""
        raise NotImplementedError

    def decode(self, latents: torch.Tensor, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """Latents in the native layout -> uint8 images (B, 3, H, W)."""
        raise NotImplementedError

    def forward_flops(self, image_tokens: int, text_tokens: Sequence[int],
                      ref_tokens: Sequence[Sequence[int]] | None = None) -> float:
        """Model FLOPs of ONE transformer forward over len(text_tokens) samples (one CFG branch): every sample has
        `image_tokens` latent tokens ((H/16)·(W/16)), text_tokens[b] valid prompt tokens and, for edit, the token
        counts of its reference images ref_tokens[b]. Matmuls only (2 FLOPs per multiply-add; norms, RoPE and
        activations are not counted), from the transformer's config; a trained forward costs 3x (backward 2x)."""
        raise NotImplementedError(f"{self.family}: no FLOP model")

    # ---- batched CFG ------------------------------------------------------------------------------------------
    def cfg_batch_inputs(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        prompt: PromptEmbeds,
        negative: PromptEmbeds,
        ref_latents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, PromptEmbeds, torch.Tensor | None]:
        """Inputs of ONE forward that evaluates the conditional and the unconditional branch together.

        latents (B, ...) -> (2B, ...) = [latents ; latents]; sigmas (B,) -> (2B,); prompt and negative (B, L_p, D)
        and (B, L_n, D) -> (2B, max(L_p, L_n), D), each right-padded with zeros and mask 0 (`PromptEmbeds.cat`);
        ref_latents (B, C, h, w) -> (2B, C, h, w) (the negative keeps the reference: Boogu's text-only negative
        in edit). Rows [0, B) are the conditional branch, rows [B, 2B) the unconditional one.
        """
        batch = latents.shape[0]
        if len(prompt) != batch or len(negative) != batch:
            raise ValueError(f"batched CFG needs one prompt and one negative row per latent row: got "
                             f"{len(prompt)} prompt and {len(negative)} negative rows for {batch} latents")
        sigmas = self.check_sigmas(sigmas, batch)
        pair = PromptEmbeds.cat([
            PromptEmbeds(p.embeds.to(self.device, self.dtype), p.mask.to(self.device)) for p in (prompt, negative)
        ])
        refs = None if ref_latents is None else torch.cat([ref_latents, ref_latents])
        return torch.cat([latents, latents]), torch.cat([sigmas, sigmas]), pair, refs

    # ---- shared argument checks -------------------------------------------------------------------------------
    @staticmethod
    def check_sigmas(sigmas: torch.Tensor, batch: int) -> torch.Tensor:
        """Return sigmas as a float32 (B,) tensor; a scalar or (1,) is broadcast over the batch."""
        sigmas = torch.as_tensor(sigmas, dtype=torch.float32)
        if sigmas.ndim == 0 or sigmas.numel() == 1:
            sigmas = sigmas.reshape(1).expand(batch)
        if sigmas.shape != (batch,):
            raise ValueError(f"sigmas must be (B,) = ({batch},), got {tuple(sigmas.shape)}")
        return sigmas

    @staticmethod
    def check_guidance(scale: float, negative: PromptEmbeds | None, knob: str) -> bool:
        """True when CFG is active. scale > 1 without a negative fails closed."""
        if scale is None or scale <= 1.0:
            return False
        if negative is None:
            raise ValueError(
                f"{knob}={scale} > 1 requires negative prompt embeddings, got None; encode a negative prompt "
                f"(e.g. the dataset's negative_prompt) or set {knob} <= 1 to disable guidance"
            )
        return True


ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


def attention_backend(name: str):
    """A context manager that restricts `torch.nn.functional.scaled_dot_product_attention` (Qwen-Image through
    diffusers' native attention, Boogu-Image directly) to one SDPA backend: "flash" / "cudnn" / "efficient" /
    "math" (`torch.nn.attention.sdpa_kernel`; an input the backend cannot take raises a RuntimeError
    instead of falling back), or "auto" = no restriction (torch's own choice, the path without this flag)."""
    import contextlib

    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    return sdpa_kernel([backend])


def transformer_blocks(transformer: torch.nn.Module, block_prefixes: Sequence[str]) -> list[torch.nn.Module]:
    """The transformer blocks: for each top-level child named in `block_prefixes` (a wrapper's
    `lora_block_prefixes`), its elements when it is a ModuleList/Sequential, else the child itself. (B blocks, in
    order.)"""
    if not block_prefixes:
        raise ValueError("block_prefixes is empty; pass the model wrapper's lora_block_prefixes")
    blocks: list[torch.nn.Module] = []
    children = dict(transformer.named_children())
    for prefix in block_prefixes:
        if prefix not in children:
            raise ValueError(
                f"block prefix {prefix!r} is not a child of {type(transformer).__name__} (children: {sorted(children)})"
            )
        child = children[prefix]
        blocks.extend(child if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) else [child])
    return blocks


COMPILE_MODES = ("off", "blocks")
# Graphs one block class may hold: (policy with grad, its checkpoint recompute, `old` and reference without grad,
# CFG's [cond ; uncond] batch) x a few shape specialisations. Past it torch would run the block eagerly without a
# word; `compile_blocks` makes that an error instead.
BLOCK_GRAPH_LIMIT = 64


def compile_blocks(transformer: torch.nn.Module, block_prefixes: Sequence[str]) -> int:
    """Regional `torch.compile`: each transformer block's `forward` is replaced by its compiled version; returns how
    many blocks. The block is the unit that repeats (60 in Qwen-Image): blocks of one class share their compiled
    code, so a model compiles one graph per block class and variant (grad / no grad, active adapter or none,
    batch), not per block. What runs around `forward` stays eager: the module hooks (activation checkpointing, the
    input casts of FSDP2 or of the one-rank placement) and everything outside the blocks (embeddings, RoPE tables,
    the final norm and projection, the sampler's loop).

    The math is unchanged; the kernels are not: inductor fuses the elementwise work (norms, modulation, gates,
    RoPE, the LoRA path's casts and scale) into fewer kernels and keeps fp32 intermediates inside a fused kernel
    where eager rounds each op to bf16, so bf16 results differ from eager by bf16 rounding (fp32: ~1e-7 relative,
    tests/test_performance.py). Shapes are dynamic (`dynamic=True`): the prompt length changes every batch, and one
    graph serves every length. A block whose graphs exceed `BLOCK_GRAPH_LIMIT` raises instead of falling back to
    eager. Call once, after LoRA, checkpointing and sharding are in place; adapters loaded later recompile once."""
    import torch._dynamo

    blocks = transformer_blocks(transformer, block_prefixes)
    if any(hasattr(block.forward, "_torchdynamo_orig_callable") for block in blocks):  # torch.compile's wrapper
        raise RuntimeError("compile_blocks: the blocks are compiled already")
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, BLOCK_GRAPH_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * BLOCK_GRAPH_LIMIT)
    config.fail_on_recompile_limit_hit = True
    for block in blocks:
        block.forward = torch.compile(block.forward, dynamic=True)
    return len(blocks)
