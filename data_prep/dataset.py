"""Prompt dataset shared by the trainers: reads a verl-omni-style parquet (see data_prep/*_ocr.py) and returns raw
chat-message lists, reference images (edit), ground truth, data_source and extra_info per row.

    ds = PromptDataset("~/data/ocr/boogu_image/train.parquet", guidance=True)
    len(ds); row = ds[17]      # PromptRow; O(1), images decoded on access

Every row is validated when the dataset is opened, so a bad file fails at startup, not at step 300:
- the `prompt` column holds a non-empty list of {"role", "content": str} messages with a user message whose text
  (placeholders aside) is not empty or whitespace;
- the media-count rule: every `<image>` placeholder in the prompt consumes one item of `images`, and the prompt
  must consume all of them; a negative prompt either consumes exactly as many, or (text-only negative, the Boogu
  edit convention) none at all; `<video>` / `<audio>` are not supported;
- with `guidance=True` every row needs a non-empty negative prompt (guided sampling without negative embeddings
  would otherwise silently run unguided or crash later);
- reward_model.ground_truth is a string and data_source a non-empty string (optionally one of `data_sources`).
Errors name the file, the row and the column.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

IMAGE_PLACEHOLDER = "<image>"
UNSUPPORTED_PLACEHOLDERS = ("<video>", "<audio>")
ROLES = ("system", "user", "assistant")


def has_printable_text(text: str) -> bool:
    """Whether `text` holds a character that shows: not only whitespace and control characters (NUL, ...)."""
    return any(ch.isprintable() and not ch.isspace() for ch in text)


@dataclass
class PromptRow:
    index: int                                   # row number in the parquet file
    prompt: list[dict[str, str]]                 # raw chat messages, used verbatim by the model wrappers
    negative_prompt: list[dict[str, str]] | None
    images: list[Image.Image]                    # reference images (edit); [] for text-to-image
    ground_truth: str                            # reward_model.ground_truth
    data_source: str                             # names the reward
    extra_info: dict = field(default_factory=dict)


class DatasetError(ValueError):
    pass


def count_placeholders(messages: list[dict[str, str]]) -> int:
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)


class PromptDataset:
    """Random access over a prompt parquet. `guidance`: the run samples with CFG, so negatives are required."""

    def __init__(self, path: str | Path, *, guidance: bool, prompt_key: str = "prompt",
                 negative_key: str = "negative_prompt", image_key: str = "images",
                 data_sources: Collection[str] | None = None):
        self.path = Path(path).expanduser()
        self.guidance = guidance
        self.prompt_key, self.negative_key, self.image_key = prompt_key, negative_key, image_key
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: dataset file not found")
        try:
            self.table = pq.read_table(self.path, memory_map=True)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{self.path}: not a readable parquet file ({exc})") from exc
        for col in (prompt_key, "reward_model", "data_source"):
            if col not in self.table.column_names:
                raise DatasetError(f"{self.path}: column {col!r} is missing (columns: {self.table.column_names})")
        if guidance and negative_key not in self.table.column_names:
            raise DatasetError(
                f"{self.path}: column {negative_key!r} is missing but guidance is on; regenerate the dataset with a "
                f"data_prep converter (they always write negative prompts) or disable guidance (scale <= 1)")
        if self.table.num_rows == 0:
            raise DatasetError(f"{self.path}: the dataset has no rows")
        self._prompts = self.table.column(prompt_key).to_pylist()
        self._negatives = (self.table.column(negative_key).to_pylist()
                           if negative_key in self.table.column_names else [None] * len(self))
        self._reward_models = self.table.column("reward_model").to_pylist()
        self._data_sources = self.table.column("data_source").to_pylist()
        self._extra_infos = (self.table.column("extra_info").to_pylist()
                             if "extra_info" in self.table.column_names else [None] * len(self))
        if image_key in self.table.column_names:
            lengths = pc.list_value_length(self.table.column(image_key)).to_pylist()
            self._num_images = [n or 0 for n in lengths]
        else:
            self._num_images = [0] * len(self)
        allowed = set(data_sources) if data_sources is not None else None
        for i in range(len(self)):
            self._validate_row(i, allowed)

    def __len__(self) -> int:
        return self.table.num_rows

    def _err(self, i: int, col: str, msg: str) -> DatasetError:
        return DatasetError(f"{self.path}: row {i}, column {col!r}: {msg}")

    def _check_messages(self, i: int, col: str, messages) -> None:
        if not isinstance(messages, list) or not messages:
            raise self._err(i, col, f"expected a non-empty list of chat messages, got {messages!r}")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise self._err(i, col, f"bad message {m!r}: need {{'role': one of {ROLES}, 'content': str}}")
            for tok in UNSUPPORTED_PLACEHOLDERS:
                if tok in m["content"]:
                    raise self._err(i, col, f"{tok} placeholders are not supported (image-only pipelines)")
        if not any(m["role"] == "user" for m in messages):
            raise self._err(i, col, "no user message")

    def _validate_row(self, i: int, allowed: set[str] | None) -> None:
        prompt, negative, n_images = self._prompts[i], self._negatives[i], self._num_images[i]
        self._check_messages(i, self.prompt_key, prompt)
        text = "".join(m["content"] for m in prompt if m["role"] == "user").replace(IMAGE_PLACEHOLDER, "")
        if not text.strip():
            raise self._err(i, self.prompt_key, f"the user message has no text ({prompt!r}); every row needs a "
                                                f"prompt: fix or drop the row")
        if not has_printable_text(text):  # NULs and other control characters only: as empty as a blank prompt
            raise self._err(i, self.prompt_key, f"the user message has no printable text ({text!r}); every row needs "
                                                f"a prompt: fix or drop the row")
        n_pos = count_placeholders(prompt)
        if n_pos != n_images:
            raise self._err(i, self.prompt_key, f"{n_pos} {IMAGE_PLACEHOLDER} placeholder(s) but the row carries "
                                                f"{n_images} image(s) in {self.image_key!r}; each placeholder "
                                                f"consumes one image and all images must be consumed")
        if negative is None or negative == []:
            if self.guidance:
                raise self._err(i, self.negative_key,
                                "no negative prompt but guidance is on; every row needs one (regenerate with a "
                                "data_prep converter or disable guidance)")
        else:
            self._check_messages(i, self.negative_key, negative)
            n_neg = count_placeholders(negative)
            if n_neg not in (0, n_images):
                raise self._err(i, self.negative_key,
                                f"{n_neg} {IMAGE_PLACEHOLDER} placeholder(s) for {n_images} image(s): a negative "
                                f"prompt is either text-only (0) or consumes every image")
        rm = self._reward_models[i]
        if not isinstance(rm, dict) or not isinstance(rm.get("ground_truth"), str):
            raise self._err(i, "reward_model", f"expected a struct with a string 'ground_truth', got {rm!r}")
        ds = self._data_sources[i]
        if not isinstance(ds, str) or not ds:
            raise self._err(i, "data_source", f"expected a non-empty string, got {ds!r}")
        if allowed is not None and ds not in allowed:
            raise self._err(i, "data_source", f"{ds!r} names no known reward {sorted(allowed)}; relabel with "
                                              f"data_prep/set_data_source.py")
        info = self._extra_infos[i]
        if info is not None and not isinstance(info, dict):
            raise self._err(i, "extra_info", f"expected a struct, got {type(info).__name__}")

    def metadata(self, i: int) -> tuple[str, dict]:
        """Row i's data_source and extra_info (no image decoding)."""
        return self._data_sources[i], dict(self._extra_infos[i] or {})

    def _decode_images(self, i: int) -> list[Image.Image]:
        if self._num_images[i] == 0:
            return []
        items = self.table.column(self.image_key).slice(i, 1).to_pylist()[0]
        images = []
        for k, item in enumerate(items):
            data = item.get("bytes") if isinstance(item, dict) else None
            if not data:
                raise self._err(i, self.image_key, f"image {k} has no 'bytes' (got {type(item).__name__})")
            try:
                img = Image.open(io.BytesIO(data))
                img.load()
            except Exception as exc:
                raise self._err(i, self.image_key, f"image {k} cannot be decoded ({exc})") from exc
            images.append(img.convert("RGB"))
        return images

    def __getitem__(self, i: int) -> PromptRow:
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.path}: row {i} out of range for {len(self)} rows")
        i = i % len(self)
        negative = self._negatives[i] or None
        return PromptRow(
            index=i,
            prompt=self._prompts[i],
            negative_prompt=negative,
            images=self._decode_images(i),
            ground_truth=self._reward_models[i]["ground_truth"],
            data_source=self._data_sources[i],
            extra_info=dict(self._extra_infos[i] or {}),
        )
