"""Per-layer x per-GPU load heatmaps (matplotlib, imported lazily: the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fdeplb.errors import DependencyError, InputError


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DependencyError("--plot needs matplotlib: pip install 'fdeplb[plot]'") from None
    return plt


def check_plot_path(path: str | Path) -> None:
    """Before any work: :class:`InputError` unless ``path``'s suffix names an image format matplotlib writes
    (``.png``, ``.svg``, ``.pdf``, ...); :class:`DependencyError` without matplotlib."""
    plt = _pyplot()
    fig = plt.figure()
    try:
        supported = fig.canvas.get_supported_filetypes()
    finally:
        plt.close(fig)
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in supported:
        raise InputError(f"--plot {path}: {'.' + suffix if suffix else 'no suffix'} is not an image format; name it "
                         f"*.png (or one of {', '.join('.' + s for s in sorted(supported))})")


def plot_gpu_loads(panels: list[tuple[str, np.ndarray]], path: str | Path, *, title: str = "") -> Path:
    """Write an image (PNG, or the format ``path``'s suffix names) with one heatmap per ``(label, gpu_loads
    [L, num_gpus])`` panel, side by side.

    Colour = GPU load / mean GPU load of the layer, on one diverging scale centred on 1.0 shared by all panels, so
    hot GPUs are red, idle ones blue and a balanced layer is a white row.

    Raises:
        DependencyError: matplotlib is not installed (``pip install 'fdeplb[plot]'``).
        InputError: ``path``'s suffix is not an image format (:func:`check_plot_path`).
    """
    check_plot_path(path)
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm
    rel = []
    for _, loads in panels:
        mean = loads.mean(axis=1, keepdims=True)
        rel.append(np.divide(loads, mean, out=np.ones_like(loads), where=mean > 0))
    hi = max(1.05, max(float(r.max()) for r in rel))
    lo = min(0.95, min(float(r.min()) for r in rel))
    norm = TwoSlopeNorm(vmin=lo, vcenter=1.0, vmax=hi)
    L, G = panels[0][1].shape
    fig, axes = plt.subplots(
        1, len(panels), figsize=(2.0 + 4.2 * len(panels), 1.5 + min(12.0, 0.12 * L + 2)), squeeze=False,
        constrained_layout=True,
    )
    image = None
    for ax, (label, _), r in zip(axes[0], panels, rel):
        image = ax.imshow(r, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
        ratio = r.max(axis=1)
        ax.set_title(f"{label}\nmax/mean per layer: mean {ratio.mean():.4f}, worst {ratio.max():.4f}", fontsize=10)
        ax.set_xlabel("GPU (EP rank)")
        ax.set_ylabel("MoE layer (row)")
    fig.colorbar(image, ax=axes[0].tolist(), label="GPU load / layer mean", shrink=0.9)
    if title:
        fig.suptitle(title, fontsize=11)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
