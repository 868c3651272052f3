"""What every benchmark writes: its numbers as JSON and, where matplotlib is installed, a plot."""
from __future__ import annotations

import json
import os


def write_json(out_dir: str, name: str, data) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
    print(f"wrote {path}", flush=True)
    return path


def new_figure():
    """(fig, ax) on a file-only backend, or None where matplotlib is not installed (not a dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return None
    return plt.subplots(figsize=(7, 4.2), dpi=110)


def grouped_bars(ax, groups, series) -> None:
    """One bar per series in each group: groups are x labels, series {name: [value per group]}."""
    import numpy as np

    width = 0.8 / len(series)
    xs = np.arange(len(groups))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(xs + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(xs, [str(g) for g in groups])


def save_figure(fig, ax, out_dir: str, name: str, title: str) -> str:
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return path
