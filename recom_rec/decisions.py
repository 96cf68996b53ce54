"""The kernels' measured choices ("decisions") carried with a model: taken out of one process, put
into another, and shipped inside an exported program or an AOTInductor package.

On a GPU each shape class's first calls measure the kernels' candidates (kernels/launch_tuner.py),
so a served model would measure again in every new process. ``kernel_decisions()`` takes this
process's decisions out, in the decision file's format (kernels/decision_cache.py: keyed by the GPU
model, compute capability, CUDA and driver versions and package build, then by tuner and shape
class); ``use_kernel_decisions(d)`` puts such decisions into this process's tuners, which then run
them from a shape's first call, with no trial (a decision of another context is ignored, as the
decision file's are). ``save_exported`` / ``load_exported`` do it through ``torch.export.save`` /
``load``'s extra files; ``aoti_compile_and_package`` / ``aoti_load_package`` through an extra file
of the AOTInductor package (a .pt2 archive, written with torch's own archive writer).
"""
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

# The decisions' file in a .pt2 archive's extra/ folder (torch.export's extra_files).
EXTRA_FILE = "recom_rec.kernel_decisions.json"
# Records torch's archive writer writes itself (not copied when an archive is rewritten).
_WRITER_RECORDS = {".data/version", ".data/serialization_id", "byteorder"}

PathLike = Union[str, "os.PathLike[str]"]


def kernel_decisions(path: Optional[PathLike] = None) -> Dict[str, Any]:
    """This process's kernel decisions, a JSON-able dict in the decision file's format:
    ``{"version": 1, "entries": {context: {tuner: {shape class: choice}}}}``. It holds every shape
    class a tuner decided (by measurement, from the ``RECOM_REC_CACHE`` file, or imported) and the
    decisions imported and not used yet. Where two models of one layout decided a class apart, the
    later decision is kept. With ``path``, also written there as JSON (which ``use_kernel_decisions``
    reads back). On a CPU there are none (no kernel is measured there)."""
    from .kernels.decision_cache import IMPORTED, VERSION
    from .kernels.launch_tuner import named_tuners

    entries = IMPORTED.entries()
    for tuner in named_tuners():
        for context, classes in tuner.kept_decisions().items():
            entries.setdefault(context, {}).setdefault(tuner.cache_name, {}).update(classes)
    data = {"version": VERSION, "entries": entries}
    if path is not None:
        Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))
    return data


def _parsed(text: str, source: str):
    try:
        return json.loads(text)
    except ValueError as error:
        raise ValueError(f"{source}: not recom_rec kernel decisions: not JSON ({error})") from None


def use_kernel_decisions(decisions: Union[Dict[str, Any], PathLike]) -> int:
    """Puts ``decisions`` (``kernel_decisions()``'s dict, or the path of a JSON file of one: also a
    ``RECOM_REC_CACHE`` decisions.json) into this process's tuners: a shape class they decide runs
    that choice from its first call, with no trial launch, on a device of the same context (GPU
    model, compute capability, CUDA and driver versions, package build). Decisions of other contexts
    are ignored (the first shape that finds none for its device warns once). Shapes this process
    has already decided keep their choice; imported decisions are looked up ahead of the
    ``RECOM_REC_CACHE`` file; a later call's decision replaces an earlier one's. A malformed set of
    decisions raises ValueError. Returns how many decisions were read.
    ``recom_rec.kernels.selection.forget_all()`` drops them with the measured ones."""
    from .kernels.decision_cache import IMPORTED, checked_decisions
    from .kernels.launch_tuner import named_tuners

    if isinstance(decisions, (str, os.PathLike)):
        source = os.fspath(decisions)
        decisions = _parsed(Path(source).read_text(), source)
    else:
        source = "kernel decisions"
    count = IMPORTED.add(checked_decisions(decisions, source))
    for tuner in named_tuners():
        tuner.look_again()
    return count


def _decisions_text(decisions: Optional[Dict[str, Any]]) -> str:
    from .kernels.decision_cache import checked_decisions

    data = kernel_decisions() if decisions is None else decisions
    checked_decisions(data)
    return json.dumps(data, indent=1, sort_keys=True)


def _name(f) -> str:
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "the archive")


def save_exported(ep: "torch.export.ExportedProgram", f, *, extra_files: Optional[Dict[str, Any]] = None,
                  decisions: Optional[Dict[str, Any]] = None, **kwargs) -> None:
    """``torch.export.save(ep, f, extra_files=..., **kwargs)`` with the kernel decisions in the extra
    file ``recom_rec.kernel_decisions.json``: this process's (``kernel_decisions()``; run the model's
    shapes first, e.g. ``recom_rec.tune(model, batches)`` on the GPU it will be served on) or
    ``decisions``. ``extra_files`` are the caller's own, saved beside it. ``load_exported`` reads the
    program back and puts the decisions into the loading process; ``torch.export.load`` reads it too
    (without them)."""
    files = dict(extra_files or {})
    files[EXTRA_FILE] = _decisions_text(decisions)
    torch.export.save(ep, f, extra_files=files, **kwargs)


def load_exported(f, *, extra_files: Optional[Dict[str, Any]] = None, **kwargs) -> "torch.export.ExportedProgram":
    """``torch.export.load(f, extra_files=..., **kwargs)``, then the kernel decisions saved with the
    program by ``save_exported`` go into this process's tuners (``use_kernel_decisions``; those of
    another GPU or build are ignored). A program saved without them loads as with torch. Malformed
    decisions raise ValueError. ``extra_files`` receives the archive's extra files, as with torch."""
    files = extra_files if extra_files is not None else {}
    asked = EXTRA_FILE in files
    files.setdefault(EXTRA_FILE, "")
    ep = torch.export.load(f, extra_files=files, **kwargs)
    text = files[EXTRA_FILE] if asked else files.pop(EXTRA_FILE)
    if text:
        use_kernel_decisions(_parsed(text, f"{_name(f)}: extra file {EXTRA_FILE}"))
    return ep


def _copy_archive(source: str, target, extra: Dict[str, str]) -> None:
    """Writes the .pt2 archive ``source`` to ``target`` (a path or a buffer) with ``extra``'s files
    in its extra/ folder (replacing any of the same name), through torch's archive reader and writer."""
    from torch.export.pt2_archive import PT2ArchiveReader, PT2ArchiveWriter

    added = {f"extra/{name}": text for name, text in extra.items()}
    with PT2ArchiveReader(source) as reader, PT2ArchiveWriter(target) as writer:
        for record in reader.get_file_names():
            if record in _WRITER_RECORDS or record in added or writer.has_record(record):
                continue
            writer.write_bytes(record, reader.read_bytes(record))
        for record, text in added.items():
            writer.write_string(record, text)


def _add_extra_in_place(path: str, text: str) -> None:
    """The .pt2 archive at ``path`` written again with the decisions' extra file (beside it, then
    moved over it: one filesystem, and a package holds the weights)."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(path))) as work:
        written = os.path.join(work, os.path.basename(path))
        _copy_archive(path, written, {EXTRA_FILE: text})
        os.replace(written, path)


def aoti_compile_and_package(exported_program: "torch.export.ExportedProgram", *, package_path=None,
                             inductor_configs: Optional[Dict[str, Any]] = None,
                             decisions: Optional[Dict[str, Any]] = None):
    """``torch._inductor.aoti_compile_and_package`` with the kernel decisions (this process's, or
    ``decisions``) in the package's extra file ``recom_rec.kernel_decisions.json``. torch's function
    takes no extra files, so the package it compiles is written again, record for record, through
    torch's own .pt2 archive writer (``torch.export.pt2_archive``) with that file added: the package
    loads with ``torch._inductor.aoti_load_package`` as before (which does not read the file) and
    with ``recom_rec.aoti_load_package`` (which does). ``package_path``: a path ending in .pt2, a
    writable seekable buffer, or None (torch's default path). Returns ``package_path`` (the path
    written, for None)."""
    import torch._inductor

    text = _decisions_text(decisions)
    if package_path is not None and not isinstance(package_path, (str, os.PathLike)):  # a buffer
        with tempfile.TemporaryDirectory() as work:
            compiled = os.path.join(work, "package.pt2")
            torch._inductor.aoti_compile_and_package(exported_program, package_path=compiled,
                                                     inductor_configs=inductor_configs)
            _copy_archive(compiled, package_path, {EXTRA_FILE: text})
        package_path.seek(0)
        return package_path
    if package_path is not None and not os.fspath(package_path).endswith(".pt2"):
        raise ValueError(f"package_path must end in .pt2 (got {package_path!r})")
    path = torch._inductor.aoti_compile_and_package(
        exported_program, package_path=None if package_path is None else os.fspath(package_path),
        inductor_configs=inductor_configs)
    _add_extra_in_place(path, text)
    return path if package_path is None else package_path


def aoti_load_package(path, run_single_threaded: bool = False, device_index: int = -1):
    """``torch._inductor.aoti_load_package(path, ...)``, with the kernel decisions of a package made
    by ``recom_rec.aoti_compile_and_package`` put into this process's tuners first
    (``use_kernel_decisions``: the package's recom_rec ops run in this process, through torch's
    proxy executor, and run the decided kernels from their first call). A package without them
    loads as with torch. Malformed decisions raise ValueError."""
    import torch._inductor
    from torch.export.pt2_archive import PT2ArchiveReader

    record = f"extra/{EXTRA_FILE}"
    with PT2ArchiveReader(path if not isinstance(path, os.PathLike) else os.fspath(path)) as reader:
        text = reader.read_string(record) if record in reader.get_file_names() else ""
    if isinstance(path, io.IOBase):
        path.seek(0)
    if text:
        use_kernel_decisions(_parsed(text, f"{_name(path)}: extra file {EXTRA_FILE}"))
    return torch._inductor.aoti_load_package(path, run_single_threaded=run_single_threaded, device_index=device_index)
