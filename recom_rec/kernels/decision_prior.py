"""A choice for a shape never measured on this machine, predicted from decisions recorded on
others of its GPU architecture (issue 51: the first calls run the likely winner, not the losers).

The tuners (launch_tuner.py) measure each new shape's candidates on its first calls. With a prior
for the GPU's architecture (``priors/sm_<major><minor>.json``, shipped with the package), an unseen
shape instead starts on the choice its nearest recorded shapes chose, and that choice and the
runner-up are measured first (two candidates, not up to seven), the others against the winner
afterwards, paced: the first calls cost about what the predicted choice alone costs, a wrong
prediction is still corrected by measurement, and so is a candidate the vote never ranks.
Without a prior for the architecture nothing changes (every candidate measured, from the
tuner's default). A candidate the voting shapes were never measured against (one a tuner offers
since the prior was fitted: decision files keep what each decision was measured among) is
measured too: the vote cannot speak for it (v55: a path offered on wider rows went untried).

The model is k nearest neighbours over the shape class (decision_cache.shape_class): the
distance is over the log2 of its sizes (features, batch, dims, lookups, table bytes); its other
fields (dtypes, weighted, optimizer, which kernels cover it) must match exactly. The k nearest
vote, each by 1 / (1 + distance); the choices are ranked by their votes.

``RECOM_REC_PRIOR`` overrides the shipped prior: ``off`` measures every candidate (as when recording
the decisions a prior is fitted from), a file's path uses that prior (one just fitted, say).

A prior is fitted from decision files (``RECOM_REC_CACHE``'s ``decisions.json``, written while
the benchmarks' sweep and random layouts ran with that variable set):
``python -m recom_rec.kernels.decision_prior fit FILE... --arch sm_90 --out PRIOR.json``
(the ``gpu_session.sh`` stage ``prior`` does it on the GPU machine).
"""
import argparse
import json
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .decision_cache import _plain

PRIOR_DIR = Path(__file__).resolve().parent / "priors"
ENV = "RECOM_REC_PRIOR"
VERSION = 1
# The sizes compared on a log2 scale; every other field of a shape class must match exactly.
SIZES = ("num_features", "batch_bucket", "total_dim", "max_dim", "lookups_bucket", "weight_bytes_bucket")
NEIGHBOURS = 5

Point = Tuple[Dict[str, object], str]  # (a shape class's fields, the choice recorded for it)


def shape_fields(shape) -> Dict[str, object]:
    """A tuner key's fields by name, nested tuples flattened (the weights' address left out, as in
    the decision cache's shape classes); unnamed members are named by position."""
    fields: Dict[str, object] = {}

    def add(value, name: str) -> None:
        if isinstance(value, dict):
            for key, member in value.items():
                add(member, key)
        elif isinstance(value, list):
            for i, member in enumerate(value):
                add(member, f"{name}.{i}")
        else:
            fields[name] = value

    add(shape if isinstance(shape, (dict, list)) else _plain(shape), "")  # (a class read back from JSON: plain)
    return fields


def _kind_and_sizes(fields: Dict[str, object]) -> Tuple[tuple, Tuple[float, ...]]:
    """A shape class's kind (its fields other than SIZES, which must match for two shapes to be
    compared, and which of SIZES it has) and its log2 sizes in SIZES' order, over which the
    distance between two shapes of one kind is Euclidean."""
    kind = tuple(sorted((k, v) for k, v in fields.items() if k not in SIZES)) + \
        tuple(k for k in SIZES if k in fields)
    return kind, tuple(math.log2(1 + float(fields[k])) for k in SIZES if k in fields)


class DecisionPrior:
    """Recorded decisions per tuner name; ``ranked`` predicts for a new shape. ``offered``, per
    tuner and aligned with its points: the names of the candidates each decision was measured
    among, or None where the decision file did not say (files written before it was kept)."""

    def __init__(self, points: Dict[str, List[Point]],
                 offered: Optional[Dict[str, List[Optional[List[str]]]]] = None) -> None:
        self.points = points
        self.offered = offered or {}
        # A new shape class is predicted on its first call, which a user waits for (a serving
        # stream meets dozens in its first 100 requests): comparing it with every recorded point
        # field by field, in ranked and again in unmeasured, took ~1 ms a shape on a 2-core CI
        # machine. So the points are grouped by kind once and a shape's neighbours found once:
        # ~0.1 ms (perf-notes v67).
        self._by_kind: Dict[str, Dict[tuple, List[Tuple[int, Tuple[float, ...]]]]] = {}
        self._near: Dict[Tuple[str, tuple, Tuple[float, ...]], List[Tuple[float, int]]] = {}

    def _kinds(self, tuner: str) -> Dict[tuple, List[Tuple[int, Tuple[float, ...]]]]:
        kinds = self._by_kind.get(tuner)
        if kinds is None:
            kinds = {}
            for index, (recorded, _) in enumerate(self.points.get(tuner, ())):
                kind, sizes = _kind_and_sizes(recorded)
                kinds.setdefault(kind, []).append((index, sizes))
            self._by_kind[tuner] = kinds
        return kinds

    def _nearest(self, tuner: str, shape) -> List[Tuple[float, int]]:
        """(distance, index) of the NEIGHBOURS recorded shapes of ``shape``'s kind nearest to it,
        ties in the points' order."""
        kind, sizes = _kind_and_sizes(shape_fields(shape))
        found = self._near.get((tuner, kind, sizes))
        if found is None:
            near = [(math.dist(sizes, recorded), index)
                    for index, recorded in self._kinds(tuner).get(kind, ())]
            near.sort(key=lambda pair: pair[0])
            found = self._near[(tuner, kind, sizes)] = near[:NEIGHBOURS]
        return found

    def ranked(self, tuner: str, shape) -> List[str]:
        """Choice names, the most likely winner first; empty when no recorded shape is of its kind."""
        votes: Dict[str, float] = {}
        for distance, index in self._nearest(tuner, shape):
            choice = self.points[tuner][index][1]
            votes[choice] = votes.get(choice, 0.0) + 1.0 / (1.0 + distance)
        return sorted(votes, key=lambda choice: -votes[choice])

    def unmeasured(self, tuner: str, shape, names) -> List[str]:
        """Those of ``names`` (a shape's candidates now) that one of the recorded shapes voting for
        it was decided without: the vote cannot speak for them (a candidate added since the prior
        was fitted), so the tuner measures them too. Empty where the record does not say."""
        offered = self.offered.get(tuner)
        if not offered:
            return []
        missing = []
        for _, index in self._nearest(tuner, shape):
            among = offered[index] if index < len(offered) else None
            if among is not None:
                missing += [n for n in names if n not in among and n not in missing]
        return missing

    def to_json(self, arch: str) -> str:
        data = {"version": VERSION, "arch": arch,
                "tuners": {t: [[fields, choice] for fields, choice in pts] for t, pts in self.points.items()}}
        if self.offered:
            data["offered"] = self.offered
        return json.dumps(data, indent=None, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DecisionPrior":
        data = json.loads(text)
        if data.get("version") != VERSION:
            raise ValueError(f"decision prior version {data.get('version')} (this build reads {VERSION})")
        return cls({t: [(fields, choice) for fields, choice in pts] for t, pts in data["tuners"].items()},
                   data.get("offered"))


def arch_of(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def active_prior(device: torch.device) -> Optional[DecisionPrior]:
    """The prior the tuners use on ``device``: the shipped one of its architecture, unless
    ``RECOM_REC_PRIOR`` says ``off`` or names a prior file (read at each call: tools set it late)."""
    setting = os.environ.get(ENV, "")
    if setting == "off":
        return None
    if setting:
        return _read_prior(setting)
    arch = arch_of(device)
    return _read_prior(str(PRIOR_DIR / f"{arch}.json")) if arch is not None else None


@lru_cache(maxsize=None)
def _read_prior(path: str) -> Optional[DecisionPrior]:
    """The prior in ``path``, or None when there is no such file."""
    return DecisionPrior.from_json(Path(path).read_text()) if Path(path).exists() else None


def fit(files: Iterable[str], arch: str) -> DecisionPrior:
    """The decisions of ``files`` (decision_cache files) measured on ``arch``: one point per shape
    class and tuner, the choice most files recorded for it (ties: the first file's)."""
    from .decision_cache import read_decisions

    counts: Dict[Tuple[str, str], Dict[str, int]] = {}
    among: Dict[Tuple[str, str], List[str]] = {}  # (the candidates of the first file that kept them)
    for path in files:
        entries, offered = read_decisions(Path(path))
        for context, tuners in entries.items():
            if f"|{arch}|" not in f"|{context}|":
                continue
            for tuner, classes in tuners.items():
                for key, choice in classes.items():
                    tally = counts.setdefault((tuner, key), {})
                    tally[choice] = tally.get(choice, 0) + 1
                    names = offered.get(context, {}).get(tuner, {}).get(key)
                    if names is not None:
                        among.setdefault((tuner, key), names)
    points: Dict[str, List[Point]] = {}
    offered_of: Dict[str, List[Optional[List[str]]]] = {}
    for (tuner, key), tally in sorted(counts.items()):
        choice = max(tally, key=lambda c: tally[c])  # (dicts keep insertion order: ties go to the first)
        points.setdefault(tuner, []).append((shape_fields(json.loads(key)), choice))
        offered_of.setdefault(tuner, []).append(among.get((tuner, key)))
    return DecisionPrior(points, {t: o for t, o in offered_of.items() if any(n is not None for n in o)})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recom_rec.kernels.decision_prior",
                                     description="Fit a decision prior from RECOM_REC_CACHE decision files.")
    sub = parser.add_subparsers(dest="command", required=True)
    fit_args = sub.add_parser("fit", help="write a prior from decision files")
    fit_args.add_argument("files", nargs="+")
    fit_args.add_argument("--arch", required=True, help="e.g. sm_90: the contexts measured on it")
    fit_args.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    prior = fit(args.files, args.arch)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(prior.to_json(args.arch))
    counts = ", ".join(f"{t}: {len(p)}" for t, p in prior.points.items()) or "none"
    print(f"wrote {args.out}: decisions of {args.arch} per tuner: {counts}")


if __name__ == "__main__":
    main()
