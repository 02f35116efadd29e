"""The Python-source corpus the demo model is trained and evaluated on.

Documents are the `.py` files of the running interpreter's standard library and site-packages.
Each file has a key: its path relative to the root it was found under, with any vendoring prefix
(everything up to a `_vendor/`-style folder) removed, so one module has one key on every machine
and Python version. The held-out slice is every file whose key's sha256 falls in the first
HELD_OUT_PER_MILLE of 1000 buckets (2%): the same modules on every machine. Training also skips
any file whose text equals a held-out file's, and exact duplicates (by content hash) count once.
Files are visited in the order of their key's hash, a fixed shuffle, so that a byte cap samples
every package rather than the alphabetically first ones.
"""

from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_PER_MILLE = 20
# Larger files are generated tables or data, not code anyone writes.
MAX_FILE_BYTES = 512 * 1024
_VENDOR_DIRS = ("_vendor", "vendor", "_vendored", "vendored", "_vendored_packages")
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}


@dataclass(frozen=True)
class SourceFile:
    """One candidate document: its machine-independent key and where it lives here."""

    key: str
    path: Path

    @property
    def held_out(self) -> bool:
        """Whether this file belongs to the evaluation slice."""
        return is_held_out(self.key)


def split_key(relative: str) -> str:
    """The key of a file at `relative` (POSIX path under its root), vendoring prefix dropped."""
    parts = relative.split("/")
    cut = max((i + 1 for i, p in enumerate(parts[:-1]) if p in _VENDOR_DIRS), default=0)
    return "/".join(parts[cut:])


def _bucket(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)


def is_held_out(key: str) -> bool:
    """Whether the file with this key is held out for evaluation."""
    return _bucket(key) % 1000 < HELD_OUT_PER_MILLE


def default_roots(include_site_packages: bool = True) -> list[Path]:
    """The running interpreter's stdlib folder and (optionally) its site-packages folders."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    if include_site_packages:
        paths = sysconfig.get_paths()
        roots += [Path(paths["purelib"]), Path(paths["platlib"]), *map(Path, site.getsitepackages())]
    seen: set[Path] = set()
    unique = []
    for root in roots:
        resolved = root.resolve()
        if resolved.is_dir() and resolved not in seen:
            seen.add(resolved)
            unique.append(resolved)
    return unique


def resolve_roots(names: Sequence[str] | None) -> list[Path]:
    """Roots from names: 'stdlib', 'site-packages', or folder paths; None means both defaults."""
    if not names:
        return default_roots()
    roots: list[Path] = []
    for name in names:
        if name == "stdlib":
            roots += default_roots(include_site_packages=False)
        elif name == "site-packages":
            roots += default_roots()[1:]
        elif Path(name).is_dir():
            roots.append(Path(name).resolve())
        else:
            raise FileNotFoundError(f"corpus root {name!r} is neither 'stdlib', 'site-packages' nor a folder")
    return roots


def list_files(roots: Sequence[Path]) -> list[SourceFile]:
    """Every `.py` file under the roots (nested site-packages skipped), in the fixed hash order."""
    files: dict[str, SourceFile] = {}
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
            for name in sorted(names):
                if not name.endswith(".py"):
                    continue
                path = Path(folder) / name
                key = split_key(path.relative_to(root).as_posix())
                # A key seen under an earlier root (or vendored twice) is the same module: keep one.
                files.setdefault(key, SourceFile(key, path))
    return sorted(files.values(), key=lambda f: (_bucket(f.key), f.key))


def read_source(path: Path) -> str | None:
    """The file's text, or None for files that are not plain UTF-8 code of a sensible size."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text or not text.strip():
        return None
    return text


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def iter_documents(split: str, max_bytes: int, roots: Sequence[Path] | None = None) -> Iterator[str]:
    """Texts of the 'train' or 'eval' split, deduplicated, in the fixed order, up to `max_bytes`."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    files = list_files(default_roots() if roots is None else roots)
    seen: set[bytes] = set()
    if split == "train":
        # Held-out texts first, so a copy of one under another (training) path is skipped too.
        for f in files:
            text = read_source(f.path) if f.held_out else None
            if text is not None:
                seen.add(_digest(text))
    total = 0
    for f in files:
        if f.held_out != (split == "eval"):
            continue
        text = read_source(f.path)
        if text is None:
            continue
        digest = _digest(text)
        if digest in seen:
            continue
        seen.add(digest)
        yield text
        total += len(text.encode())
        if total >= max_bytes:
            return
