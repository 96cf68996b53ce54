"""A bounded soak under faults (about 5 minutes on the GPU machine; shorter with --serve-seconds).

Serving: a float and a quantized (INT8) EmbeddingBagCollection, 4 request threads (each on its own
CUDA stream), batch sizes drawn from 1 to 1024 with a long tail, 1% of the batches with a bad id or
lengths that do not add up. A request is the forward, then the module's ``check_inputs()``. Every
bad batch must raise in its own request and only there, no good batch may raise, a sample of
outputs must equal the torch backend's, and GPU and host memory must stay flat after warm-up.

Training: a table in the parameter-server tier (prefetch 2) on a 3-master ``redis+cluster://``
cluster (append-only files on), one master killed (SIGKILL) and restarted mid-run. Afterwards no
row is lost: outputs and tables are the bits of the same training with every table in HBM.

    python3 tools/soak.py [--serve-seconds 150] [--train-steps 120] [--device cuda]
Exits non-zero when a check fails; prints the figures either way.
"""
import argparse
import copy
import math
import os
import random
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from tqdm import tqdm

import recom_rec
from recom_rec import ps
from recom_rec.bench.redis_servers import RedisClusterProcesses
from recom_rec.ops.input_check import pending_report_count

# Mixed dims, tables around and above the L2, shared by both models.
SERVE_TABLES = [(2_000_000, 64), (500_000, 128), (100_000, 32), (50_000, 16), (1_000_000, 96), (1_000, 8)]
SERVE_BAG = 6  # ids a bag at most
TOLERANCE = {"float": 1e-5, "int8": 1e-4}  # sampled outputs against the torch backend's


def _serving_models(device):
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=n, feature_names=[f"f{i}"])
              for i, (n, d) in enumerate(SERVE_TABLES)]
    float_ebc = recom_rec.EmbeddingBagCollection(tables, device=device).eval()
    float_ref = copy.deepcopy(float_ebc)
    float_ref.backend = "torch"
    quant_src = copy.deepcopy(float_ebc)
    quant_src.qconfig = torch.quantization.QConfig(
        activation=torch.quantization.PlaceholderObserver.with_args(dtype=torch.float),
        weight=torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8))
    quant = recom_rec.quant.EmbeddingBagCollection.from_float(quant_src)
    quant_ref = copy.deepcopy(quant)
    quant_ref.backend = "torch"
    return {"float": (float_ebc, float_ref), "int8": (quant, quant_ref)}


def _batch_size(rng: random.Random) -> int:
    """1 to 1024, log-uniform: most requests small, a long tail of large ones."""
    return min(1024, int(math.exp(rng.uniform(0, math.log(1024)))))


def _request(rng: random.Random, device, fault: str):
    """A KJT, and the error it must raise (a regex) or None. ``fault``: "", "id" or "lengths"."""
    batch = _batch_size(rng)
    lengths = torch.randint(0, SERVE_BAG + 1, (len(SERVE_TABLES) * batch,))
    values = torch.cat([torch.randint(0, n, (int(lengths[i * batch:(i + 1) * batch].sum()),))
                        for i, (n, _) in enumerate(SERVE_TABLES)])
    expect = None
    if fault == "id" and values.numel():
        at = rng.randrange(values.numel())
        values[at] = -1 - rng.randrange(5) if rng.random() < 0.5 else 10_000_000 + rng.randrange(100)
        expect = r"id -?\d+ at batch index \d+ is"
    elif fault == "lengths":
        lengths[rng.randrange(lengths.numel())] += 1 + rng.randrange(3)  # more than the values hold
        expect = r"lengths add up"
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(len(SERVE_TABLES))], values=values, lengths=lengths)
    return kjt.to(device, non_blocking=True), expect


def _host_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def serve(device, seconds: float, threads: int, bad_fraction: float, sample_fraction: float) -> list:
    import re

    models = _serving_models(device)
    lock = threading.Lock()
    counts = {"requests": 0, "bad": 0, "bad_raised_own": 0, "sampled": 0}
    worst: dict = {}
    problems: list = []
    warm = threading.Event()
    memory = {}
    deadline = time.monotonic() + seconds

    def worker(seed):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else nullcontext()):
            while time.monotonic() < deadline and len(problems) < 20:
                kind = rng.choice(list(models))
                module, reference = models[kind]
                fault = "" if rng.random() >= bad_fraction else rng.choice(["id", "lengths"])
                kjt, expect = _request(rng, device, fault)
                try:
                    out = module(kjt).values()
                    module.check_inputs()
                    raised = None
                except ValueError as e:
                    raised = str(e)
                with lock:
                    counts["requests"] += 1
                    counts["bad"] += expect is not None
                if expect is None and raised is not None:
                    problems.append(f"{kind}: a good batch raised: {raised}")
                elif expect is not None:
                    if raised is None:
                        problems.append(f"{kind}: a bad batch ({fault}) raised nothing")
                    elif not re.search(expect, raised):
                        problems.append(f"{kind}: a bad batch ({fault}) raised another error: {raised}")
                    else:
                        with lock:
                            counts["bad_raised_own"] += 1
                elif rng.random() < sample_fraction:
                    expected = reference(kjt).values()
                    diff = (out.float() - expected.float()).abs().max().item() if out.numel() else 0.0
                    # INT8: the kernel dequantizes with fbgemm's GPU arithmetic (fused multiply-adds),
                    # the torch backend with its CPU one: within a small part of a quantization step.
                    tol = TOLERANCE[kind]
                    if not torch.allclose(out.float(), expected.float(), rtol=tol, atol=tol):
                        problems.append(f"{kind}: output differs from the torch backend's by {diff:.3g}")
                    with lock:
                        counts["sampled"] += 1
                        worst[kind] = max(worst.get(kind, 0.0), diff)

    workers = [threading.Thread(target=worker, args=(s,)) for s in range(threads)]
    for w in workers:
        w.start()
    start = time.monotonic()
    with tqdm(total=int(seconds), desc="serving", unit="s", file=sys.stdout, mininterval=10) as bar:
        while any(w.is_alive() for w in workers):
            time.sleep(1)
            elapsed = time.monotonic() - start
            if int(elapsed) % 10 == 0:
                bar.n = min(int(elapsed), int(seconds))
                bar.refresh()
            if not warm.is_set() and elapsed > seconds * 0.2:  # every shape class seen, tuners settled
                warm.set()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                memory["warm"] = (torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0,
                                  _host_rss_mib(), counts["requests"])
    for w in workers:
        w.join()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    memory["end"] = (torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0,
                     _host_rss_mib(), counts["requests"])
    elapsed = time.monotonic() - start
    print(f"serving: {counts['requests']} requests in {elapsed:.0f} s ({counts['requests'] / elapsed:.0f}/s) on "
          f"{threads} threads, {counts['bad']} bad, {counts['bad_raised_own']} of them raised in their own request, "
          f"{counts['sampled']} outputs checked against the torch backend (largest difference: "
          + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())) + ")")
    if "warm" in memory:
        (g0, h0, n0), (g1, h1, n1) = memory["warm"], memory["end"]
        print(f"memory after warm-up ({n0} requests) -> end ({n1}): GPU allocated {g0:.1f} -> {g1:.1f} MiB, "
              f"host RSS {h0:.0f} -> {h1:.0f} MiB")
        if g1 - g0 > 64:
            problems.append(f"GPU memory grew by {g1 - g0:.1f} MiB after warm-up")
        if h1 - h0 > 256:
            problems.append(f"host memory grew by {h1 - h0:.0f} MiB after warm-up")
    if pending_report_count():
        problems.append(f"{pending_report_count()} input reports left unraised")
    if counts["bad_raised_own"] != counts["bad"]:
        problems.append(f"{counts['bad'] - counts['bad_raised_own']} bad batches not raised in their own request")
    return problems


# ---- training: the PS tier on a cluster whose master is killed mid-run ---------------------------
TRAIN_BIG, TRAIN_SMALL, TRAIN_BATCH = 200_000, 1_000, 512


def _train_tables():
    return [EmbeddingBagConfig(name="big", embedding_dim=64, num_embeddings=TRAIN_BIG, feature_names=["f_big"]),
            EmbeddingBagConfig(name="small", embedding_dim=16, num_embeddings=TRAIN_SMALL, feature_names=["f_small"])]


def _train_batches(n, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lb = torch.randint(0, 8, (TRAIN_BATCH,), generator=g)
        ls = torch.randint(0, 3, (TRAIN_BATCH,), generator=g)
        # a skewed draw: hot rows hit the cache, the tail misses and evicts every step
        vb = (torch.rand(int(lb.sum()), generator=g) ** 3 * TRAIN_BIG).long()
        vs = torch.randint(0, TRAIN_SMALL, (int(ls.sum()),), generator=g)
        out.append(KeyedJaggedTensor(keys=["f_big", "f_small"], values=torch.cat([vb, vs]),
                                     lengths=torch.cat([lb, ls])).to(device))
    return out


def _step(model, kjt):
    out = model(kjt).values()
    target = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    ((out - target) ** 2).sum().backward()
    return out.detach().clone()


def train(device, steps: int) -> list:
    problems = []
    data = _train_batches(steps, device)
    with tempfile.TemporaryDirectory() as workdir:
        cluster = RedisClusterProcesses(Path(workdir), n=3, appendonly=True)
        try:
            cluster.start()
            url = cluster.url(prefix=f"soak{os.getpid()}", retry_timeout=0.5)
            torch.manual_seed(0)
            model = recom_rec.EmbeddingBagCollection(
                _train_tables(), device=device, ps={"big": ps.PSConfig(url, cache_rows=20_000)})
            model.enable_fused_optimizer("rowwise_adagrad", lr=0.05)
            reference = recom_rec.EmbeddingBagCollection(_train_tables(), device=device)
            with torch.no_grad():
                reference.embedding_bags["big"].weight.copy_(ps.init_rows(_train_tables()[0], torch.arange(TRAIN_BIG)))
                reference.embedding_bags["small"].weight.copy_(model.embedding_bags["small"].weight)
            reference.enable_fused_optimizer("rowwise_adagrad", lr=0.05)
            expected = [_step(reference, kjt) for kjt in data]

            outs, done, kill_at, outages = [], 0, steps // 3, 0
            bar = tqdm(total=steps, desc="training (PS, prefetch 2)", file=sys.stdout, mininterval=5)
            while done < steps:
                try:
                    for kjt in ps.wrap(data[done:], model, prefetch=2):
                        if done == kill_at and outages == 0:
                            cluster.servers[1].stop()  # SIGKILL: a third of the slots lose their server
                        outs.append(_step(model, kjt))
                        done += 1
                        bar.update(1)
                except ps.StoreUnavailable as e:
                    outages += 1
                    print(f"\nstep {done}: {str(e).splitlines()[0][:160]}")
                    if outages > 3:
                        raise
                    cluster.servers[1].start()  # its append-only file replays the acknowledged rows
                    cluster.wait_until_ok()
            bar.close()
            flushed = ps.flush(model)
            same_outputs = sum(torch.equal(a, b) for a, b in zip(outs, expected))
            same_big = torch.equal(ps.export_table(model, "big"), reference.embedding_bags["big"].weight.detach().cpu())
            same_small = torch.equal(model.embedding_bags["small"].weight, reference.embedding_bags["small"].weight)
            print(f"training: {steps} steps, master killed at step {kill_at}, {outages} outage(s) raised and "
                  f"resumed; {same_outputs}/{steps} outputs and the tables (big: {same_big}, small: {same_small}) "
                  f"bit-equal to the in-HBM run; {flushed} rows flushed at the end")
            if outages == 0:
                problems.append("the killed master caused no outage: the fault was not exercised")
            if same_outputs != steps or not (same_big and same_small):
                problems.append("training under the outage differs from the in-HBM run: a row was lost")
        finally:
            cluster.stop()
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--serve-seconds", type=float, default=150)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--bad-fraction", type=float, default=0.01)
    p.add_argument("--sample-fraction", type=float, default=0.02)
    p.add_argument("--train-steps", type=int, default=120)
    p.add_argument("--skip", choices=["serve", "train"], action="append", default=[])
    args = p.parse_args(argv)
    device = torch.device(args.device)
    problems = []
    if "serve" not in args.skip:
        problems += serve(device, args.serve_seconds, args.threads, args.bad_fraction, args.sample_fraction)
    if "train" not in args.skip:
        problems += train(device, args.train_steps)
    for line in problems:
        print("PROBLEM:", line)
    print("soak:", "passed" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
