"""Where an AOTInductor package fails to load in a fresh process: three packages of growing
content, each compiled here and then loaded and run in a fresh process with faulthandler and a
native backtrace (tools/segv_backtrace.c, LD_PRELOAD'ed when a C compiler is there).

    python tools/aoti_probe.py --device cuda --out /tmp/aoti [--no-caches]
    python tools/aoti_probe.py --device cuda --only linear --inductor-compiler /usr/bin/g++

Prints inductor's compiler and, for the nn.Linear package, its wrapper library's linking (ldd,
NEEDED entries, the std:: symbols it defines): a wrapper that carries its own libstdc++ crashes at
load (docs/perf-notes.md v17). ``--inductor-compiler`` swaps the compiler (through a script that
logs every command; ``--cxx-extra`` appends flags to its links).

1. a plain ``nn.Linear`` (does AOTInductor load at all on this stack?);
2. the quantized DLRM of tests/test_quant_serving.py without input validation (only the Triton
   op, compiled into the package);
3. the same with validation (adds the opaque custom op ``quantized_lookup_checked_offsets``).
"""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

import torch

RUN = textwrap.dedent("""
    import importlib, sys, torch
    before, after = sys.argv[4].split("/")  # modules imported before the load / after it
    for m in filter(None, before.split(",")):
        importlib.import_module(m)
    print("libstdc++ mapped:", sorted({l.split()[-1] for l in open("/proc/self/maps") if "libstdc++" in l}), flush=True)
    print("loading", flush=True)
    runner = torch._inductor.aoti_load_package(sys.argv[1])
    print("loaded", flush=True)
    for m in filter(None, after.split(",")):
        importlib.import_module(m)
    args = [t.to(sys.argv[3]) for t in torch.load(sys.argv[2])]
    out = runner(*args)
    print("ran", tuple(out.shape) if hasattr(out, "shape") else type(out), flush=True)
""")
# Which imports come before the load: does something a module loads (fbgemm_gpu's libraries,
# through torchrec) break the package's C++ runtime?
IMPORTS = {"linear": ["/", "fbgemm_gpu/", "recom_rec/", "/recom_rec"], "novalidate": ["recom_rec/", "/recom_rec"],
           "validate": ["recom_rec/", "/recom_rec"]}


def _backtrace_lib(out: pathlib.Path):
    src = pathlib.Path(__file__).with_name("segv_backtrace.c")
    lib = out / "segv_backtrace.so"
    r = subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], capture_output=True, text=True)
    return str(lib) if r.returncode == 0 else None


def _describe(package, out):
    """The package's wrapper library: what it links, where it looks, which C++ runtime symbols it
    defines itself (instantiations that could bind to another copy at load time)."""
    folder = out / "unzipped"
    shutil.rmtree(folder, ignore_errors=True)
    zipfile.ZipFile(package).extractall(folder)
    for so in folder.rglob("*.so"):
        for cmd in (["ldd", str(so)], ["readelf", "-d", str(so)], ["g++", "--version"]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            print(f"$ {' '.join(cmd[:2])}\n{r.stdout[-1500:]}{r.stderr[-300:]}", flush=True)
        r = subprocess.run(f"nm -DC --defined-only {so} | grep -c 'std::'; nm -DC --defined-only {so} | grep 'regex\\|locale' | head -8",
                           shell=True, capture_output=True, text=True)
        print(f"std:: symbols the wrapper exports (count, then regex/locale ones):\n{r.stdout}", flush=True)


def _load_fresh(package, inputs, out, device, lib, name):
    torch.save([t.cpu() for t in inputs], out / f"{name}-inputs.pt")
    script = out / "run.py"
    script.write_text(RUN)
    env = dict(os.environ, **({"LD_PRELOAD": lib} if lib else {}))
    for imports in IMPORTS[name]:
        r = subprocess.run([sys.executable, "-X", "faulthandler", str(script), package, str(out / f"{name}-inputs.pt"),
                            device, imports], capture_output=True, text=True, timeout=300, env=env)
        tail = r.stderr[-2500:] if r.returncode else ""
        print(f"== {name}, imports before/after the load {imports!r}: exit {r.returncode}\n{r.stdout[-300:]}{tail}",
              flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="/tmp/aoti")
    p.add_argument("--only", nargs="*", default=["linear", "novalidate", "validate"])
    p.add_argument("--first-import-only", action="store_true", help="load each package once (no imports but torch's)")
    p.add_argument("--inductor-compiler", default="",
                   help="inductor's C++ compiler for the packages (through a logging script), e.g. /usr/bin/g++")
    p.add_argument("--no-caches", action="store_true", help="torch._inductor.config.force_disable_caches")
    p.add_argument("--cxx-extra", default="",
                   help="with --inductor-compiler: flags appended to its link commands")
    p.add_argument("--preload", default="", help="LD_PRELOAD (besides the backtrace library) of the loading process")
    p.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="torch._inductor.config entries for the compile, e.g. aot_inductor.precompile_headers=False")
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    patches = {k: {"True": True, "False": False}.get(v, v) for k, v in (c.split("=", 1) for c in args.config)}
    torch._inductor.config.patch(patches).__enter__()  # for the whole run
    print("config:", patches or "defaults", flush=True)
    if args.first_import_only:
        for name in IMPORTS:
            IMPORTS[name] = IMPORTS[name][:1]
    os.environ["RECOM_TEST_DEVICE"] = args.device
    lib = _backtrace_lib(out)
    print("native backtrace:", lib or "no (gcc failed)", flush=True)
    from torch._inductor.cpp_builder import get_cpp_compiler
    print("inductor's compiler:", get_cpp_compiler(), "| CXX:", os.environ.get("CXX"), flush=True)
    if args.no_caches:  # every package compiled here (no precompiled header or library from an earlier run)
        torch._inductor.config.force_disable_caches = True
    if args.inductor_compiler:
        main_wrapped(args, out)
    lib = ":".join(filter(None, [lib, args.preload]))
    _packages(args, out, device, lib)


def main_wrapped(args, out):
    """inductor's compiler through a script that logs every command (and appends --cxx-extra to
    links); the script's name must say g++ for inductor's flag choices."""
    wrap = out / "bin" / "g++"
    wrap.parent.mkdir(exist_ok=True)
    wrap.write_text(f'#!/bin/sh\nextra=""\ncase " $* " in *" -shared "*) extra="{args.cxx_extra}";; esac  # links only\n'
                    f'echo "g++ $* $extra" >> {out}/cxx.log\nexec {args.inductor_compiler} "$@" $extra\n')
    wrap.chmod(0o755)
    torch._inductor.config.cpp.cxx = (str(wrap),)
    print("compiler:", wrap.read_text().strip(), flush=True)


def _packages(args, out, device, lib):
    if "linear" in args.only:
        lin = torch.nn.Linear(16, 4).to(device)
        x = torch.randn(8, 16, device=device)
        ep = torch.export.export(lin, (x,))
        pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(out / "linear.pt2"))
        _describe(pkg, out)
        if (out / "cxx.log").exists():
            print("compiler commands (the link last):", *open(out / "cxx.log").read().splitlines()[-2:], sep="\n",
                  flush=True)
        _load_fresh(pkg, [x], out, args.device, lib, "linear")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    import recom_rec
    import test_quant_serving as t

    for name in [n for n in ("novalidate", "validate") if n in args.only]:
        model = recom_rec.quantize(t._trained_dlrm(True), torch.qint8, validate_inputs=name == "validate")
        ep = t._exported(model, t._batches(1, seed=7)[0])
        pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(out / f"{name}.pt2"))
        _load_fresh(pkg, t._inputs(t._batches(1, batch_size=16, seed=3)[0]), out, args.device, lib, name)


if __name__ == "__main__":
    main()
