"""The pictures of ``speccache train`` (the loss curve) and ``speccache evaluate`` (the acceptance chart).

matplotlib is an optional extra (``pip install 'speccache[plots]'``), imported only when a picture is drawn.
Figures are drawn on matplotlib's Agg canvas directly, without pyplot, so no display is needed and no global
backend is chosen for the caller. Without matplotlib a function draws nothing and returns False; the caller
prints :func:`not_drawn`'s one line, and its logs and reports are written all the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from speccache.errors import UsageError
from speccache.format.durable import atomic_write

__all__ = ["LABELS", "PLOTS_EXTRA", "acceptance_chart", "chart_path", "loss_curve", "not_drawn"]

PLOTS_EXTRA = "pip install 'speccache[plots]'"
"""How to get matplotlib: the extra that brings it."""

# what each proposer is called in the pictures and the demo's lines, in the order they are drawn
LABELS = {"draft": "EAGLE-3 draft", "ngram": "n-gram table", "prompt_lookup": "prompt lookup"}


def not_drawn(path: str) -> str:
    """The one line a command prints when matplotlib is missing and ``path`` was not drawn."""
    return f"{path} not drawn: matplotlib is not installed ({PLOTS_EXTRA})"


def chart_path(report: str) -> str:
    """Where ``speccache evaluate --json REPORT`` draws its chart: REPORT with its extension replaced by ``.png``.

    Raises:
        ValueError: REPORT itself ends in ``.png`` (the chart would be written over it).
    """
    png = os.path.splitext(report)[0] + ".png"
    if png == report:
        raise UsageError(f"--json {report}: its chart would be written over it; name the report REPORT.json")
    return png


def _save(path: str, draw: Callable[[Any], None], size: tuple[float, float]) -> bool:
    """Draw a figure of ``size`` inches with ``draw(figure)`` and write it to ``path`` as a PNG, atomically.

    Returns:
        False, drawing nothing, when matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    figure = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    draw(figure)
    # the temporary name has no .png suffix, so the format is named
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png"))
    return True


def _smoothed(values: Sequence[float], window: int) -> list[float]:
    """The running mean of ``values`` over the last ``window`` of them."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def loss_curve(records: Sequence[Mapping[str, Any]], path: str) -> bool:
    """Draw ``speccache train``'s log (its JSONL records) to ``path``: the loss, each training-time-test step's
    top-1 accuracy and the learning rate against the optimizer step, epochs marked.

    Returns:
        False, drawing nothing, when matplotlib is not installed.
    """
    steps = [r["step"] for r in records]
    window = max(1, len(records) // 20)

    def draw(figure: Any) -> None:
        loss_ax, acc_ax = figure.subplots(2, 1, sharex=True, height_ratios=[3, 2])
        loss_ax.plot(steps, [r["loss"] for r in records], color="0.7", linewidth=0.8, label="loss")
        if window > 1:
            smooth = _smoothed([r["loss"] for r in records], window)
            loss_ax.plot(steps, smooth, color="C0", label=f"mean of {window} steps")
        loss_ax.set_ylabel("soft cross-entropy")
        loss_ax.set_title(f"speccache train: {len(records)} steps")
        loss_ax.legend(loc="upper right")
        for a in range(len(records[0]["accuracy"]) if records else 0):
            acc = _smoothed([r["accuracy"][a] for r in records], window)
            acc_ax.plot(steps, acc, color=f"C{a + 1}", label=f"step {a + 1}")
        acc_ax.set_ylabel("top-1 agreement")
        acc_ax.set_xlabel("optimizer step")
        acc_ax.legend(loc="upper left", title="training-time-test", fontsize="small")
        lr_ax = acc_ax.twinx()
        lr_ax.plot(steps, [r["lr"] for r in records], color="0.5", linestyle="--", linewidth=0.8)
        lr_ax.set_ylabel("learning rate (dashed)")
        for prev, rec in zip(records, records[1:]):
            if rec["epoch"] != prev["epoch"]:
                for ax in (loss_ax, acc_ax):
                    ax.axvline(prev["step"] + 0.5, color="0.85", linestyle=":", linewidth=0.8)

    return _save(path, draw, (8, 6))


def acceptance_chart(report: Mapping[str, Any], path: str) -> bool:
    """Draw a ``speccache evaluate`` report to ``path``: each proposer's teacher-forced acceptance per drafted
    position, and, when the report has real decoding, its tau (tokens per target forward).

    Returns:
        False, drawing nothing, when matplotlib is not installed.
    """
    tf = report["teacher_forced"]
    spec = report.get("speculative")
    names = [name for name in LABELS if name in tf]

    def draw(figure: Any) -> None:
        axes = figure.subplots(1, 2 if spec else 1, squeeze=False, width_ratios=[3, 2] if spec else None)[0]
        k = len(tf["draft"]["per_step"])
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs = [p + 1 + (i - (len(names) - 1) / 2) * width for p in range(k)]
            label = f"{LABELS[name]} (mean accepted {tf[name]['mean_accepted']:.2f})"
            bars = axes[0].bar(xs, tf[name]["per_step"], width, color=f"C{i}", label=label)
            axes[0].bar_label(bars, fmt="%.2f", fontsize="x-small")
        axes[0].set_xticks(range(1, k + 1))
        axes[0].set_xlabel("drafted position (accepted given the earlier ones were)")
        axes[0].set_ylabel("acceptance, teacher-forced")
        axes[0].set_ylim(0, 1)
        cache = os.path.basename(os.path.normpath(str(report["cache"])))
        axes[0].set_title(f"teacher-forced on {cache}: {tf['draft']['chains']} chains of {k}")
        axes[0].legend(loc="upper right", fontsize="small")
        if spec:
            shown = ["greedy", *(n for n in names if n in spec)]
            taus = [spec[n]["tau"] for n in shown]
            colors = ["0.6", *(f"C{names.index(n)}" for n in shown[1:])]
            bars = axes[1].bar(range(len(shown)), taus, color=colors)
            axes[1].bar_label(bars, fmt="%.3f")
            names_shown = ["greedy (no draft)", *(LABELS[n] for n in shown[1:])]
            axes[1].set_xticks(range(len(shown)), names_shown, rotation=20)
            axes[1].set_ylabel("tau (tokens per target forward)")
            axes[1].set_ylim(0, max(taus) * 1.15)
            axes[1].set_title(f"greedy speculative decoding, {spec['prompts']} prompts")

    return _save(path, draw, (11 if spec else 7, 4.5))
