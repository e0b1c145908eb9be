"""What comes back from the lent machine: at most three files under --out-dir (gpu_check.json,
gpu_check.md and one gzipped tar of filtered dumps), within what the machine returns (at most 8
files of 16 MiB, 64 MiB together, no deeper than `$OUT/a/b/file`, names of letters, digits,
`.`, `_`, `-`). Dumps are written to the scratch folder first; the tar takes them in order of
use (the trace, the ptxas log, the traced step's modules, the other variants' modules, PTX),
cutting any text file over a member cap (a binary trace goes whole or not at all) and
stopping before the tar could pass its limit. Its MANIFEST.json lists what went in, what was
cut and what was left out, and why."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import pathlib
import re
import tarfile
import time

JSON_NAME, MD_NAME, TAR_NAME = "gpu_check.json", "gpu_check.md", "gpu_check_dumps.tar.gz"
NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
BINARY = (".pb", ".gz")  # kept whole or left out; text dumps are cut to the member cap


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the out dir may hold: the machine's return limits, tightened to our three files."""
    max_files: int = 3
    file_bytes: int = 16 << 20
    total_bytes: int = 64 << 20
    max_folders_deep: int = 2     # $OUT/a/b/file comes back, $OUT/a/b/c/file does not
    tar_bytes: int = 15 << 20     # the tar's own limit, under file_bytes with room to spare
    member_bytes: int = 6 << 20   # one dump file in the tar, raw; larger ones are truncated


LIMITS = Limits()


def out_dir_problems(out: pathlib.Path, limits: Limits = LIMITS) -> list[str]:
    """Every way the out dir breaks the limits (empty when it would all come back)."""
    out = pathlib.Path(out)
    files = [f for f in out.rglob("*") if f.is_file() or f.is_symlink()]
    problems = []
    if len(files) > limits.max_files:
        problems.append(f"{len(files)} files (at most {limits.max_files}): "
                        f"{sorted(str(f.relative_to(out)) for f in files)[:10]}")
    total = 0
    for f in files:
        rel = f.relative_to(out)
        if f.is_symlink():
            problems.append(f"{rel}: a link (links do not come back)")
            continue
        size = f.stat().st_size
        total += size
        if size > limits.file_bytes:
            problems.append(f"{rel}: {size} bytes (at most {limits.file_bytes})")
        if len(rel.parts) - 1 > limits.max_folders_deep:
            problems.append(f"{rel}: {len(rel.parts) - 1} folders deep "
                            f"(at most {limits.max_folders_deep})")
        bad = [p for p in rel.parts if not NAME_RE.match(p)]
        if bad:
            problems.append(f"{rel}: names outside [A-Za-z0-9._-]: {bad}")
    if total > limits.total_bytes:
        problems.append(f"{total} bytes in all (at most {limits.total_bytes})")
    return problems


class _Counting(io.RawIOBase):
    """A write-only file that counts the bytes written through it."""

    def __init__(self, f):
        self.f, self.n = f, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.n += len(b)
        return self.f.write(b)


def candidates(scratch: pathlib.Path, traced: list[str], variants: list[str]) -> list[tuple]:
    """(path, name in the tar) in the order they are worth the tar's bytes. traced: the traced
    step's dump modules; variants: the other engine variants' modules."""
    scratch = pathlib.Path(scratch)
    dump = scratch / "xla_dump"
    out: list[tuple] = []
    seen: set[pathlib.Path] = set()

    def add(paths, prefix: str):
        for p in paths:
            if p.is_file() and p not in seen:
                seen.add(p)
                out.append((p, f"{prefix}/{p.name}"))

    trace = sorted((scratch / "trace").rglob("*"), key=lambda f: f.name)
    add([f for f in trace if f.name.endswith((".xplane.pb", ".trace.json.gz"))], "trace")
    add([scratch / "ptxas.log"], "logs")

    def module_files(modules, suffixes):
        files = sorted(dump.glob("*")) if dump.is_dir() else []
        return [f for m in modules for f in files
                if f.name.startswith(m + ".") and f.name.endswith(suffixes)]

    key = ("after_optimizations.txt", "thunk_sequence_after_thunk_passes.txt")
    add(module_files(traced, key), "step_dump")
    add(module_files(traced, (".ptx",)), "step_dump")
    add(module_files(variants, key), "step_dump")
    add([scratch / "stderr.log"], "logs")
    add(module_files(variants, (".ptx",)), "step_dump")
    add(module_files(traced + variants, ("before_optimizations.txt",
                                         "buffer-assignment.txt")), "step_dump")
    return out


def write_tar(out: pathlib.Path, members: list[tuple], limits: Limits = LIMITS) -> dict:
    """The tar of `members` (path, name) in order: text cut to limits.member_bytes (its tail
    kept for logs, its head otherwise), binary (the trace) whole or not at all, and no member
    started that could take the compressed tar past limits.tar_bytes even if it did not
    compress at all."""
    path = pathlib.Path(out) / TAR_NAME
    manifest = {"included": [], "truncated": [], "left_out": [], "limits": dataclasses.asdict(
        limits)}
    margin = 64 << 10  # tar headers, the manifest, the gzip trailer
    with open(path, "wb") as raw:
        counter = _Counting(raw)
        with gzip.GzipFile(fileobj=counter, mode="wb", compresslevel=6, mtime=0) as gz:
            with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for src, name in members:
                    gz.flush()
                    room = limits.tar_bytes - counter.n - margin
                    size = src.stat().st_size
                    if room < 4096:
                        manifest["left_out"].append({"name": name, "bytes": size,
                                                     "why": "tar limit reached"})
                        continue
                    if name.endswith(BINARY):  # a cut protobuf or gzip reads as nothing
                        if size > room:
                            manifest["left_out"].append({"name": name, "bytes": size,
                                                         "why": f"binary over the {room} bytes "
                                                                "left (not cut)"})
                            continue
                        keep = size
                    else:
                        keep = min(size, limits.member_bytes, room)
                    data = _read(src, keep, tail=name.startswith("logs/"))
                    if keep < size:
                        manifest["truncated"].append({"name": name, "bytes": size,
                                                      "kept": keep})
                    _add(tar, name, data)
                    manifest["included"].append({"name": name, "bytes": len(data)})
                manifest["tar_bytes_before_manifest"] = counter.n
                _add(tar, "MANIFEST.json", json.dumps(manifest, indent=1).encode())
    manifest["tar_bytes"] = path.stat().st_size
    return manifest


def _read(src: pathlib.Path, n: int, tail: bool) -> bytes:
    size = src.stat().st_size
    with open(src, "rb") as f:
        if tail and n < size:
            f.seek(size - n)
        return f.read(n)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))


def build_bundle(out: pathlib.Path, scratch: pathlib.Path, traced: list[str],
                 variants: list[str], limits: Limits = LIMITS) -> dict:
    """Writes the tar under `out` from the scratch folder; returns its manifest."""
    others = [m for m in variants if m not in traced]
    return write_tar(out, candidates(scratch, traced, others), limits)
