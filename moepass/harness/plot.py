"""PNG charts of bench and converge results. matplotlib is optional: without it these return False."""

from __future__ import annotations

from .parity import moving_average


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def bench_chart(result: dict, path: str) -> bool:
    """Bars of median tokens/s per variant (whiskers: min and max over timed steps), labelled with speedups."""
    plt = _pyplot()
    if plt is None:
        return False
    ok = [v for v in result["variants"] if v["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(ok) + 2), 4.2))
    med = [v["tokens_per_s_median"] for v in ok]
    err = [[m - v["tokens_per_s_min"] for m, v in zip(med, ok)], [v["tokens_per_s_max"] - m for m, v in zip(med, ok)]]
    colors = ["#999999" if v["name"] == result.get("baseline") else "#3b75af" for v in ok]
    bars = ax.bar([v["name"] for v in ok], med, yerr=err, capsize=4, color=colors)
    for bar, v in zip(bars, ok):
        ax.annotate(f"{v['speedup_vs_baseline']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    hw = result["hardware"]
    where = hw.get("gpu") or hw.get("cpu") or hw["device"]
    ax.set_ylabel(f"tokens/s (total over {hw['world_size']} rank(s))")
    ax.set_title(f"moepass bench: {where}, baseline {result.get('baseline')}", fontsize=9)
    failed = [v["name"] for v in result["variants"] if v["status"] != "ok"]
    if failed:
        ax.text(0.99, 0.98, "failed: " + ", ".join(failed), transform=ax.transAxes, ha="right", va="top",
                fontsize=8, color="firebrick")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def loss_curves(result: dict, path: str) -> bool:
    """Training loss per step (raw, faint) and its moving average for each variant; relative gap below."""
    plt = _pyplot()
    if plt is None:
        return False
    fig = loss_figure(result, plt)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def loss_figure(result: dict, plt):
    """The figure loss_curves saves: losses on top (y range past the first steps' fall), the gap below."""
    window = result["window"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    curves = {n: v["loss"] for n, v in result["variants"].items() if v.get("loss")}
    colors = {name: f"C{i}" for i, name in enumerate(curves)}  # one colour per variant in both panels
    settled = []  # the moving averages past the first steps' fall (12 -> 1.3 would flatten every curve)
    for name, loss in curves.items():
        top.plot(range(1, len(loss) + 1), loss, alpha=0.25, linewidth=0.8, color=colors[name])
        w = min(window, len(loss))
        averaged = moving_average(loss, w)
        top.plot(range(w, len(loss) + 1), averaged, color=colors[name], label=name)
        settled += averaged[len(averaged) // 10:]
    if settled:
        low, high = min(settled), max(settled)
        pad = 0.15 * (high - low) or 0.05 * abs(high) or 0.1
        top.set_ylim(low - pad, high + pad)
    top.set_ylabel("training loss")
    top.legend()
    top.set_title(f"moepass converge: same seed and batches; moving average over {window} steps "
                  "(y range from the tenth of steps on)", fontsize=9)
    base = curves.get(result["baseline"])
    for name, loss in curves.items():
        if name == result["baseline"] or base is None:
            continue
        w = min(window, len(loss), len(base))
        mb, mc = moving_average(base, w), moving_average(loss, w)
        bottom.plot(range(w, w + len(mb)), [100 * abs(c - b) / b for b, c in zip(mb, mc)], label=name,
                    color=colors[name])
    bottom.axhline(100 * result["tolerance"], color="firebrick", linestyle="--", linewidth=0.8, label="tolerance")
    bottom.set_ylabel("|gap| %")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    return fig
