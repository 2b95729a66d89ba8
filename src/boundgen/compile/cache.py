"""Artifact cache for compiled buckets: one directory per slot, a meta.json per entry, a manifest.

A **slot** is what the artifact computes: the model graph fingerprint (config + every
parameter/buffer's name, shape, dtype and module type — so dtype and quantization policy are part of
it), the quantization label, the attention backend, the bucket and the device type. The **platform**
is what it was built with: torch version, CUDA version and GPU name/arch (or the CPU's vector ISA),
the source of the Triton kernels a package embeds (`embedded_kernel_modules`) and this module's
format.

    <root>/manifest.json        index of every entry (rebuilt from meta.json files when damaged)
    <root>/<slot>/package.pt2   the AOTInductor package (no weights)
    <root>/<slot>/meta.json     slot fields, platform, sha256 and size of package.pt2, build times

`lookup` never hands out an artifact it cannot vouch for: a platform or format mismatch is *stale*,
a missing file, bad meta.json or a sha256 mismatch is *corrupt*; both raise `ArtifactError` with the
reason, and `get_or_build` rebuilds them (or re-raises with the command to run when rebuilding is
off). Weight values are deliberately not in the key: weights are loaded from the live model at run
time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from boundgen.compile.paths import default_cache_dir

__all__ = ["ArtifactCache", "ArtifactError", "Entry", "Slot", "default_cache_dir"]

FORMAT = 1
PACKAGE = "package.pt2"
META = "meta.json"
MANIFEST = "manifest.json"


class ArtifactError(RuntimeError):
    """A compiled artifact is missing, stale or corrupt (and was not rebuilt)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "missing" | "stale" | "corrupt"


def _sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of everything the compiled graph depends on: config, tensor names/shapes/dtypes,
    module types."""
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    if cfg is not None and dataclasses.is_dataclass(cfg):
        fields = {
            f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "extra"
        }
        h.update(repr(sorted(fields.items())).encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    for name, m in model.named_modules():
        h.update(f"{name}:{type(m).__module__}.{type(m).__qualname__}\n".encode())
        recipe = getattr(type(m), "COMPILE_RECIPE", "")  # how a module type asks to be compiled
        if recipe:
            h.update(f"{name}:recipe:{recipe}\n".encode())
        variant = getattr(m, "compile_variant", "")  # what an instance changes in its graph
        if variant:
            h.update(f"{name}:variant:{variant}\n".encode())
    h.update(type(getattr(model, "backend", None)).__name__.encode())
    return h.hexdigest()[:24]


# Modules whose Triton kernels a compiled package embeds (the packed-prefill attention, the fused
# FP8 SiLU·mul + quantize, the few-row and bucket GEMMs): a package built with an older version of
# one keeps running the old kernel, so their source is part of the platform and a change makes the
# artifacts stale.
KERNEL_MODULES = (
    "boundgen.grid_dependency",  # every kernel below that waits for its inputs calls it
    "boundgen.attention.segments",
    "boundgen.quant.triton_quant",
    "boundgen.models.stream",
    "boundgen.models.stream_gated",
    "boundgen.models.stream_qkv",
    "boundgen.models.bucket_gated",
)


def embedded_kernel_modules() -> tuple[str, ...]:
    """`KERNEL_MODULES` that this process's packages embed: the streaming residual GEMM only
    where `stream.MAX_ROWS` > 0, gate_up's with SiLU·mul and qkv's with the rotation only where
    each is on too (`stream_gated.GATED`, `stream_qkv.ROTATED`), and the buckets' gate_up with
    SiLU·mul only where it is on (`bucket_gated.GATED`), so a change to them leaves the packages
    built without them valid."""
    from boundgen.models import bucket_gated, stream, stream_gated, stream_qkv

    drop = set()
    if stream.MAX_ROWS <= 0:
        drop.add("boundgen.models.stream")
    if stream.MAX_ROWS <= 0 or not stream_gated.GATED:
        drop.add("boundgen.models.stream_gated")
    if stream.MAX_ROWS <= 0 or not stream_qkv.ROTATED:
        drop.add("boundgen.models.stream_qkv")
    if not bucket_gated.GATED:
        drop.add("boundgen.models.bucket_gated")
    return tuple(m for m in KERNEL_MODULES if m not in drop)


def kernels_digest(modules: tuple[str, ...] = KERNEL_MODULES) -> str:
    """sha256 (16 hex digits) of the source files of `modules`, read without importing them."""
    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        h.update(name.encode())
        if spec is not None and spec.origin and os.path.isfile(spec.origin):
            h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()[:16]


def platform_info(device: torch.device | str) -> dict[str, str]:
    """What an artifact is only valid for: torch build, the exact device kind it was compiled
    for, and the source of the kernels it embeds (and the residual pass's mode, `compile.residual`,
    the rows up to which o_proj and down stream their weights, `models.stream.MAX_ROWS`, and
    whether gate_up then streams with SiLU·mul as its epilogue, `models.stream_gated.GATED`, and
    qkv with the q/k rotation as its epilogue, `models.stream_qkv.ROTATED`, whether a bucket's
    gate_up takes its SiLU·mul, `models.bucket_gated.GATED`, and by which kernel, `PERSISTENT`,
    and whether the kernels wait for the kernels before them (programmatic launch),
    `grid_dependency.key()`)."""
    from boundgen import grid_dependency
    from boundgen.compile import residual
    from boundgen.models import (
        bucket_gated,
        stream,
        stream_gated,
        stream_qkv,
    )

    dev = torch.device(device)
    info = {
        "torch": torch.__version__,
        "device": dev.type,
        "machine": platform.machine(),
        "format": str(FORMAT),
        "kernels": kernels_digest(embedded_kernel_modules()),
        "residual": residual.mode(),
    }
    if stream.MAX_ROWS > 0:  # off keeps the keys of the packages built before it
        info["stream_max_rows"] = str(stream.MAX_ROWS)
        if stream_gated.GATED:  # off keeps the keys of the packages built before it was on
            info["stream_gated"] = "1"
        if stream_qkv.ROTATED:  # off keeps the keys of the packages built before it
            info["stream_qkv"] = "1"
    if bucket_gated.GATED:  # off keeps the keys of the packages built before it
        info["bucket_gated"] = "persist" if bucket_gated.PERSISTENT else "1"
    pdl = grid_dependency.key()
    if pdl is not None:  # off keeps the keys of the packages built before it
        info["pdl"] = pdl
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        info.update(
            cuda=str(torch.version.cuda),
            gpu=torch.cuda.get_device_name(idx),
            arch=f"sm_{major}{minor}",
        )
    else:
        try:
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            info["cpu_isa"] = str(pick_vec_isa())
        except Exception:  # pragma: no cover - older/newer inductor layouts
            info["cpu_isa"] = "unknown"
    return info


@dataclass(frozen=True)
class Slot:
    model: str  # model_fingerprint
    dtype: str
    quant: str
    attention: str
    bucket: str
    device: str  # device type: cpu | cuda

    @property
    def key(self) -> str:
        return hashlib.sha256(
            json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        ).hexdigest()[:20]


@dataclass
class Entry:
    slot: Slot
    path: Path  # the package
    meta: dict


class ArtifactCache:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def dir_for(self, slot: Slot) -> Path:
        return self.root / slot.key

    # -- reading
    # -------------------------------------------------------------------------------------
    def lookup(self, slot: Slot, platform_: dict[str, str], verify: bool = True) -> Entry:
        """The entry for `slot`, checked against `platform_`; raises `ArtifactError` otherwise."""
        d = self.dir_for(slot)
        meta_path, pkg = d / META, d / PACKAGE
        if not meta_path.exists() and not pkg.exists():
            raise ArtifactError(
                "missing", f"no compiled artifact for bucket {slot.bucket} in {self.root}"
            )
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise ArtifactError("corrupt", f"artifact {d}: unreadable {META} ({exc})") from None
        if meta.get("slot") != dataclasses.asdict(slot):
            raise ArtifactError("corrupt", f"artifact {d}: {META} describes another model/bucket")
        built = meta.get("platform", {})
        diff = sorted(k for k in set(built) | set(platform_) if built.get(k) != platform_.get(k))
        if diff:
            what = ", ".join(f"{k} {built.get(k)!r} ≠ {platform_.get(k)!r}" for k in diff)
            raise ArtifactError(
                "stale",
                f"artifact for bucket {slot.bucket} was built for another platform ({what})",
            )
        if not pkg.is_file():
            raise ArtifactError("corrupt", f"artifact {d}: {PACKAGE} is missing")
        size = pkg.stat().st_size
        if size != meta.get("size_bytes"):
            raise ArtifactError(
                "corrupt", f"artifact {pkg}: size {size} ≠ recorded {meta.get('size_bytes')}"
            )
        if verify and _sha256_file(pkg) != meta.get("sha256"):
            raise ArtifactError(
                "corrupt", f"artifact {pkg}: sha256 does not match {META} (corrupt or edited)"
            )
        return Entry(slot, pkg, meta)

    def entries(self) -> list[dict]:
        return list(self._read_manifest().get("entries", {}).values())

    # -- writing
    # -------------------------------------------------------------------------------------
    def store(
        self, slot: Slot, platform_: dict[str, str], package: Path, info: dict | None = None
    ) -> Entry:
        """Move a freshly built `package` into the cache (atomically replacing an old entry)."""
        d = self.dir_for(slot)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{slot.key}-", dir=self.root))
        shutil.move(str(package), tmp / PACKAGE)
        meta = {
            "slot": dataclasses.asdict(slot),
            "platform": platform_,
            "sha256": _sha256_file(tmp / PACKAGE),
            "size_bytes": (tmp / PACKAGE).stat().st_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **(info or {}),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        with self._lock():
            old = None
            if d.exists():
                old = d.with_name(f".{slot.key}-old-{os.getpid()}-{time.monotonic_ns()}")
                os.replace(d, old)
            os.replace(tmp, d)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            manifest = self._read_manifest()
            manifest.setdefault("entries", {})[slot.key] = dict(meta.items())
            self._write_manifest(manifest)
        return Entry(slot, d / PACKAGE, meta)

    def remove(self, slot: Slot) -> None:
        with self._lock():
            shutil.rmtree(self.dir_for(slot), ignore_errors=True)
            manifest = self._read_manifest()
            manifest.get("entries", {}).pop(slot.key, None)
            self._write_manifest(manifest)

    def get_or_build(
        self,
        slot: Slot,
        platform_: dict[str, str],
        build: Callable[[Path], dict],
        rebuild: bool = True,
        on_event: Callable[[str, str], None] | None = None,
    ) -> Entry:
        """The verified entry for `slot`; a missing/stale/corrupt one is rebuilt with
        `build(path)` (which writes a package to `path` and returns build info), or refused when
        `rebuild` is False."""
        try:
            entry = self.lookup(slot, platform_)
            if on_event:
                on_event("hit", "")
            return entry
        except ArtifactError as exc:
            if not rebuild:
                raise ArtifactError(
                    exc.kind,
                    f"{exc}; rebuilding is off — run `boundgen compile` for "
                    f"this model/bucket (or allow rebuilds)",
                ) from None
            if on_event:
                on_event(exc.kind, str(exc))
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.root, prefix=".build-") as tmp:
            out = Path(tmp) / PACKAGE
            info = build(out) or {}
            return self.store(slot, platform_, out, info)

    # -- manifest
    # ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _lock(self):
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read_manifest(self) -> dict:
        try:
            data = json.loads((self.root / MANIFEST).read_text())
            if isinstance(data, dict) and data.get("format") == FORMAT:
                return data
        except (OSError, ValueError):
            pass
        # damaged or absent: rebuild the index from the entries' own meta.json files
        entries = {}
        for meta in self.root.glob(f"*/{META}"):
            try:
                entries[meta.parent.name] = json.loads(meta.read_text())
            except (OSError, ValueError):
                continue
        return {"format": FORMAT, "entries": entries}

    def _write_manifest(self, manifest: dict) -> None:
        manifest["format"] = FORMAT
        tmp = self.root / f".{MANIFEST}.{os.getpid()}"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, self.root / MANIFEST)
