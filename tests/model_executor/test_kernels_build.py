"""How the engine gets its native kernels: the package's prebuilt module for this CPU when it matches the running
torch and the sources, else the just-in-time build. That build's cache is keyed by instruction set, sources and
flags; a lock left by a killed build never hangs a later start; a lock held by a live process is waited for a
bounded time, then the PyTorch path is used.

The lock cases run in a subprocess with a timeout and a temporary TORCH_EXTENSIONS_DIR (the shared cache is not
touched), and build a tiny extension rather than the real kernels so they take seconds."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedserve.model_executor import kernels as K

pytestmark = pytest.mark.kernels_build

TINY_SOURCE = textwrap.dedent("""
    #include <Python.h>
    #define PS_CAT2(a, b) a##b
    #define PS_CAT(a, b) PS_CAT2(a, b)
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, nullptr};
    PyMODINIT_FUNC PS_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
""")


def test_cache_key_changes_with_isa_sources_and_flags(tmp_path):
    src = tmp_path / "a.cpp"
    src.write_text("int f() { return 1; }\n")
    names = {isa: K.extension_name(isa, (src,), K.build_flags(isa)) for isa in K.ISA_LEVELS}
    assert len(set(names.values())) == len(K.ISA_LEVELS)  # one build per instruction-set level
    assert all(name.startswith(f"pagedserve_cpu_{isa}_") for isa, name in names.items())
    assert K.extension_name("avx2", (src,), K.build_flags("avx2")) == names["avx2"]  # stable
    assert K.extension_name("avx2", (src,), K.build_flags("avx2") + ["-DX"]) != names["avx2"]  # flags
    src.write_text("int f() { return 2; }\n")
    assert K.extension_name("avx2", (src,), K.build_flags("avx2")) != names["avx2"]  # sources
    # the real kernels: the default name covers the header too, and no level is built with -march=native
    assert K.extension_name("avx2") != K.extension_name("avx512")
    assert not any("march" in flag for isa in K.ISA_LEVELS for flag in K.build_flags(isa))


def test_isa_detection_and_forcing(monkeypatch):
    avx2_only = frozenset({"avx", "avx2", "fma", "f16c", "sse4_2"})
    zen4 = avx2_only | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    if K.platform.machine().lower() in ("x86_64", "amd64"):
        assert K.supported_isas(avx2_only) == ["avx2", "generic"]
        assert K.supported_isas(zen4) == ["avx512bf16", "avx512", "avx2", "generic"]
        assert K.supported_isas(zen4 - {"avx512_bf16"})[0] == "avx512"
    assert K.supported_isas(frozenset())[-1] == "generic"
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "generic")
    assert K.detect_isa() == "generic"
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA"):
        K.detect_isa()
    monkeypatch.delenv("PAGEDSERVE_CPU_ISA")
    assert K.detect_isa() == K.supported_isas()[0]


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()} holder\\n".encode())
print("HELD", flush=True)
time.sleep(600)
"""


def _hold_lock(path: Path) -> subprocess.Popen:
    """A live process holding the build lock (as a concurrent build would)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "HELD"
    return p


def _run(code: str, ext_dir: Path, timeout: float, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_build_killed_while_holding_the_locks_does_not_hang_the_next_start(tmp_path):
    """A build killed half-way leaves torch's `lock` file (torch would wait on it forever) and our lock file, whose
    flock died with it: the next start removes the first, takes the second at once, and builds."""
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_SOURCE)
    name = K.extension_name("generic", (src,), ["-O0"])
    build_dir = tmp_path / "ext" / name
    build_dir.mkdir(parents=True)
    holder = _hold_lock(build_dir / K.LOCK_NAME)
    (build_dir / "lock").write_text("")
    holder.kill()  # SIGKILL mid-"build"
    holder.wait()
    assert (build_dir / K.LOCK_NAME).exists() and (build_dir / "lock").exists()
    code = f"""
        import logging; logging.basicConfig(level=logging.INFO)
        from pathlib import Path
        from pagedserve.model_executor import kernels as K
        m = K.build_extension({name!r}, [Path({str(src)!r})], ["-O0"], timeout_s=600)
        print("LOADED", m.__name__)
    """
    r = _run(code, tmp_path / "ext", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LOADED tiny" in r.stdout
    assert "stale torch extension lock" in r.stderr and "Waiting" not in r.stderr
    assert "Building native kernels" in r.stderr  # said what it was doing
    assert not (build_dir / "lock").exists()
    # the second start finds the build: loads it, builds nothing
    r = _run(code, tmp_path / "ext", timeout=300)
    assert r.returncode == 0 and "LOADED tiny" in r.stdout and "Building" not in r.stderr, r.stderr[-3000:]


def test_a_live_lock_holder_is_waited_for_a_bounded_time(tmp_path):
    """Another live process holds the lock of the real kernels: the wait ends after the timeout, with a warning,
    and the engine's accessor answers None (the PyTorch path) instead of hanging."""
    isa = K.detect_isa()
    build_dir = tmp_path / "ext" / K.extension_name(isa)
    build_dir.mkdir(parents=True)
    holder = _hold_lock(build_dir / K.LOCK_NAME)
    try:
        code = """
            import logging; logging.basicConfig(level=logging.INFO)
            from pagedserve.model_executor.kernels import cpu_kernels, load_cpu_kernels
            print("RESULT", load_cpu_kernels(), cpu_kernels())
        """
        r = _run(code, tmp_path / "ext", timeout=120, PAGEDSERVE_KERNEL_BUILD_TIMEOUT="1",
                 PAGEDSERVE_PREBUILT_KERNELS="0")
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT None None" in r.stdout
    assert "Waiting (at most 1 s)" in r.stderr and f"{holder.pid} holder" in r.stderr
    assert "held the build lock" in r.stderr and "PyTorch path" in r.stderr
    assert not list(build_dir.glob("*.so"))


def test_acquire_release(tmp_path):
    fd = K.acquire_build_lock(tmp_path, timeout_s=1)
    assert fd is not None
    assert (tmp_path / K.LOCK_NAME).read_text().split()[0] == str(os.getpid())
    K.release_build_lock(fd)
    holder = _hold_lock(tmp_path / K.LOCK_NAME)
    try:
        assert K.acquire_build_lock(tmp_path, timeout_s=0.3) is None  # held by a live process
    finally:
        holder.kill()
        holder.wait()
    fd = K.acquire_build_lock(tmp_path, timeout_s=5)  # its holder died: free at once
    assert fd is not None
    K.release_build_lock(fd)


def test_an_installed_package_carries_the_kernel_sources():
    """A non-editable install (a wheel) has only what pyproject's package-data names besides the .py files:
    without the sources every start falls back to the PyTorch path."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    package = K.KERNEL_DIR.parents[1]
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["pagedserve"]
    for name in K.UNITS + K.SOURCES + K.HEADERS:
        relative = (K.KERNEL_DIR / name).relative_to(package)
        assert any(relative.match(p) for p in patterns), f"{relative} is not in the package data"


def test_prebuilt_module_is_refused_on_another_torch_or_other_sources():
    """A module compiled against another torch could crash inside libtorch, one compiled from other sources is not
    the code in the tree: both are refused with a reason (the loader then takes the just-in-time build)."""
    isa = K.supported_isas()[0]
    entry = {"module": K.prebuilt_module(isa), "key": K.extension_name(isa)}
    manifest = {"torch": "2.13.0+cpu", "modules": {isa: entry}}
    assert K.prebuilt_unusable(isa, manifest, "2.13.0+cpu") is None
    assert "torch 2.12.1" in K.prebuilt_unusable(isa, {**manifest, "torch": "2.12.1+cpu"}, "2.13.0+cpu")
    stale = {**manifest, "modules": {isa: {**entry, "key": K.extension_name(isa) + "0"}}}
    assert "sources changed" in K.prebuilt_unusable(isa, stale, "2.13.0+cpu")
    assert "none was built" in K.prebuilt_unusable(isa, None, "2.13.0+cpu")
    assert "none was built" in K.prebuilt_unusable("avx9000", manifest, "2.13.0+cpu")


def test_the_prebuilt_module_is_used_when_present(tmp_path):
    """After `pip install` (setup.py), the engine imports the package's module for this CPU's level: nothing is
    compiled (an empty TORCH_EXTENSIONS_DIR stays empty), and the log says which path it took."""
    manifest = K.read_manifest()
    if manifest is None and os.environ.get("PAGEDSERVE_BUILD_KERNELS") == "0":
        pytest.skip("the package was installed with PAGEDSERVE_BUILD_KERNELS=0")
    assert manifest is not None, f"no {K.MANIFEST} beside the kernels: the package build (setup.py) did not run"
    import torch

    isa = K.detect_isa()
    reason = K.prebuilt_unusable(isa, manifest, torch.__version__)
    if reason is not None and "sources changed" in reason:
        pytest.skip(reason)
    assert reason is None, reason
    code = """
        import logging; logging.basicConfig(level=logging.INFO)
        from pagedserve.model_executor.kernels import cpu_kernels
        m = cpu_kernels()
        print("MODULE", m.__name__, m.isa())
    """
    r = _run(code, tmp_path / "ext", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"MODULE {K.PREBUILT_PACKAGE}.{K.prebuilt_module(isa)} {isa}" in r.stdout
    assert f"the prebuilt {isa} module loaded" in r.stderr and "Building" not in r.stderr
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").iterdir())


@pytest.mark.kernels_build
def test_the_just_in_time_build_is_the_fallback(tmp_path):
    """Without a usable prebuilt module (here: PAGEDSERVE_PREBUILT_KERNELS=0) the kernels are compiled on first use
    (in the shared cache: a ~1 min build once per source change), and compute what the prebuilt module computes."""
    saved = tmp_path / "jit.pt"
    code = f"""
        import logging; logging.basicConfig(level=logging.INFO)
        import torch
        from pagedserve.model_executor.kernels import cpu_kernels
        m = cpu_kernels()
        print("MODULE", m.__name__, m.isa())
        g = torch.Generator().manual_seed(0)
        q = torch.randn(3, 4, 64, generator=g)
        cache = torch.randn(2, 2, 16, 2, 64, generator=g)  # [blocks, K/V, block_size, KVH, D]
        tables, lens = torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.tensor([20, 32, 1])
        out = m.paged_decode_attention(q, cache[:, 0], cache[:, 1], tables, lens, 0.125)
        torch.save((q, cache, tables, lens, out), {str(saved)!r})
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PAGEDSERVE_PREBUILT_KERNELS": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    isa = K.detect_isa()
    assert f"MODULE {K.extension_name(isa)} {isa}" in r.stdout
    assert "PAGEDSERVE_PREBUILT_KERNELS=0" in r.stderr and "using the just-in-time build" in r.stderr
    import torch

    q, cache, tables, lens, jit_out = torch.load(saved)
    module = K.load_cpu_kernels(isa)  # the prebuilt module where this install has one
    torch.testing.assert_close(module.paged_decode_attention(q, cache[:, 0], cache[:, 1], tables, lens, 0.125),
                               jit_out, atol=0, rtol=0)


@pytest.mark.parametrize("argv, isas, expected", [
    (["--name"], None, "all"),  # a wheel (or sdist) build: every level, so it runs on any x86-64 CPU
    (["develop", "--help"], None, "host"),  # an editable install: the level of the machine it runs on
    (["--name"], "host", "host"),
    (["--name"], "avx2,generic", "avx2, generic"),
])
def test_the_package_build_picks_its_levels(argv, isas, expected):
    """setup.py's choice of instruction-set levels (it prints it before compiling anything)."""
    root = K.KERNEL_DIR.parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDSERVE_KERNEL_ISAS", "PAGEDSERVE_BUILD_KERNELS")}
    if isas is not None:
        env["PAGEDSERVE_KERNEL_ISAS"] = isas
    r = subprocess.run([sys.executable, "setup.py", *argv], cwd=root, capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    levels = {"all": ", ".join(K.ISA_LEVELS) if K.platform.machine().lower() in ("x86_64", "amd64") else "generic",
              "host": K.supported_isas()[0]}.get(expected, expected)
    assert f"pagedserve: building the native kernels for {levels}\n" in r.stdout


def test_the_package_build_refuses_unknown_levels():
    root = K.KERNEL_DIR.parents[2]
    r = subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PAGEDSERVE_KERNEL_ISAS": "avx9000", "PAGEDSERVE_BUILD_KERNELS": "1"})
    assert r.returncode != 0 and "PAGEDSERVE_KERNEL_ISAS='avx9000'" in r.stderr


def test_every_kernel_file_is_compiled_by_exactly_one_unit():
    """The build compiles only the units (build_config.UNITS), which #include the kernel files: a file no unit
    includes would be left out of every build (and out of the build key), one included twice would not link."""
    on_disk = sorted(p.name for p in K.KERNEL_DIR.glob("*.cpp") if p.name not in K.UNITS)
    assert sorted(K.SOURCES) == on_disk
    assert len(set(K.SOURCES)) == len(K.SOURCES)


def test_the_package_build_cache_is_keyed_by_everything_that_makes_the_module(tmp_path, monkeypatch):
    """setup.py's compile cache (build_config.build_cache_entry): one entry per level, module file, torch version
    and compiler command; a different one for any change of those or of the sources (extension_name)."""
    from pagedserve.model_executor.kernels import build_config as B

    entry = B.build_cache_entry(tmp_path, "avx2", "_cpu_avx2.so", "2.13.0", "gcc 12 -O3")
    assert entry == B.build_cache_entry(tmp_path, "avx2", "_cpu_avx2.so", "2.13.0", "gcc 12 -O3")
    others = {B.build_cache_entry(tmp_path, "generic", "_cpu_avx2.so", "2.13.0", "gcc 12 -O3"),
              B.build_cache_entry(tmp_path, "avx2", "_cpu_avx2.cpython-312.so", "2.13.0", "gcc 12 -O3"),
              B.build_cache_entry(tmp_path, "avx2", "_cpu_avx2.so", "2.14.0", "gcc 12 -O3"),
              B.build_cache_entry(tmp_path, "avx2", "_cpu_avx2.so", "2.13.0", "gcc 13 -O3"),
              B.build_cache_entry(tmp_path, "avx2", "_cpu_avx2.so", "2.13.0", "gcc 12 -O2")}
    assert entry not in others and len(others) == 5
    monkeypatch.setattr(B, "extension_name", lambda isa: f"pagedserve_cpu_{isa}_other_sources")
    assert B.build_cache_entry(tmp_path, "avx2", "_cpu_avx2.so", "2.13.0", "gcc 12 -O3") != entry


def test_the_package_build_cache_hands_back_what_was_stored_and_nothing_partial(tmp_path, monkeypatch):
    from pagedserve.model_executor.kernels import build_config as B

    entry = tmp_path / "cache" / "avx2-0123" / "_cpu_avx2.so"
    target = tmp_path / "build" / "pagedserve" / "_cpu_avx2.so"
    assert not B.restore_cached_build(entry, target) and not target.exists()  # a miss compiles
    built = tmp_path / "built.so"
    built.write_bytes(b"\x7fELF module bytes")
    B.store_cached_build(entry, built)
    assert B.restore_cached_build(entry, target) and target.read_bytes() == built.read_bytes()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no partial file left beside it

    def killed_half_way(src, dst):  # the copy into the cache dies: the entry must not appear
        Path(dst).write_bytes(b"\x7fEL")
        raise KeyboardInterrupt

    other = tmp_path / "cache" / "avx2-4567" / "_cpu_avx2.so"
    monkeypatch.setattr(B.shutil, "copyfile", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        B.store_cached_build(other, built)
    assert not other.exists()
    monkeypatch.undo()
    assert not B.restore_cached_build(other, target)


def test_the_package_build_cache_folder(tmp_path):
    from pagedserve.model_executor.kernels import build_config as B

    assert B.build_cache_dir("", str(tmp_path)) == tmp_path / "pagedserve" / "kernel-builds"  # XDG_CACHE_HOME
    assert B.build_cache_dir("", "") == Path.home() / ".cache" / "pagedserve" / "kernel-builds"
    assert B.build_cache_dir(str(tmp_path / "mine"), str(tmp_path)) == tmp_path / "mine"
    assert B.build_cache_dir("0", str(tmp_path)) is None
