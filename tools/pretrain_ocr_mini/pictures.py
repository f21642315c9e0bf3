"""Pictures (Pillow only, so nothing here depends on matplotlib): sample grids and the reward curve."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .state import Run


def save_grid(images: torch.Tensor, cols: int, path: Path) -> None:
    """uint8 (B, 3, H, W) -> a PNG grid, row-major, `cols` per row, no gaps (pixels are read back by tests)."""
    from PIL import Image

    b, _, h, w = images.shape
    rows = math.ceil(b / cols)
    canvas = np.zeros((rows * h, cols * w, 3), dtype=np.uint8)
    arr = images.permute(0, 2, 3, 1).numpy()
    for i in range(b):
        r, c = divmod(i, cols)
        canvas[r * h:(r + 1) * h, c * w:(c + 1) * w] = arr[i]
    Image.fromarray(canvas).save(path)


def read_grid(path: Path, count: int, cols: int, size: int) -> torch.Tensor:
    """Inverse of save_grid: the first `count` images (B, 3, size, size) uint8."""
    from PIL import Image

    arr = np.asarray(Image.open(path).convert("RGB"))
    out = []
    for i in range(count):
        r, c = divmod(i, cols)
        out.append(arr[r * size:(r + 1) * size, c * size:(c + 1) * size])
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).contiguous()


def save_curve_png(state: dict[str, Any], path: Path) -> None:
    """Held-out OCR reward (transformer samples, and VAE reconstructions) against cumulative pretraining seconds."""
    from PIL import Image, ImageDraw

    series = [("VAE reconstruction", (40, 110, 200), [(e["total_s"], e["mean"]) for e in state["curves"]["vae_eval"]]),
              ("held-out reward", (200, 60, 40), [(e["total_s"], e["mean"]) for e in state["curves"]["eval"]]),
              ("held-out exact", (60, 150, 60), [(e["total_s"], e["exact"]) for e in state["curves"]["eval"]])]
    w, h, pad = 720, 420, 50
    image = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    t_max = max([1.0] + [t for _, _, pts in series for t, _ in pts])
    to_xy = lambda t, r: (pad + (w - 2 * pad) * t / t_max, h - pad - (h - 2 * pad) * r)  # noqa: E731
    draw.rectangle([pad, pad, w - pad, h - pad], outline=(0, 0, 0))
    for r in (0.2, 0.4, 0.6, 0.8):
        y = to_xy(0, r)[1]
        draw.line([pad, y, w - pad, y], fill=(225, 225, 225))
        draw.text((8, y - 6), f"{r:.1f}", fill=(0, 0, 0))
    draw.text((pad, h - pad + 8), "0 s", fill=(0, 0, 0))
    draw.text((w - pad - 60, h - pad + 8), f"{t_max:.0f} s", fill=(0, 0, 0))
    draw.text((pad, 12), "rapidocr reward vs cumulative pretraining seconds", fill=(0, 0, 0))
    for k, (name, colour, pts) in enumerate(series):
        xy = [to_xy(t, r) for t, r in pts]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for x, y in xy:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        draw.text((w - pad - 170, pad + 8 + 14 * k), name, fill=colour)
    image.save(path)


def print_curve(run: Run) -> None:
    curves = run.state["curves"]
    run.log("held-out OCR reward curve (total_s = cumulative pretraining seconds over all calls):")
    for e in curves["vae_eval"]:
        run.log(f"  vae          total_s {e['total_s']:7.1f}  vae_s {e['vae_s']:6.1f}  step {e['step']:6d}  "
                f"reconstruction reward {e['mean']:.3f}  exact {e['exact']:.3f}")
    for e in curves["eval"]:
        run.log(f"  transformer  total_s {e['total_s']:7.1f}  train_s {e['train_s']:6.1f}  images {e['images']:9d}  "
                f"reward {e['mean']:.3f}  exact {e['exact']:.3f}  within-prompt std {e['within_std']:.3f}")
