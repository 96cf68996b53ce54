"""The benchmark's table and chart."""
from collections import defaultdict
from typing import Dict, List


def _index(results):
    table: Dict[tuple, Dict[str, dict]] = defaultdict(dict)
    for r in results:
        table[(r["workload"], r["phase"])][r["peer"]] = r
    return table


def format_table(meta: dict, results: List[dict], peers: List[str]) -> str:
    """ms per peer; the speed-up of "recom_rec" over every other peer, and of each pinned backend
    ("recom_rec:cuda", ...) over fbgemm (or the first other peer)."""
    variants = [p for p in peers if p.startswith("recom_rec:")]
    others = [p for p in peers if p != "recom_rec" and p not in variants]
    bar = "fbgemm" if "fbgemm" in others else (others[0] if others else None)
    pairs = [("recom_rec", p) for p in others] + ([(v, bar) for v in variants] if bar else [])
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
            mine, theirs = by_peer.get(a, {}).get("ms"), by_peer.get(b, {}).get("ms")
            cells.append(f"{theirs / mine:.2f}" if mine and theirs else "-")
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
    paths = [f"{r['workload']} {r['phase']} {r['backward_path']}" for r in results if r.get("backward_path")]
    if paths:
        lines.append("CUDA backward path, measured per shape: " + ", ".join(paths))
    errors = [r for r in results if "error" in r]
    for r in errors:
        lines.append(f"error: {r['workload']} {r['phase']} {r['peer']}: {r['error']}")
    return "\n".join(lines)


def plot_results(results: List[dict], path: str, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = _index(results)
    keys = list(table)
    peers = sorted({r["peer"] for r in results}, key=lambda p: (p != "recom_rec", p))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys)), 4))
    width = 0.8 / max(1, len(peers))
    for i, p in enumerate(peers):
        xs = [k + i * width for k in range(len(keys))]
        ys = [table[key].get(p, {}).get("ms", 0) for key in keys]
        ax.bar(xs, ys, width, label=p)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels([f"{w}\n{ph}" for w, ph in keys], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms (median, log scale)")
    ax.set_title(f"recom_rec vs peers on {meta['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
