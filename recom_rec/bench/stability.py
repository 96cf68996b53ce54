"""Run-to-run stability of the sweep (issue 18: "the same decisions and ratios within 5% across two
runs on one machine"): `python -m recom_rec.bench --compare A.json B.json` on two sweep JSONs.

Per (point, phase) present in both: whether ours' measured choices are the same (the "choices"
record: forward kernels, launch order, backward path; JSONs from before it had only "choice"),
and how far the ratio (fbgemm ms / ours ms) moved: |ratio B / ratio A - 1|. Each peer's own
median ms is compared the same way, to tell which side of a moved ratio moved; so are the ratios
of the forwards replayed from CUDA graphs (device time, no host: how far the kernels' ratios
repeat), against fbgemm and against fbgemm unchecked."""
import json
import statistics
from typing import List, Tuple

RATIO_TOLERANCE = 0.05  # the bar: ratios within 5% across two runs


def _choices(row: dict):
    if "choices" in row:
        return row["choices"]
    return {"choice": row["choice"]} if row.get("choice") else None


def _moved(a: float, b: float) -> float:
    return abs(b / a - 1.0)


def compare(a: List[dict], b: List[dict]) -> dict:
    """The comparison of two sweeps' result rows (see the module's doc)."""
    rows_a = {(r["point"], r["phase"]): r for r in a}
    rows_b = {(r["point"], r["phase"]): r for r in b}
    common = [k for k in rows_a if k in rows_b]
    chosen = [k for k in common if _choices(rows_a[k]) is not None and _choices(rows_b[k]) is not None]
    differ = [(k, _choices(rows_a[k]), _choices(rows_b[k])) for k in chosen
              if _choices(rows_a[k]) != _choices(rows_b[k])]
    rated = [k for k in common if rows_a[k].get("ratio") and rows_b[k].get("ratio")]
    moved = sorted(((_moved(rows_a[k]["ratio"], rows_b[k]["ratio"]), k) for k in rated), reverse=True)
    peers = {}
    for peer in ("recom_rec", "fbgemm", "fbgemm_unchecked"):
        timed = [_moved(rows_a[k][f"{peer}_ms"], rows_b[k][f"{peer}_ms"]) for k in common
                 if rows_a[k].get(f"{peer}_ms") and rows_b[k].get(f"{peer}_ms")]
        if timed:
            peers[peer] = {"points": len(timed), "median": statistics.median(timed), "max": max(timed),
                           "within": sum(x <= RATIO_TOLERANCE for x in timed)}
    # the same from each peer's 10th percentile (sweeps from v20 on record it)
    rated_p10 = [k for k in common if rows_a[k].get("ratio_p10") and rows_b[k].get("ratio_p10")]
    moved_p10 = [_moved(rows_a[k]["ratio_p10"], rows_b[k]["ratio_p10"]) for k in rated_p10]
    device = {}
    for peer in ("fbgemm", "fbgemm_unchecked"):
        keys = ("recom_rec_graph_ms", f"{peer}_graph_ms")
        timed = [_moved(rows_a[k][keys[1]] / rows_a[k][keys[0]], rows_b[k][keys[1]] / rows_b[k][keys[0]])
                 for k in common if all(rows_a[k].get(x) and rows_b[k].get(x) for x in keys)]
        if timed:
            device[peer] = {"points": len(timed), "median": statistics.median(timed), "max": max(timed),
                            "within": sum(x <= RATIO_TOLERANCE for x in timed)}
    return {
        "ratios_p10": len(moved_p10),
        "ratio_p10_median": statistics.median(moved_p10) if moved_p10 else None,
        "ratio_p10_max": max(moved_p10) if moved_p10 else None,
        "ratios_p10_within": sum(x <= RATIO_TOLERANCE for x in moved_p10),
        "common": len(common), "with_choices": len(chosen), "choices_differ": differ,
        "ratios": len(rated),
        "ratio_median": statistics.median(x for x, _ in moved) if moved else None,
        "ratio_max": moved[0][0] if moved else None,
        "ratios_within": sum(x <= RATIO_TOLERANCE for x, _ in moved),
        "most_moved": [(k, rows_a[k]["ratio"], rows_b[k]["ratio"], x) for x, k in moved[:10]],
        "peers": peers,
        "device_ratios": device,
        "only_in_one": len(set(rows_a) ^ set(rows_b)),
    }


def format_comparison(c: dict, names: Tuple[str, str] = ("A", "B")) -> str:
    a, b = names
    lines = [f"stability, {a} vs {b}: {c['common']} (point, phase) pairs in both"
             + (f", {c['only_in_one']} in one only" if c["only_in_one"] else "")]
    lines.append(f"choices: {len(c['choices_differ'])} of {c['with_choices']} differ")
    for (point, phase), ca, cb in c["choices_differ"]:
        lines.append(f"  {point} {phase}: {_short(ca)} -> {_short(cb)}")
    if c["ratios"]:
        lines.append(f"ratios (fbgemm ms / ours ms): {c['ratios']} compared, |B/A - 1| median "
                     f"{100 * c['ratio_median']:.1f}%, max {100 * c['ratio_max']:.1f}%, within "
                     f"{100 * RATIO_TOLERANCE:.0f}%: {c['ratios_within']} of {c['ratios']}")
        for (point, phase), ra, rb, x in c["most_moved"]:
            if x > RATIO_TOLERANCE:
                lines.append(f"  {point} {phase}: {ra:.3f} -> {rb:.3f} (moved {100 * x:.1f}%)")
    if c.get("ratios_p10"):
        lines.append(f"ratios from each peer's 10th percentile: |B/A - 1| median {100 * c['ratio_p10_median']:.1f}%, "
                     f"max {100 * c['ratio_p10_max']:.1f}%, within {100 * RATIO_TOLERANCE:.0f}%: "
                     f"{c['ratios_p10_within']} of {c['ratios_p10']}")
    for peer, s in c.get("device_ratios", {}).items():
        lines.append(f"forward device-time ratios ({peer} graph ms / ours): {s['points']} compared, |B/A - 1| median "
                     f"{100 * s['median']:.2f}%, max {100 * s['max']:.2f}%, within {100 * RATIO_TOLERANCE:.0f}%: "
                     f"{s['within']} of {s['points']}")
    for peer, s in c["peers"].items():
        lines.append(f"{peer} ms: |B/A - 1| median {100 * s['median']:.1f}%, max {100 * s['max']:.1f}%, "
                     f"within {100 * RATIO_TOLERANCE:.0f}%: {s['within']} of {s['points']}")
    return "\n".join(lines)


def _short(choices) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(choices.items())) if isinstance(choices, dict) else str(choices)


def compare_files(path_a: str, path_b: str) -> str:
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    for path, data in ((path_a, a), (path_b, b)):
        if not data.get("results") or "phase" not in data["results"][0] or "point" not in data["results"][0]:
            raise SystemExit(f"{path}: not a sweep JSON (python -m recom_rec.bench --workloads sweep writes one)")
    text = format_comparison(compare(a["results"], b["results"]), (path_a, path_b))
    cut = [p for p, d in ((path_a, a), (path_b, b)) if d.get("meta", {}).get("complete") is False]
    return text + "".join(f"\n{p}: a run cut off before its end (its points so far)" for p in cut)
