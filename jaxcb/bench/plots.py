"""PNG plots of the benchmark tools, drawn with matplotlib's Agg backend (no display needed).

plot_trace      a step trace (jaxcb.engine.step_trace): steps on x, the bucket's token slots on y,
                each real token coloured by its request (prefill pale, decode saturated),
                padding grey (a padded-batch baseline's batch padding darker than the
                bucket's rounding), the step's token budget as a line when the ITL
                controller set it; KV pages in use and preemptions below
plot_batching   the compare_batching benchmark: throughput, padding tokens, mean TTFT per mode
plot_sweep      the sweep_buckets benchmark: compile seconds, padding, throughput, latency per
                bucket set

The figures are built with the object-oriented API on an Agg canvas, never through pyplot,
so the caller's matplotlib backend and global state are left alone. matplotlib is an
optional dependency (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

WHITE = (1.0, 1.0, 1.0)
BUCKET_PAD = (0.82, 0.82, 0.82)  # slots the bucket rounds up
BATCH_PAD = (0.45, 0.45, 0.45)  # a padded batch's padding rows


MATPLOTLIB_MISSING = 'plots need matplotlib: pip install "jaxcb[bench]"'


def require_matplotlib() -> None:
    """A one-line ImportError (MATPLOTLIB_MISSING) unless matplotlib (an optional
    dependency) imports: scripts that will plot call it before they start their work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(MATPLOTLIB_MISSING) from None


def _figure(width: float, height: float, **kwargs: Any):
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), **kwargs)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, format="png")
    return path


def _palette(n: int) -> list[tuple[float, float, float]]:
    """n distinct saturated colours, never grey (grey means padding): hues spaced by the
    golden ratio so that neighbouring requests differ, alternating two brightnesses."""
    import colorsys

    return [
        colorsys.hsv_to_rgb((0.58 + i * 0.618034) % 1.0, 0.75, 0.9 if i % 2 else 0.7)
        for i in range(n)
    ]


def _pale(rgb: tuple[float, float, float], amount: float = 0.55) -> tuple[float, ...]:
    return tuple(c + (1.0 - c) * amount for c in rgb)


def trace_image(steps: list[dict[str, Any]]) -> tuple[np.ndarray, dict[str, int]]:
    """RGB image [slots, steps, 3] of a trace, and request id -> colour index."""
    height = max((s["bucket"] for s in steps), default=1)
    image = np.ones((height, len(steps), 3))
    index: dict[str, int] = {}
    for s in steps:
        for rid, _, _ in s["chunks"]:
            index.setdefault(str(rid), len(index))
    colours = _palette(len(index))
    for x, s in enumerate(steps):
        y = 0
        for rid, n, kind in s["chunks"]:
            rgb = colours[index[str(rid)]]
            image[y : y + n, x] = _pale(rgb) if kind == "prefill" else rgb
            y += n
        batch_pad = s.get("batch_padding", 0)
        image[y : y + batch_pad, x] = BATCH_PAD
        image[y + batch_pad : s["bucket"], x] = BUCKET_PAD
    return image, index


def plot_trace(
    trace: dict[str, Any],
    path: str | Path,
    *,
    first_step: int = 0,
    last_step: int | None = None,
    title: str | None = None,
) -> Path:
    """Draw steps [first_step, last_step) of a loaded trace ({"meta", "steps"}) to a PNG."""
    require_matplotlib()
    from matplotlib.patches import Patch

    from jaxcb.engine.step_trace import summarize_trace

    meta, all_steps = trace.get("meta", {}), trace["steps"]
    steps = all_steps[first_step:last_step]
    if not steps:
        raise ValueError(
            f"no steps in [{first_step}, {last_step}) of a {len(all_steps)}-step trace"
        )
    image, index = trace_image(steps)
    x0, x1 = first_step - 0.5, first_step + len(steps) - 0.5

    fig = _figure(12, 6.5, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    top.imshow(
        image,
        origin="lower",
        aspect="auto",
        interpolation="nearest",
        extent=(x0, x1, 0, image.shape[0]),
    )
    for b in meta.get("buckets", []):
        top.axhline(b, color="black", lw=0.4, alpha=0.25)
    top.set_ylabel("token slots of the step's bucket")
    s = summarize_trace(steps)
    mode = meta.get("batching", "continuous")
    top.set_title(
        title
        or f"{mode} batching: {len(index)} requests, {s['steps']} steps, padding "
        f"{s['padding_fraction']:.1%} of {s['token_slots']:,} slots"
    )
    legend = [
        Patch(color=_pale(_palette(1)[0]), label="prefill tokens (pale; a colour per request)"),
        Patch(color=_palette(1)[0], label="decode tokens"),
        Patch(color=BUCKET_PAD, label="padding: bucket rounding"),
    ]
    if s["batch_padding_tokens"]:
        legend.insert(2, Patch(color=BATCH_PAD, label="padding: padded batch"))
    xs = np.arange(first_step, first_step + len(steps))
    budgets = [st.get("token_budget", 0) for st in steps]
    target = meta.get("itl_target_ms")
    if all(budgets) and (target is not None or len(set(budgets)) > 1):
        # the ITL controller's budget per step (the floor included), over the buckets run
        (line,) = top.plot(xs, budgets, drawstyle="steps-mid", color="black", lw=1.0)
        line.set_label(
            "token budget" + (f" (ITL target {target:g} ms)" if target is not None else "")
        )
        legend.append(line)
        top.set_ylim(0, max(image.shape[0], *budgets) * 1.02)
    top.legend(handles=legend, loc="upper right", fontsize=8, framealpha=0.9)

    used = np.array([st["pages_used"] for st in steps])
    total = meta.get("kv_pages_total")
    bottom.fill_between(xs, used, step="mid", color="tab:blue", alpha=0.35, lw=0)
    bottom.plot(xs, used, drawstyle="steps-mid", color="tab:blue", lw=0.8)
    if total:
        bottom.axhline(total, color="black", lw=0.8, ls="--")
        bottom.set_ylim(0, total * 1.08)
    preempt = [
        (x, len(st["preempted"])) for x, st in zip(xs, steps, strict=True) if st["preempted"]
    ]
    if preempt:
        px, counts = zip(*preempt, strict=True)
        bottom.scatter(px, [used.max() * 1.02] * len(px), marker="v", color="tab:red", s=12)
        bottom.set_title(f"preemptions (red): {sum(counts)}", fontsize=8, loc="right")
    bottom.set_ylabel(f"KV pages used\n(of {total})" if total else "KV pages used")
    bottom.set_xlabel("engine step")
    bottom.set_xlim(x0, x1)
    return _save(fig, path)


def plot_batching(rows: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Bars per batching mode: output tok/s, padding tokens, mean TTFT."""
    fig = _figure(11, 3.8, layout="constrained")
    axes = fig.subplots(1, 3)
    names = [r["batching"] for r in rows]
    colours = ["tab:gray", "tab:orange", "tab:green", "tab:blue"][: len(rows)]
    panels = [
        ("output_tok_s", "output tokens / s", "{:,.0f}"),
        ("padding_tokens", "padding token slots", "{:,.0f}"),
        ("mean_ttft_s", "mean time to first token (s)", "{:.2f}"),
    ]
    for ax, (key, label, fmt) in zip(axes, panels, strict=True):
        values = [r[key] for r in rows]
        bars = ax.bar(names, values, color=colours)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.margins(y=0.15)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_sweep(rows: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Bars per bucket set: compile s, padding fraction, output tok/s, mean TTFT and ITL."""
    fig = _figure(15, 3.8, layout="constrained")
    axes = fig.subplots(1, 5)
    names = [r["name"] for r in rows]
    panels = [
        ("compile_seconds", "compile seconds", "{:.1f}"),
        ("padding_fraction", "padding fraction", "{:.1%}"),
        ("output_tok_s", "output tokens / s", "{:,.0f}"),
        ("mean_ttft_ms", "mean TTFT (ms)", "{:,.0f}"),
        ("mean_itl_ms", "mean ITL (ms)", "{:.1f}"),
    ]
    for ax, (key, label, fmt) in zip(axes, panels, strict=True):
        values = [r[key] for r in rows]
        bars = ax.bar(names, values, color="tab:blue")
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.margins(y=0.15)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)
