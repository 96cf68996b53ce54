"""Opening text data files, compressed or not."""
from __future__ import annotations

import gzip
import io
import os
from pathlib import Path
from typing import TextIO, Union

PathLike = Union[str, os.PathLike]

_GZIP_MAGIC = b"\x1f\x8b"


def open_text(path: PathLike, encoding: str = "utf-8") -> TextIO:
    """Open `path` for streaming text reads; gzip files are detected by their magic bytes
    (not only the `.gz` suffix), so renamed archives still read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    with open(path, "rb") as raw:
        magic = raw.read(2)
    # newline="" hands line endings to the csv module, which handles \r\n itself.
    if magic == _GZIP_MAGIC:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding=encoding, newline="")
    return open(path, "r", encoding=encoding, newline="")


def open_text_for_write(path: PathLike, encoding: str = "utf-8") -> TextIO:
    """Open `path` for writing text, gzip-compressed when the name ends in `.gz`."""
    path = Path(path)
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "wb"), encoding=encoding, newline="")
    return open(path, "w", encoding=encoding, newline="")
