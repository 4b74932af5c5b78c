"""A GGUF file through gguf's GGUFReader, its key/value metadata parsed at most once per process.

    reader = open_reader(path)   # a new reader (tensors and all); its metadata is remembered
    fields = metadata(path)      # {key: python value}, tensors not read; the remembered one while the file is unchanged

GGUFReader turns every element of every array field into a numpy view: SmolLM2's 49,152 tokens and
48,900 merges take 3-4 s of pure Python a reader (2-core Zen 3, 2026-12-08), holding the GIL all the
while. A worker used to build four readers of its one file: the start's model check, the weights, the
served file type, and the grammar vocabulary; that last one ran in the background while the first
requests did, and made their steps up to 5x slower for its 4 s. The model check and the weights still
need a reader each (tensors); the file type and the vocabulary now read the metadata those left.

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


def open_reader(path: Path | str) -> GGUFReader:
    """A new GGUFReader of `path`; its metadata is remembered for `metadata`.

    Raises:
        FileNotFoundError: no such file. ValueError: not a GGUF file.
    """
    return _read(Path(path))[0]


def metadata(path: Path | str) -> Mapping[str, Any]:
    """The GGUF key/value metadata of `path` as python values (the GGUF.* header entries left out).

    Raises:
        FileNotFoundError: no such file. ValueError: not a GGUF file.
    """
    path = Path(path)
    with _lock:
        fields = _remembered.get(_identity(path))
    return fields if fields is not None else _read(path)[1]
