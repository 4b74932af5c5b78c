"""A GGUF file through gguf's GGUFReader, its key/value metadata parsed at most once per process.

    reader = open_reader(path)   # a reader (tensors and all); its metadata is remembered
    fields = metadata(path)      # {key: python value}, tensors not read; the remembered one while the file is unchanged
    open_reader(path, pass_on=True)   # ... and the next open_reader of the unchanged file gets this reader
    let_go(path)                 # or nobody does: a load that took another way (a converted cache)

GGUFReader turns every element of every array field into a numpy view: SmolLM2's 49,152 tokens and
48,900 merges take 3-4 s of pure Python a reader (2-core Zen 3, 2026-12-08), holding the GIL all the
while. A worker used to build four readers of its one file: the start's model check, the weights, the
served file type, and the grammar vocabulary; that last one ran in the background while the first
requests did, and made their steps up to 5x slower for its 4 s. Now the model check passes its reader
on to the weights' load, and the file type and the vocabulary read the metadata it left: one reader.
A passed-on reader (167 MB resident for SmolLM2, most of it the fields' views) is held until that next
open_reader takes it or `let_go` drops it: pass one on only where a load follows.

A file counts as unchanged while its resolved path, inode, size and modification time are; the last
KEEP files' metadata stays (about 10 MB for SmolLM2's vocabulary). The values are shared: read them,
never change them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gguf import GGUFReader

KEEP = 2
_lock = threading.Lock()
_remembered: OrderedDict[tuple, Mapping[str, Any]] = OrderedDict()
_passed_on: dict[tuple, GGUFReader] = {}


def _identity(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns


def _read(path: Path) -> tuple[GGUFReader, Mapping[str, Any]]:
    from gguf import GGUFReader  # heavy import; only GGUF loading needs it

    identity = _identity(path)
    reader = GGUFReader(str(path))
    fields = MappingProxyType({key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")})
    with _lock:
        _remembered[identity] = fields
        _remembered.move_to_end(identity)
        while len(_remembered) > KEEP:
            _remembered.popitem(last=False)
    return reader, fields


def open_reader(path: Path | str, pass_on: bool = False) -> GGUFReader:
    """A GGUFReader of `path`: the one passed on for this unchanged file, else a new one (its metadata
    remembered for `metadata`). pass_on: hold it for the next open_reader of the file (one caller).

    Raises:
        FileNotFoundError: no such file. ValueError: not a GGUF file.
    """
    path = Path(path)
    identity = _identity(path)
    with _lock:
        reader = _passed_on.pop(identity, None)
    if reader is None:
        reader = _read(path)[0]
    if pass_on:
        with _lock:
            _passed_on.clear()
            _passed_on[identity] = reader
    return reader


def metadata(path: Path | str) -> Mapping[str, Any]:
    """The GGUF key/value metadata of `path` as python values (the GGUF.* header entries left out).

    Raises:
        FileNotFoundError: no such file. ValueError: not a GGUF file.
    """
    path = Path(path)
    with _lock:
        fields = _remembered.get(_identity(path))
    return fields if fields is not None else _read(path)[1]


def let_go(path: Path | str) -> None:
    """Drop the reader passed on for `path`, if one is still held (the load took another way)."""
    path = Path(path)
    with _lock:
        for identity in [i for i in _passed_on if i[0] == str(path.resolve())]:
            del _passed_on[identity]
