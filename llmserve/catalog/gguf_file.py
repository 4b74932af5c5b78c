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
A passed-on reader (167 MB resident for SmolLM2, most of it the fields' views) is held until the next
open_reader (it gets the reader where its file is the same, unchanged) or `let_go`: pass one on only
where a load follows.

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
_passed_on: tuple[tuple, GGUFReader] | None = None   # (file identity, reader): one at most


def _identity(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns


def _read(path: Path, identity: tuple) -> tuple[GGUFReader, Mapping[str, Any]]:
    from gguf import GGUFReader  # heavy import; only GGUF loading needs it

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
    remembered for `metadata`); one passed on for another file is dropped. pass_on: hold this one for
    the next open_reader.

    Raises:
        FileNotFoundError: no such file. ValueError: not a GGUF file.
    """
    global _passed_on
    path = Path(path)
    identity = _identity(path)
    with _lock:
        held, _passed_on = _passed_on, None
    reader = held[1] if held is not None and held[0] == identity else _read(path, identity)[0]
    if pass_on:
        with _lock:
            _passed_on = (identity, reader)
    return reader


def metadata(path: Path | str) -> Mapping[str, Any]:
    """The GGUF key/value metadata of `path` as python values (the GGUF.* header entries left out).

    Raises:
        FileNotFoundError: no such file. ValueError: not a GGUF file.
    """
    path = Path(path)
    identity = _identity(path)
    with _lock:
        fields = _remembered.get(identity)
    return fields if fields is not None else _read(path, identity)[1]


def let_go(path: Path | str) -> None:
    """Drop the reader passed on for `path`, if one is still held (the load took another way)."""
    global _passed_on
    with _lock:
        if _passed_on is not None and _passed_on[0][0] == str(Path(path).resolve()):
            _passed_on = None
