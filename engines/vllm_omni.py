"""Layer 4 of the rollout code: the vllm-omni engine (vllm-omni 0.30; imported lazily, only here) and its pure
helpers (prompt and sampling-parameter building, output parsing, the adapter copy in vllm-omni names).

The custom RL pipelines live in `engines/vllm_omni_pipelines.py`; vllm-omni's worker processes import them by
dotted path (each family class's `vllm_omni_pipeline`, `VLLM_OMNI_WORKER_EXTENSION`), so this module names them but
never imports them. Imports torch, `models/` and the lower layers `engines.sampler` and `engines.contract`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from typing import Any, Iterator, Sequence

import torch

from engines.contract import RolloutRequest, RolloutResult, image_to_uint8
from engines.sampler import window_length
from models import family_class, pipeline_cfg_kwargs
from models.base import PromptEmbeds

VLLM_OMNI_WORKER_EXTENSION = "engines.vllm_omni_pipelines.RLWorkerExtension"


def vllm_omni_text(family: str, prompt: Any) -> str:
    """The text prompt the stock vllm-omni encoders take for one of our prompts.

    A str passes through. A chat-message list is accepted only where it is exactly what the stock encoder builds
    from a string (the family class's `vllm_omni_text`): Qwen [Qwen-Image system, user] (checked by
    `models.qwen_image.render_prompt`); Boogu [system = the released rule's prompt for the user text, user without
    "<image>"]. Anything else raises, since the vllm-omni encoders cannot take arbitrary message lists.
    """
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, (list, tuple)) or len(prompt) != 2 or not all(isinstance(m, dict) for m in prompt):
        raise ValueError(f"a prompt must be a str or a [system, user] message list, got {prompt!r:.200}")
    system, user = prompt
    if system.get("role") != "system" or user.get("role") != "user" or not isinstance(user.get("content"), str):
        raise ValueError(f"message prompts must be [system, user] with string content, got {prompt!r:.200}")
    return family_class(family).vllm_omni_text(system.get("content"), user["content"])


def vllm_omni_prompt(family: str, request: RolloutRequest, row: int) -> dict[str, Any]:
    """The OmniTextPrompt dict of sample `row`: prompt, negative_prompt (when given), and for Boogu edit the
    reference image as `multi_modal_data` (PIL; the stock pre-process resizes it)."""
    out: dict[str, Any] = {"prompt": vllm_omni_text(family, request.prompts[row])}
    if request.negative_prompts is not None:
        out["negative_prompt"] = vllm_omni_text(family, request.negative_prompts[row])
    image = None if request.images is None else request.images[row]
    if image is not None:
        if not family_class(family).supports_reference_images:
            raise ValueError("reference images are only supported for Boogu-Image edit")
        if isinstance(image, torch.Tensor):
            import PIL.Image

            image = PIL.Image.fromarray(image.permute(1, 2, 0).contiguous().cpu().numpy())
        if (image.height, image.width) != (request.height, request.width):
            raise ValueError(
                f"reference image {image.width}x{image.height} != requested {request.width}x{request.height}: "
                "vllm-omni's Boogu pre-process sets the output size from the reference (align_res), so the "
                "vllm_omni engine needs references already at the output size; resize them first"
            )
        out["multi_modal_data"] = {"image": image}
    return out


def vllm_omni_sampling_kwargs(family: str, request: RolloutRequest, row: int) -> dict[str, Any]:
    """Keyword arguments of sample `row`'s OmniDiffusionSamplingParams (without the LoRA request).

    One request per sample: `seed` is per request in vllm-omni, and `generator_device` is pinned so the noise
    equals the native engine's. The CFG scale goes to the family's pipeline argument (`FlowModel.cfg_argument`:
    Boogu `guidance_scale`, Qwen `true_cfg_scale`), always explicit so vllm-omni's defaulting never decides; the SDE
    knobs ride in `extra_args`.
    """
    guidance = pipeline_cfg_kwargs(family, request.cfg_scale)  # the scale as the family's pipeline argument
    extra = {
        "rl_noise_level": float(request.noise_level),
        "rl_sde_type": request.sde_type,
        "rl_sde_window_size": request.sde_window_size,
        "rl_sde_window_range": None if request.sde_window_range is None else list(request.sde_window_range),
        "rl_return_log_probs": bool(request.return_log_probs),
        "rl_return_trajectory": bool(request.return_trajectory),
    }
    return dict(height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
                seed=int(request.seeds[row]), generator_device=request.generator_device, num_outputs_per_prompt=1,
                output_type="pil", extra_args=extra, **guidance)


def parse_vllm_omni_output(output: Any) -> dict[str, Any]:
    """One OmniRequestOutput of our RL pipeline -> per-sample fields (see engines/vllm_omni_pipelines.py's docstring).

    Reads `.error`, `.images`, and the dict-valued `.trajectory_latents` / `.trajectory_log_probs` and the tensor
    `.trajectory_timesteps`. Never `.latents` (vllm-omni sets it to the trajectory, not the final latent)."""
    if getattr(output, "error", None):
        raise RuntimeError(f"vllm-omni request {getattr(output, 'request_id', '?')} failed: {output.error}")
    images = getattr(output, "images", None) or []
    if len(images) != 1:
        raise RuntimeError(f"vllm-omni request {getattr(output, 'request_id', '?')} returned {len(images)} images, "
                           "expected 1 (is the custom RL pipeline class loaded?)")
    lat, extra = output.trajectory_latents, output.trajectory_log_probs
    if not isinstance(lat, dict) or not isinstance(extra, dict) or "latents_clean" not in lat:
        raise RuntimeError("vllm-omni output lacks the RL fields (trajectory_latents must be the RL pipeline's dict); "
                           "the engine must run its family's `vllm_omni_pipeline`, from engines/vllm_omni_pipelines.py")
    return {
        "image": image_to_uint8(images[0]),
        "latents_clean": lat["latents_clean"].float().cpu(),
        "all_latents": None if "all_latents" not in lat else lat["all_latents"].float().cpu(),
        "all_means": None if "all_means" not in lat else lat["all_means"].float().cpu(),
        "ref_latents": None if "ref_latents" not in lat else lat["ref_latents"].float().cpu(),
        "all_timesteps": None if output.trajectory_timesteps is None else output.trajectory_timesteps.float().cpu(),
        "all_log_probs": None if "all_log_probs" not in extra else extra["all_log_probs"].float().cpu(),
        "prompt_embeds": extra["prompt_embeds"].cpu(),
        "prompt_mask": extra["prompt_mask"].to(torch.int64).cpu(),
        "negative_embeds": extra["negative_embeds"].cpu() if "negative_embeds" in extra else None,
        "negative_mask": extra["negative_mask"].to(torch.int64).cpu() if "negative_mask" in extra else None,
        "sigmas": extra["sigmas"].float().cpu(),
        "window_start": int(extra["window_start"]),
        "guidance": float(extra["guidance"]),
    }


def assemble_vllm_omni_result(parts: Sequence[dict[str, Any]], request: RolloutRequest, *, family: str,
                              adapter_version: str | None, bound_modules: int) -> RolloutResult:
    """Per-sample parsed outputs (request order) -> a RolloutResult like the native engine's."""
    if len(parts) != len(request):
        raise RuntimeError(f"got {len(parts)} vllm-omni outputs for {len(request)} samples")
    steps = request.num_inference_steps
    stochastic = request.noise_level > 0
    width_w = window_length(steps, request.sde_window_size) if stochastic else 0

    def stack(name: str, needed: bool) -> torch.Tensor | None:
        values = [p[name] for p in parts]
        if not needed:
            return None
        if any(v is None for v in values):
            raise RuntimeError(f"vllm-omni outputs lack {name} (the request asked for it)")
        return torch.stack(values)

    def padded(name: str, mask_name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if parts[0][name] is None:
            return None, None
        joined = PromptEmbeds.cat([PromptEmbeds(p[name][None], p[mask_name][None]) for p in parts])
        return joined.embeds, joined.mask

    for p in parts[1:]:
        if not torch.equal(p["sigmas"], parts[0]["sigmas"]):
            raise RuntimeError("vllm-omni samples of one request used different sigma schedules")
    prompt_embeds, prompt_mask = padded("prompt_embeds", "prompt_mask")
    negative_embeds, negative_mask = padded("negative_embeds", "negative_mask")
    keep_trajectory = stochastic and request.return_trajectory
    metadata = {
        "engine": VllmOmniEngine.name, "family": family, "height": request.height, "width": request.width,
        "num_inference_steps": steps, "sigmas": parts[0]["sigmas"], "guidance": parts[0]["guidance"],
        "noise_level": request.noise_level, "sde_type": request.sde_type, "window_size": width_w,
        "adapter_version": adapter_version, "bound_modules": bound_modules,
        "generator_device": request.generator_device,
    }
    edit = request.images is not None and any(im is not None for im in request.images)
    return RolloutResult(
        images=torch.stack([p["image"] for p in parts]), latents_clean=stack("latents_clean", True),
        prompt_embeds=prompt_embeds, prompt_mask=prompt_mask, seeds=list(request.seeds), metadata=metadata,
        window_starts=[p["window_start"] for p in parts] if stochastic else None,
        negative_embeds=negative_embeds, negative_mask=negative_mask, ref_latents=stack("ref_latents", edit),
        all_latents=stack("all_latents", keep_trajectory), all_timesteps=stack("all_timesteps", keep_trajectory),
        all_means=stack("all_means", keep_trajectory),
        all_log_probs=stack("all_log_probs", stochastic and request.return_log_probs),
    )


def write_engine_adapter(adapter_dir: str, out_dir: str) -> int:
    """Copy a PEFT adapter directory (trainer or vllm-omni names) to `out_dir` with vllm-omni module names (keys
    `base_model.model.<engine path>.lora_{A,B}.weight`, translated `target_modules`), atomically, through
    `models.lora.write_adapter_dir`. Returns the number of modules."""
    from models import lora

    config, modules = lora.read_adapter(adapter_dir)  # keys back in trainer names, whichever form the file had
    half = sorted(p for p, ab in modules.items() if set(ab) != {"A", "B"})
    if half:
        raise ValueError(f"{adapter_dir}: modules {half[:6]} lack lora_A or lora_B (both are required)")
    targets = config.get("target_modules")
    if not isinstance(targets, (list, tuple)):
        raise ValueError(f"{adapter_dir}: target_modules must be a list of module names, got {targets!r}")
    config = dict(config, target_modules=lora.from_engine_targets(targets))
    tensors = {f"{path}.lora_{x}.weight": ab[x] for path, ab in modules.items() for x in ("A", "B")}
    bad = lora.nonfinite_tensors(tensors)
    if bad:  # vllm-omni binds what it is given: refuse here what bind_adapter refuses for the native engine
        raise ValueError(f"{adapter_dir}: {len(bad)} LoRA tensors hold NaN/inf (e.g. {bad[:3]}); refusing to hand "
                         f"a corrupt adapter to the engine")
    lora.write_adapter_dir(tensors, config, out_dir, engine_names=True, key_prefix="base_model.model.")
    return len(modules)


def rpc_bound_counts(replies: Any) -> list[int]:
    """The per-worker bound-module counts in an `AsyncOmni.collective_rpc("rl_bind_adapter")` reply (nested per
    stage / per worker). An error or TODO dict from any replica raises."""
    if isinstance(replies, bool):
        raise RuntimeError(f"rl_bind_adapter answered {replies!r}, expected a module count")
    if isinstance(replies, int):
        return [replies]
    if isinstance(replies, dict):
        raise RuntimeError(f"rl_bind_adapter failed on a replica: {replies}")
    if isinstance(replies, (list, tuple)):
        return [c for r in replies for c in rpc_bound_counts(r)]
    raise RuntimeError(f"rl_bind_adapter answered {replies!r}, expected a module count")


def import_vllm_omni() -> Any:
    """vllm_omni, or a clear error naming the fix."""
    try:
        import vllm_omni  # noqa: F401
        from vllm_omni.entrypoints.async_omni import AsyncOmni  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"the vllm_omni rollout engine needs vllm-omni 0.30 and vLLM 0.30 installed on the rollout machine "
            f"(pip install vllm==0.30.0 vllm-omni==0.30.0, a CUDA GPU); import failed: {e}. "
            "Use --rollout_engine native (the default) otherwise"
        ) from e
    return vllm_omni


class VllmOmniEngine:
    """`AsyncOmni` with our custom RL pipeline class; same interface as `NativeEngine`.

    One vllm-omni request per sample (per-sample seeds), submitted concurrently so the engine batches them
    (`max_num_seqs=max_batch_size`). LoRA: `load_adapter` writes a vllm-omni-named copy of the PEFT directory,
    registers it with a NEW `LoRARequest` id per version, runs vllm-omni's fail-closed bind check at once through
    the worker extension (`RLWorkerExtension.rl_bind_adapter`) and attaches the request to every later sample.
    """

    name = "vllm_omni"

    def __init__(self, model_path: str, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 max_batch_size: int = 8, cfg_batch: bool = False, **engine_kwargs: Any) -> None:
        import asyncio

        if cfg_batch:  # the RL pipelines run the two CFG branches sequentially; the replay must match the rollout
            raise ValueError("the vllm_omni engine runs CFG as two sequential forwards; drop --cfg_batch so the "
                             "trainer's replay uses the same CFG mode as the rollout")
        import_vllm_omni()
        from vllm_omni.entrypoints.async_omni import AsyncOmni

        if not str(device).startswith("cuda"):
            raise ValueError(f"the vllm_omni engine runs on CUDA GPUs only, got device={device!r}; use the native "
                             "engine on CPU")
        if not torch.cuda.is_available():  # fail here, plainly, not deep inside AsyncOmni's stage start-up
            raise RuntimeError(f"vllm_omni needs CUDA: torch {torch.__version__} in {sys.executable} sees no CUDA GPU "
                               f"(device={device!r}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                               "run the rollout workers on a GPU node or use --rollout_engine native")
        from models import model_family

        self.family = model_family(model_path)
        pipeline_class = family_class(self.family).vllm_omni_pipeline
        if not pipeline_class:
            raise ValueError(f"{self.family}: no vllm-omni RL pipeline; use --rollout_engine native")
        self.model_path = model_path
        self.adapter_version: str | None = None
        self.bound_modules = 0
        self._lora_request: Any = None
        self._next_lora_id = 1
        self._adapter_root = tempfile.mkdtemp(prefix="vllm-omni-adapters-")
        # vllm-omni's workers import engines.vllm_omni_pipelines by dotted path: the repository root goes first
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        os.environ["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        kwargs = dict(
            model=model_path, dtype=str(dtype).replace("torch.", ""), max_num_seqs=max_batch_size,
            custom_pipeline_args={"pipeline_class": pipeline_class},
            worker_extension_cls=VLLM_OMNI_WORKER_EXTENSION, max_cpu_loras=2,
        )
        kwargs.update(engine_kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-omni-loop", daemon=True)
        self._thread.start()

        async def build():
            return AsyncOmni(**kwargs)

        self.omni = self._run(build())
        import atexit

        atexit.register(self.close)  # the worker process exits by returning: stop vllm-omni's stage processes

    def _run(self, coroutine: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # ---- LoRA -------------------------------------------------------------------------------------------------
    def load_adapter(self, adapter_dir: str, version: str) -> int:
        """Register the adapter (vllm-omni names, new int id), bind it now (fail closed), return the bound count."""
        from vllm.lora.request import LoRARequest

        lora_id = self._next_lora_id
        engine_dir = os.path.join(self._adapter_root, f"{lora_id:06d}-{version}")
        expected = write_engine_adapter(adapter_dir, engine_dir)
        request = LoRARequest(lora_name=f"{version}#{lora_id}", lora_int_id=lora_id, lora_path=engine_dir)
        self._next_lora_id += 1

        async def register():
            if not await self.omni.add_lora(request):
                raise RuntimeError(f"vllm-omni did not load LoRA adapter {engine_dir} (add_lora returned False)")
            return await self.omni.collective_rpc("rl_bind_adapter", args=(request,))

        try:
            replies = self._run(register())
            counts = rpc_bound_counts(replies)
            if not counts or set(counts) != {expected}:
                raise RuntimeError(f"vllm-omni bound {counts} modules per worker, the file has {expected}")
        except Exception as e:
            try:  # do not leave the rejected adapter cached in the workers
                self._run(self.omni.remove_lora(lora_id))
            except Exception:
                pass
            shutil.rmtree(engine_dir, ignore_errors=True)
            raise RuntimeError(f"vllm-omni rejected adapter {adapter_dir} (version {version}): {e}. Its module names "
                               "must bind to the pipeline's LoRA layers (vllm-omni's fail-closed bind check)") from e
        if self._lora_request is not None:  # the previous version: out of the workers and off the disk
            self._run(self.omni.remove_lora(self._lora_request.lora_int_id))
            shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
        self._lora_request, self.adapter_version, self.bound_modules = request, version, counts[0]
        return self.bound_modules

    # ---- generation -------------------------------------------------------------------------------------------
    def build_requests(self, request: RolloutRequest) -> list[tuple[dict[str, Any], Any]]:
        """(prompt dict, OmniDiffusionSamplingParams) per sample of the validated `request`, with the current LoRA
        request attached."""
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        request.validate()
        return [(vllm_omni_prompt(self.family, request, b),
                 OmniDiffusionSamplingParams(lora_request=self._lora_request,
                                             **vllm_omni_sampling_kwargs(self.family, request, b)))
                for b in range(len(request))]

    def generate(self, request: RolloutRequest) -> RolloutResult:
        import asyncio
        import uuid

        pairs = self.build_requests(request)
        tag = uuid.uuid4().hex[:8]

        async def one(b: int, prompt: dict, params: Any) -> Any:
            final = None
            async for out in self.omni.generate(prompt, request_id=f"rl-{tag}-{b}", sampling_params_list=[params]):
                final = out
            if final is None:
                raise RuntimeError(f"vllm-omni returned nothing for sample {b}")
            return final

        async def run_all():
            return await asyncio.gather(*(one(b, p, sp) for b, (p, sp) in enumerate(pairs)))

        outputs = self._run(run_all())
        parts = [parse_vllm_omni_output(o) for o in outputs]
        return assemble_vllm_omni_result(parts, request, family=self.family, adapter_version=self.adapter_version,
                                         bound_modules=self.bound_modules)

    def generate_chunks(self, request: RolloutRequest) -> Iterator[tuple[int, RolloutResult]]:
        """The whole request as one chunk (vllm-omni batches its requests itself)."""
        yield 0, self.generate(request)

    def close(self) -> None:
        """Shut vllm-omni down (its stage processes and workers); idempotent."""
        omni, self.omni = getattr(self, "omni", None), None
        if omni is not None:
            omni.shutdown()
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if getattr(self, "_adapter_root", None):
            shutil.rmtree(self._adapter_root, ignore_errors=True)

