"""Guard against the AOTInductor load crash (DESIGN §10): probe in a subprocess, fix by preloading
libstdc++.

On the GPU image, `aoti_load_package` segfaults inside the package's `std::regex`
(`parse_device_str`) unless the process started with
`LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6`: the package `.so` is built by the system g++, and
two C++ runtimes' regex/locale code get mixed in the process; preloading the system libstdc++ makes
its symbols win everywhere. Which definitions loaded libraries bind to is settled when the process
starts, so the only in-process-safe fix is to start it with the preload: re-exec with `LD_PRELOAD`
before anything heavy runs.

    probe(package)            load (and run nothing) in a child process; True when it survives
    diagnose(package)         "ok" | "preload" (+ the library) | "broken", cached per platform
    ensure_loadable(package)  returns when loading is safe here; otherwise re-execs with the preload
                              (when allowed) or raises `AOTIUnsafe` — never loads into a crashing
                              process
    reexec_if_needed()        for CLI entry points: re-exec early if an earlier diagnosis said so
    cli_startup()             first thing in `boundgen serve`: re-exec-safe process +
                              reexec_if_needed

`BOUNDGEN_AOTI_PRELOAD=off` disables the re-exec (the caller then gets `AOTIUnsafe` and falls
back).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("boundgen.compile")

_REEXEC_MARK = "BOUNDGEN_AOTI_REEXECED"
_CLI_MARK = "BOUNDGEN_AOTI_REEXEC"  # set by CLI entry points: re-exec is safe in this process
# The load itself, as `compile.aoti.open_package` does it (not `aoti_load_package`, whose device
# check costs 57 s of CPU-ISA probing on the GPU image): what crashes is the package's own code.
_PROBE = (
    "import sys, torch\n"
    "try:\n"
    "    m = torch._C._aoti.AOTIModelPackageLoader(sys.argv[1], 'model', False, 1, -1)\n"
    "except TypeError:  # another torch's signature\n"
    "    m = torch._inductor.aoti_load_package(sys.argv[1])\n"
    "m.get_constant_fqns()\n"
    "print('boundgen-probe-ok')\n"
)
PROBE_TIMEOUT_S = 300.0


class AOTIUnsafe(RuntimeError):
    """Loading an AOTInductor package would crash this process."""


def libstdcxx_candidates() -> list[str]:
    """The system libstdc++ (what the package's .so was linked against), most likely first."""
    found = []
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if "libstdc++.so.6 " in line and "=>" in line and ("x86-64" in line or "64" in line):
                found.append(line.split("=>")[-1].strip())
    except (OSError, subprocess.SubprocessError):
        pass
    found += [
        "/lib/x86_64-linux-gnu/libstdc++.so.6",
        "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",
        "/usr/lib64/libstdc++.so.6",
        "/lib/aarch64-linux-gnu/libstdc++.so.6",
    ]
    found += sorted(glob.glob("/usr/lib/gcc/*/*/libstdc++.so"))
    seen, out_ = set(), []
    for p in found:
        real = os.path.realpath(p)
        if os.path.isfile(real) and real not in seen:
            seen.add(real)
            out_.append(p)
    return out_


@functools.cache
def _system_libstdcxx() -> frozenset[str]:
    """The real paths of `libstdcxx_candidates()` (one `ldconfig -p` per process)."""
    return frozenset(os.path.realpath(p) for p in libstdcxx_candidates())


def _is_system(lib: str) -> bool:
    return os.path.realpath(lib) in _system_libstdcxx()


def loaded_libstdcxx() -> str | None:
    """Path of the libstdc++ mapped into this process (None if none yet)."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libstdc++" in line:
                return line.split()[-1]
    except OSError:
        pass
    return None


def _preloaded(lib: str) -> bool:
    return any(
        os.path.realpath(p) == os.path.realpath(lib)
        for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
        if p
    )


def probe(
    package: str | Path,
    preload: str | None = None,
    timeout: float = PROBE_TIMEOUT_S,
    command: list[str] | None = None,
) -> tuple[bool, str]:
    """Load `package` in a child process (optionally with `LD_PRELOAD=preload`) → (survived,
    detail)."""
    env = _without_system_preload(dict(os.environ))
    if preload:
        env["LD_PRELOAD"] = " ".join(p for p in [preload, env.get("LD_PRELOAD", "")] if p)
    cmd = command or [sys.executable, "-c", _PROBE, str(package)]
    # A crash is one of the answers: no core file (writing a CUDA process's core can take longer
    # than the probe). Through the shell, not `preexec_fn`, which may deadlock in a threaded parent.
    cmd = ["/bin/sh", "-c", 'ulimit -c 0; exec "$@"', "boundgen-probe", *cmd]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"probe timed out after {timeout:.0f}s"
    if r.returncode == 0 and "boundgen-probe-ok" in r.stdout:
        return True, "ok"
    how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit code {r.returncode}"
    return False, f"{how}: {r.stderr.strip()[-300:]}"


def _platform_key() -> str:
    """What a verdict is about: this interpreter and this torch install. Not `LD_PRELOAD`: the
    verdict describes a process started without the preload (`diagnose` probes without it), so a
    server started by hand and one re-exec'd with the preload read the same verdict."""
    parts = [os.path.realpath(sys.executable), *_torch_install()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _torch_install() -> tuple[str, str]:
    """(version, location) of the torch this interpreter imports, without importing it: a CLI
    re-execs before its imports (`cli_startup`), which cost ~5 s on the GPU image. The version is
    read from torch/version.py (`importlib.metadata` scans every installed distribution)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec is not None and spec.origin else ""
    version = ""
    if origin:
        try:
            text = (Path(origin).parent / "version.py").read_text()
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.M)
            version = found.group(1) if found else ""
        except OSError:
            pass
    return version, os.path.realpath(origin)


def _without_system_preload(env: dict) -> dict:
    """`env` with the system libstdc++ taken out of `LD_PRELOAD` (the fix under test), the rest
    kept."""
    kept = [
        p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p and not _is_system(p)
    ]
    out = dict(env)
    if kept:
        out["LD_PRELOAD"] = " ".join(kept)
    else:
        out.pop("LD_PRELOAD", None)
    return out


def _state_file(cache_root: Path) -> Path:
    return cache_root / "preload-probe.json"


def _read_state(cache_root: Path) -> dict:
    try:
        return json.loads(_state_file(cache_root).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(cache_root: Path, key: str, value: dict) -> None:
    state = _read_state(cache_root)
    state[key] = value
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = _state_file(cache_root).with_suffix(f".{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, _state_file(cache_root))


def diagnose(
    package: str | Path, cache_root: Path | None = None, command: list[str] | None = None
) -> dict:
    """{"status": "ok" | "preload" | "broken", "preload": lib?, "detail": str}; cached per
    platform."""
    key = _platform_key()
    if cache_root is not None:
        cached = _read_state(cache_root).get(key)
        if cached:
            return cached
    # NOTE: the child runs in this process's environment minus a system libstdc++ preload, i.e. as
    # a process started by hand would. Preloading changes symbol interposition, so the child
    # preloads nothing extra, except a non-system libstdc++ this process has mapped (a wheel's or
    # the Python build's), which it maps first too: it then crashes exactly when we would.
    t0 = time.perf_counter()
    mapped = loaded_libstdcxx()
    mimic = mapped if mapped and not _is_system(mapped) and not _preloaded(mapped) else None
    ok, detail = probe(package, preload=mimic, command=command)
    if ok:
        result = {"status": "ok", "detail": detail}
    else:
        result = {"status": "broken", "detail": detail}
        for lib in libstdcxx_candidates():
            ok2, _detail2 = probe(package, preload=lib, command=command)
            if ok2:
                result = {
                    "status": "preload",
                    "preload": lib,
                    "detail": f"load crashed ({detail}); works with LD_PRELOAD={lib}",
                }
                break
    result["seconds"] = round(time.perf_counter() - t0, 2)
    if cache_root is not None:
        _write_state(cache_root, key, result)
    return result


def child_preload(cache_root: Path | None) -> tuple[bool, str | None]:
    """For child processes started now that will load packages: (safe, LD_PRELOAD to start them
    with). The stored verdict decides when there is one; without one, a child preloading the
    system libstdc++ this process already maps is safe (the library it would use anyway, only its
    definitions made to win: the fix); a process mapping none or another one cannot tell."""
    result = _read_state(cache_root).get(_platform_key()) if cache_root is not None else None
    if result:
        if result["status"] == "ok":
            return True, None
        if result["status"] == "preload":
            return True, result["preload"]
        return False, None
    mapped = loaded_libstdcxx()
    if mapped and _is_system(mapped):
        return True, mapped
    return False, None


def reexec_with_preload(lib: str) -> None:
    """Replace this process by itself with `LD_PRELOAD=lib` (does not return)."""
    if os.environ.get(_REEXEC_MARK):
        raise AOTIUnsafe(f"already re-executed with LD_PRELOAD={lib} and loading is still unsafe")
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in [lib, env.get("LD_PRELOAD", "")] if p)
    env[_REEXEC_MARK] = "1"
    argv = list(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
    log.warning("re-executing with LD_PRELOAD=%s so AOTInductor packages load safely", lib)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + argv[1:], env)


def _reexec_allowed(allow: bool | None) -> bool:
    if os.environ.get("BOUNDGEN_AOTI_PRELOAD", "auto").lower() in ("off", "0", "no"):
        return False
    return bool(allow) or os.environ.get(_CLI_MARK) == "1"


def ensure_loadable(
    package: str | Path,
    cache_root: Path | None = None,
    allow_reexec: bool = False,
    command: list[str] | None = None,
) -> dict:
    """Return when `package` can be loaded in this process; else re-exec (if allowed) or raise."""
    result = diagnose(package, cache_root, command)
    if result["status"] == "ok":
        return result
    if result["status"] == "preload":
        lib = result["preload"]
        if _preloaded(lib):
            return result
        if _reexec_allowed(allow_reexec):
            reexec_with_preload(lib)
        raise AOTIUnsafe(
            f"loading AOTInductor packages crashes this process ({result['detail']}); start it "
            "with "
            f"LD_PRELOAD={lib} (the boundgen CLI does this itself)"
        )
    raise AOTIUnsafe(f"AOTInductor packages cannot be loaded here: {result['detail']}")


def reexec_if_needed(cache_root: Path | None = None) -> None:
    """Cheap check for CLI entry points (no probe): re-exec when a cached diagnosis asks for a
    preload."""
    from boundgen.compile.paths import default_cache_dir

    if not sys.platform.startswith("linux") or not _reexec_allowed(True):
        return
    root = cache_root or default_cache_dir()
    result = _read_state(root).get(_platform_key())
    if result and result.get("status") == "preload" and not _preloaded(result["preload"]):
        reexec_with_preload(result["preload"])


def cli_startup() -> None:
    """Call first thing in a CLI entry point: this process may be re-exec'd (now, from a cached
    diagnosis, or later, when the first AOTInductor load is probed), which a library caller's
    process may not."""
    os.environ[_CLI_MARK] = "1"
    try:
        reexec_if_needed()
    except AOTIUnsafe:
        pass
