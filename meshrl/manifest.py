"""Manifests: the size and SHA-256 of every file of a directory, written once it is complete and
checked before it is read.

A run checkpoint (``meshrl.pipeline.checkpoint``) and a warm-start cache entry
(``meshrl.embedded.warmstart``) are directories of files written by several processes and read back
days later, maybe after a disk filled up, a copy was cut short or a node died mid-write. Readers of
their formats (DCP, ``torch.load``, msgpack, safetensors) fail on a damaged file with their own
errors, or worse read it: ``manifest.json`` lets the reader say which file is damaged, in one
line, before anything is loaded (and before the run's directory is changed).

Simplifications on purpose: whole-file digests (no per-chunk ones: a damaged file is named, not
mended); the manifest itself is not signed (it guards against accidents, not an adversary).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["MANIFEST", "write_manifest", "damage", "has_manifest"]

MANIFEST = "manifest.json"
_FORMAT = 1
_THREADS = 8  # hashlib releases the GIL on large buffers: a checkpoint's shards hash in parallel


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root: Path) -> list[str]:
    """Every file under ``root`` but the manifest, as sorted POSIX paths relative to it."""
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(root: str | os.PathLike) -> dict[str, dict[str, int | str]]:
    """Write ``root/manifest.json`` listing every file under ``root`` (size, SHA-256); the directory
    must be complete. Returns the listing."""
    root = Path(root)
    names = _files(root)
    with ThreadPoolExecutor(min(_THREADS, max(1, len(names)))) as pool:
        digests = list(pool.map(lambda n: _digest(root / n), names))
    files = {n: {"bytes": (root / n).stat().st_size, "sha256": d} for n, d in zip(names, digests)}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": _FORMAT, "files": files}, indent=0))
    os.replace(tmp, root / MANIFEST)
    return files


def has_manifest(root: str | os.PathLike) -> bool:
    return (Path(root) / MANIFEST).is_file()


def damage(root: str | os.PathLike) -> str | None:
    """What is wrong with ``root`` against its manifest, naming the first damaged file (a missing,
    resized or changed one, or an unreadable manifest); None when every file is as written. Files
    added since are ignored. Sizes are compared first, so a truncated file costs no hashing."""
    root = Path(root)
    try:
        listing = json.loads((root / MANIFEST).read_text())["files"]
        expected = {str(name): (int(v["bytes"]), str(v["sha256"])) for name, v in listing.items()}
    except FileNotFoundError:
        return f"{root / MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{root / MANIFEST} is unreadable ({type(exc).__name__})"
    for name, (size, _) in sorted(expected.items()):
        path = root / name
        try:
            have = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if have != size:
            return f"{path} is {have:,} bytes, {size:,} when it was written"
    names = sorted(expected)
    with ThreadPoolExecutor(min(_THREADS, max(1, len(names)))) as pool:
        digests = list(pool.map(lambda n: _digest(root / n), names))
    for name, digest in zip(names, digests):
        if digest != expected[name][1]:
            return f"{root / name} has other contents than when it was written (SHA-256 differs)"
    return None
