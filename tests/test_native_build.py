"""How the loaders choose a build (ps/host_lib.py, kernels/cuda_ext.py): the install-time build
when it matches the sources and the GPU, else the just-in-time fallback, which says what it compiles
and how long it took; a failure is one line."""
import shutil
import types

import pytest

from recom_rec import native_build
from recom_rec.kernels import cuda_ext
from recom_rec.ps import host_lib


@pytest.mark.parametrize("arch_list, arch, runs", [
    ("9.0", (9, 0), True), ("9.0", (8, 0), False), ("9.0", (10, 0), False),
    ("8.0;9.0+PTX", (8, 0), True), ("8.0;9.0+PTX", (8, 6), False), ("8.0;9.0+PTX", (12, 0), True),
    ("8.0 8.6", (8, 6), True), ("10.0", (10, 0), True), ("Hopper", (9, 0), True)])
def test_a_build_covers_its_architectures_and_ptx_covers_newer_ones(arch_list, arch, runs):
    token = native_build.targets_token(arch_list)
    assert token.replace("_", "").isalnum()  # passed to the compiler as a bare -D token
    # torch's build takes any flag containing "arch" for the user's own -gencode and then adds none
    assert "arch" not in (token + native_build.TARGETS_MACRO + native_build.SOURCES_HASH_MACRO).lower()
    assert native_build.covers(token, arch) == runs


def test_the_sources_hash_is_a_bare_token_that_changes_with_a_source(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(native_build.csrc_dir(), csrc)
    before = native_build.ps_sha256(csrc)
    assert before.isidentifier() and before == native_build.ps_sha256(native_build.csrc_dir())
    with open(csrc / "ps" / native_build.PS_SOURCES[0], "a") as f:
        f.write("\n")
    assert native_build.ps_sha256(csrc) != before


def _fake_extension(**attrs):
    return types.SimpleNamespace(__file__="/x/_lookup_cuda.so", **attrs)


@pytest.mark.parametrize("sha_matches, archs, reason", [
    (True, "9.0", None),
    (False, "9.0", "csrc/lookup changed since the package was built"),
    (True, "8.0", "the installed build is for other GPUs (sm_80, not sm_90)")])
def test_the_installed_cuda_build_is_used_only_when_current_and_for_this_gpu(monkeypatch, sha_matches, archs,
                                                                            reason):
    sha = native_build.lookup_sha256(native_build.csrc_dir())
    fake = _fake_extension(sources_sha256=sha if sha_matches else "hstale",
                           cuda_targets=native_build.targets_token(archs))
    monkeypatch.setattr(cuda_ext.importlib, "import_module", lambda name: fake)
    module, why_not = cuda_ext._installed((9, 0))
    assert (module is fake) == (reason is None)
    assert why_not is None if reason is None else why_not.startswith(reason)


def test_an_installed_build_that_does_not_load_is_one_line(monkeypatch):
    def broken(name):
        raise ImportError("undefined symbol: _ZN3c10...\nmore detail")

    monkeypatch.setattr(cuda_ext.importlib, "import_module", broken)
    module, why_not = cuda_ext._installed((9, 0))
    assert module is None and why_not == "the installed build does not load (undefined symbol: _ZN3c10...)"


def test_a_failed_build_is_reported_as_its_first_error_line():
    log = RuntimeError("Error building extension 'recom_rec_lookup_cuda_sm90':\n[1/2] nvcc ... -c pooled_cuda.cu\n"
                       "pooled_cuda.cu(12): error: identifier \"foo\" is undefined\n1 error detected\nninja: stopped")
    line = cuda_ext._one_line(log)
    assert "\n" not in line
    assert line.startswith('pooled_cuda.cu(12): error: identifier "foo" is undefined')
    assert line.endswith("python -m recom_rec.kernels.cuda_ext prints the full log")


def test_on_this_machine_the_cuda_kernels_report_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the kernels may load")
    error = cuda_ext.build_error()
    assert error and "\n" not in error and "CUDA build of torch and a GPU" in error


def test_changed_ps_sources_are_compiled_on_first_use_with_progress(monkeypatch, tmp_path, capfd):
    csrc = tmp_path / "csrc"
    shutil.copytree(native_build.csrc_dir(), csrc)
    with open(csrc / "ps" / "ps_mem.c", "a") as f:
        f.write("\n/* changed since the build */\n")
    monkeypatch.setattr(native_build, "csrc_dir", lambda: csrc)
    monkeypatch.setenv("RECOM_REC_CACHE", str(tmp_path / "cache"))
    host_lib._loaded.cache_clear()
    try:
        lib = host_lib.lib()
        assert lib.ps_sources_sha256().decode() == native_build.ps_sha256(csrc)
        assert host_lib.where().endswith("(compiled on first use)")
        assert str(tmp_path / "cache" / "host") in host_lib.where()
        err = capfd.readouterr().err
        if host_lib.installed_library() is not None:
            assert "csrc/ps changed since the package was built" in err
        assert "recom_rec: compiling the parameter-server library" in err
        assert "recom_rec: compiled the parameter-server library csrc/ps in" in err
        host_lib._loaded.cache_clear()
        host_lib.lib()  # a second process (here: a second load) finds the cached build, silently
        assert "compiling" not in capfd.readouterr().err
    finally:
        host_lib._loaded.cache_clear()


def test_the_cuda_build_hash_covers_the_kernel_headers(tmp_path):
    """The kernels live in headers (kernels.cuh) that every translation unit includes: changing one
    must make an installed build stale, as changing a .cu file does."""
    import shutil

    shutil.copytree(native_build.csrc_dir() / "lookup", tmp_path / "lookup")
    before = native_build.lookup_sha256(tmp_path)
    for header in native_build.LOOKUP_HEADERS:
        path = tmp_path / "lookup" / header
        text = path.read_text()
        path.write_text(text + "\n// changed\n")
        assert native_build.lookup_sha256(tmp_path) != before, header
        path.write_text(text)
    assert native_build.lookup_sha256(tmp_path) == before
    # every source and header the build names is in the package's csrc/
    names = native_build.LOOKUP_SOURCES + native_build.LOOKUP_HEADERS
    assert all((native_build.csrc_dir() / "lookup" / n).is_file() for n in names)
    assert sorted(p.name for p in (native_build.csrc_dir() / "lookup").iterdir()) == sorted(names)
