"""The benchmark's table and chart."""
from collections import defaultdict
from typing import Dict, List, Optional, Tuple


def _index(results):
    table: Dict[tuple, Dict[str, dict]] = defaultdict(dict)
    for r in results:
        table[(r["workload"], r["phase"])][r["peer"]] = r
    return table


def speedup_pairs(peers: List[str]) -> List[Tuple[str, str]]:
    """(a, b) pairs whose ratio b ms / a ms ("a is x times as fast as b") the report shows: "recom_rec"
    against every other peer, each pinned backend ("recom_rec:cuda", ...) against fbgemm (or the
    first other peer)."""
    variants = [p for p in peers if p.startswith("recom_rec:")]
    others = [p for p in peers if p != "recom_rec" and p not in variants]
    bar = "fbgemm" if "fbgemm" in others else (others[0] if others else None)
    return [("recom_rec", p) for p in others] + ([(v, bar) for v in variants] if bar else [])


def speedup(mine: Optional[dict], theirs: Optional[dict], anchor: str = "recom_rec") -> Optional[float]:
    """How many times as fast ``mine`` (a row of ``anchor``) is as ``theirs``: their ms over ours. A
    peer timed beside ours in alternating rounds keeps ours' median of those rounds
    (``recom_rec_ms``), and the ratio takes that one, so a drift of the host or device between
    peers does not enter it."""
    if not mine or not theirs or not mine.get("ms") or not theirs.get("ms"):
        return None
    ours_ms = theirs.get("recom_rec_ms") if anchor == "recom_rec" else None
    return theirs["ms"] / (ours_ms or mine["ms"])


def format_table(meta: dict, results: List[dict], peers: List[str]) -> str:
    """ms per peer; the speed-up of "recom_rec" over every other peer, and of each pinned backend
    ("recom_rec:cuda", ...) over fbgemm (or the first other peer)."""
    pairs = speedup_pairs(peers)
    head = ["workload", "phase", *[f"{p} ms" for p in peers],
            *[f"x {b}" if a == "recom_rec" else f"{a.split(':')[1]} x {b}" for a, b in pairs], "BW % copy"]
    lines = [f"device: {meta['device']}  torch {meta['torch']}  copy ceiling {meta['copy_gbs']:.0f} GB/s"
             f"  recom_rec backend={meta['backend']}{'  (small workloads)' if meta['small'] else ''}"]
    rows = []
    for (workload, phase), by_peer in _index(results).items():
        cells = [workload, phase]
        for p in peers:
            r = by_peer.get(p, {})
            cells.append(f"{r['ms']:.3f}" if "ms" in r else ("error" if "error" in r else "-"))
        for a, b in pairs:
            ratio = speedup(by_peer.get(a), by_peer.get(b), a)
            cells.append(f"{ratio:.2f}" if ratio else "-")
        share = by_peer.get("recom_rec", {}).get("ceiling_share")
        cells.append(f"{100 * share:.0f}%" if share else "-")
        rows.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines.append(fmt.format(*head))
    lines.extend(fmt.format(*r) for r in rows)
    orders = [f"{r['workload']} {r['launch_order']}" for r in results if r.get("launch_order")]
    if orders:
        lines.append("CUDA forward launch order, measured per shape: " + ", ".join(orders))
    floors: Dict[str, List[str]] = defaultdict(list)
    for r in results:
        if r.get("floor_x"):
            alone = f" ({r['backward_only_floor_x']:.2f}x)" if r.get("backward_only_floor_x") else ""
            floors[f"{r['workload']} (floor {r['floor_ms']:.2f} ms)"].append(
                f"{r['peer']} {r['floor_x']:.2f}x{alone}")
    if floors:
        lines.append("backward to dense gradients, x its floor (each table's gradient written once and the output's "
                     "gradient read once, at the copy rate), the step with its forward (the backward alone): "
                     + "; ".join(f"{w}: {', '.join(v)}" for w, v in floors.items()))
    paths = [f"{r['workload']} {r['phase']} {r['backward_path']}" for r in results if r.get("backward_path")]
    if paths:
        lines.append("CUDA backward path, measured per shape: " + ", ".join(paths))
    padded = defaultdict(list)
    for r in results:
        if r.get("padded") and r["workload"] not in padded[r["peer"]]:
            padded[r["peer"]].append(r["workload"])
    for peer, workloads in padded.items():
        lines.append(f"{peer}: dims padded up to a multiple of 4 (its kernels need it; its output keeps the padding) "
                     f"in {', '.join(workloads)}")
    apart = sorted({f"{r['workload']} {r['peer']}" for r in results if r.get("timed_apart")})
    if apart:
        lines.append("timed alone, not beside ours (the two peers' tables do not fit together): " + ", ".join(apart))
    errors = [r for r in results if "error" in r]
    for r in errors:
        lines.append(f"error: {r['workload']} {r['phase']} {r['peer']}: {r['error']}")
    return "\n".join(lines)


def _workload_pairs(workload: str, peers: List[str]) -> List[Tuple[str, str]]:
    """The ratios a workload's panel shows: the speed-up pairs, or for the parameter-server
    workload each tier against the in-device table."""
    if "in-device table" in peers:
        return [(p, "in-device table") for p in peers if p != "in-device table"]
    return [(a, b) for a, b in speedup_pairs(peers) if a in peers and b in peers]


def _pair_label(a: str, b: str) -> str:
    return f"vs {b}" if a == "recom_rec" else f"{a.removeprefix('recom_rec:')} vs {b}"


def plot_results(results: List[dict], path: str, meta: dict) -> None:
    """A panel per workload: for each phase, a bar per peer of how many times as fast as that peer
    recom_rec is (its ms over ours; the PS workload: the in-device table's ms over the tier's).
    Bars start at the 1.0 line (as fast): up is faster, down slower, on a log-2 axis so that 2x and
    0.5x are as far from it and a 30x over torchrec does not flatten a 1.2x over fbgemm. 1200 px wide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    by_workload: Dict[str, Dict[str, Dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in results:
        if r.get("ms"):
            by_workload[r["workload"]][r["phase"]][r["peer"]] = r
    panels = []
    for workload, phases in by_workload.items():
        peers = sorted({p for ms in phases.values() for p in ms}, key=lambda p: (p != "recom_rec", p))
        pairs = _workload_pairs(workload, peers)
        if pairs:
            panels.append((workload, phases, pairs))
    labels = list(dict.fromkeys(_pair_label(a, b) for _, _, pairs in panels for a, b in pairs))
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    cols = min(3, max(1, len(panels)))
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(12, 1.0 + 3.3 * rows), squeeze=False)
    for ax, (workload, phases, pairs) in zip(axes.flat, panels):
        names = list(phases)
        width = 0.8 / len(pairs)
        low, high = 0.5, 2.0
        for i, (a, b) in enumerate(pairs):
            xs, ys = [], []
            for k, phase in enumerate(names):
                ratio = speedup(phases[phase].get(a), phases[phase].get(b), a)
                if ratio:
                    xs.append(k - 0.4 + (i + 0.5) * width)
                    ys.append(ratio)
            label = _pair_label(a, b)
            bars = ax.bar(xs, [y - 1 for y in ys], width * 0.92, bottom=1, color=colors[label], label=label)
            ax.bar_label(bars, labels=[f"{y:.2g}x" for y in ys], fontsize=8, padding=1)
            low, high = min([low, *ys]), max([high, *ys])
        ax.axhline(1.0, color="black", linewidth=1.2)
        ax.set_yscale("log", base=2)
        ax.set_ylim(low / 1.6, high * 1.6)
        ax.yaxis.set_major_locator(LogLocator(base=2))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x" if y >= 1 else f"1/{1 / y:g}x"))
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace(", ", "\n").replace("_", "_\n") for n in names], fontsize=9)
        ax.set_title(workload, fontsize=11)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("times as fast (their ms / ours)", fontsize=9)
    small = "  (small workloads)" if meta.get("small") else ""
    fig.suptitle(f"recom_rec against its peers on {meta['device']}, torch {meta['torch']}{small}: "
                 "above the line recom_rec is faster", fontsize=11)
    top = 1 - 0.75 / (1.0 + 3.3 * rows)  # room for the title and the legend (inches over the height)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[label]) for label in labels]
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, top + 0.35 / (1.0 + 3.3 * rows)),
               fontsize=9, ncol=min(4, max(1, len(labels))), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_peers(title: str, rows: List[Dict], peers=("recom_rec", "fbgemm", "torchrec")) -> str:
    """One line per workload and phase: each peer's median ms, ours' speed-up over each other peer
    (in-run ratios), our forward's GB/s where counted, and whether each peer's output equalled ours."""
    others = peers[1:]
    width = {p: max(10, len(p) + 1) for p in peers}  # each column as wide as its peer's name
    lines = [title + ": median ms; ours' speed-up over each peer in this run",
             f"{'workload':<16}{'phase':<9}{'ids':>10}  " + "".join(f"{p:>{width[p]}}" for p in peers)
             + "".join(f"{'x ' + p:>{width[p] + 2}}" for p in others) + f"{'GB/s':>8}  identical"]
    by = {(r["workload"], r["phase"], r["peer"]): r for r in rows if "ms" in r}
    for workload, phase in dict.fromkeys((r["workload"], r["phase"]) for r in rows):
        ours = by.get((workload, phase, peers[0]))
        if ours is None:
            continue
        found = [by.get((workload, phase, p)) for p in peers]
        cells = "".join(f"{r['ms']:>{width[p]}.3f}" if r else f"{'-':>{width[p]}}" for p, r in zip(peers, found))
        ratios = "".join(f"{speedup(ours, r):>{width[p] + 1}.2f}x" if r else f"{'-':>{width[p] + 2}}"
                         for p, r in zip(others, found[1:]))
        same = ",".join(f"{p}={r['identical']}" for p, r in zip(others, found[1:]) if r and "identical" in r)
        gbs = f"{ours['gbs']:>8.0f}" if "gbs" in ours else f"{'':>8}"
        lines.append(f"{workload:<16}{phase:<9}{ours['ids']:>10}  {cells}{ratios}{gbs}  {same}")
    lines += [f"error: {r['workload']} {r['phase']} {r['peer']}: {r['error']}" for r in rows if "error" in r]
    return "\n".join(lines)
