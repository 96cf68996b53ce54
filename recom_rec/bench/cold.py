"""``--phases cold``: what a user's first calls cost, per peer, each in a fresh process.

The other phases time a peer after ``timing.settle`` (its tuners decided); a model's first steps
and a server's first requests run before that, while the kernels are compiled and the measured
choices are on trial (issue 51). Here each (workload, peer, phase) runs in a new Python process:
it builds the peer, makes the input, then times every call from the first, one after another as a
user makes them (CUDA events around each call on the GPU, queued back to back; the host's clock
on the CPU), and reports the summed time of calls 1, 1-10, 1-100 and 1-N. With ``RECOM_REC_CACHE``
set in the environment the children read (and write) its decision file, the "second process with
the cache" of the issue. Drawn layouts (``--workloads random``) are drawn again in each child from
the run's seed and count, so every process gets the same layout.
"""
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

SPANS = (1, 10, 100, 1000)


def _child(workload: str, peer_name: str, phase: str, device_name: str, calls: int, small: bool,
           backend: str, draw: Optional[Tuple[int, int]] = None) -> Dict[str, float]:
    from .peers import make_peer
    from .workloads import DRAWN, get_workload

    if draw is not None:
        from .random_layouts import random_workloads

        DRAWN.update((w.name, w) for w in random_workloads(draw[0], draw[1], small))
    device = torch.device(device_name)
    w = get_workload(workload, small)
    kjt = w.make_input(device)
    optimizer = "none" if phase == "forward" else "sgd"
    peer = make_peer(peer_name, w, device, optimizer if not peer_name.startswith("fbgemm") else "sgd", backend)
    grad = torch.ones(w.batch_size, peer.output_width, device=device)

    def call():
        if phase == "forward":
            with torch.no_grad():
                peer.forward(kjt)
        else:
            peer.train_step(kjt, grad)

    times: List[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = []
        for _ in range(calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        # back to back: each call's span from its start to its end event, host gaps included
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(calls):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return {str(n): sum(times[:n]) for n in SPANS if n < calls} | {str(calls): sum(times), "calls": calls}


def run_cold(workloads: List[str], peers: List[str], phases: List[str], device: torch.device, small: bool,
             calls: int = 1000, backend: str = "auto", draw: Optional[Tuple[int, int]] = None) -> List[Dict]:
    """A row per (workload, peer, phase): the summed ms of its first 1, 10, 100 and ``calls`` calls,
    each measured in a fresh process. ``draw``: the (seed, count) of the drawn layouts among
    ``workloads`` (random_layouts.random_workloads)."""
    from tqdm import tqdm

    rows = []
    env = {**os.environ}
    # (its dense-gradient step is not comparable: torchrec runs the forward alone)
    jobs = [(w, phase, peer) for w in workloads for phase in phases for peer in peers
            if phase == "forward" or peer != "torchrec"]
    for workload, phase, peer in tqdm(jobs, desc="cold: fresh processes", unit="process"):
        args = [sys.executable, "-m", "recom_rec.bench.cold", workload, peer, phase, str(device), str(calls),
                "1" if small else "0", backend, f"{draw[0]}:{draw[1]}" if draw else "-"]
        done = subprocess.run(args, capture_output=True, text=True, env=env)
        row = {"workload": workload, "peer": peer, "phase": f"cold {phase}"}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            row["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        else:
            row["cumulative_ms"] = json.loads(lines[-1])
        rows.append(row)
        # each row as its process ends: a run stopped by a time limit still shows the ones done
        ours = next((r.get("cumulative_ms", {}) for r in rows if r["peer"] == "recom_rec"
                     and (r["workload"], r["phase"]) == (workload, row["phase"])), {})
        tqdm.write(_row_line(row, ours), file=sys.stdout)
        sys.stdout.flush()
    return rows


def format_cold(rows: List[Dict]) -> str:
    lines = ["cold: the summed ms of each peer's first calls, each peer in a fresh process; ours' speed-up in ()"]
    by = {(r["workload"], r["phase"], r["peer"]): r for r in rows}
    for workload, phase in dict.fromkeys((r["workload"], r["phase"]) for r in rows):
        ours = by.get((workload, phase, "recom_rec"), {}).get("cumulative_ms", {})
        lines += [_row_line(row, ours) for (w, p, _), row in by.items() if (w, p) == (workload, phase)]
    return "\n".join(lines)


def _row_line(row: Dict, ours: Dict[str, float]) -> str:
    """One (workload, phase, peer) row: its summed ms per span, with ours' speed-up where ``ours``
    (recom_rec's cumulative_ms on that workload and phase) has the span."""
    head = f"{row['workload']:<14}{row['phase']:<14}{row['peer']:<18}"
    if "error" in row:
        return head + f"error: {row['error']}"
    cells = []
    for span, ms in row["cumulative_ms"].items():
        if span == "calls":
            continue
        ratio = f" ({ms / ours[span]:.2f}x)" if row["peer"] != "recom_rec" and ours.get(span) else ""
        cells.append(f"1-{span}: {ms:.2f}{ratio}")
    return head + "  ".join(cells)


def summarize_cold(rows: List[Dict], names: List[str], peers: List[str]) -> str:
    """Per peer and phase, over the layouts ``names``: ours' speed-up on the summed first 100 calls
    (or all of them, when fewer ran): the share at or above 1.0x, the geomean and the worst."""
    from .random_layouts import ratio_summary

    lines = []
    by = {(r["workload"], r["phase"], r["peer"]): r.get("cumulative_ms") for r in rows}
    for peer in peers:
        for phase in dict.fromkeys(r["phase"] for r in rows):
            ratios = []
            for name in names:
                ours, theirs = by.get((name, phase, "recom_rec")), by.get((name, phase, peer))
                if ours and theirs:
                    span = "100" if "100" in ours and "100" in theirs else str(min(ours["calls"], theirs["calls"]))
                    if span in ours and span in theirs:
                        ratios.append((theirs[span] / ours[span], name))
            if ratios:
                lines.append(ratio_summary(f"drawn layouts, {phase} (first 100 calls) x {peer}", ratios))
    return "\n".join(lines)


if __name__ == "__main__":  # a child of run_cold: one peer, one phase, in this fresh process
    workload, peer, phase, device, calls, small, backend, draw = sys.argv[1:9]
    drawn = tuple(int(x) for x in draw.split(":")) if draw != "-" else None
    print(json.dumps(_child(workload, peer, phase, device, int(calls), small == "1", backend, drawn)))
