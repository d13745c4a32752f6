"""YAML text for a manifest: every value validated and quoted, each sized figure with its source.

Written here rather than with a YAML library's dumper because a figure's source goes beside it
as a comment, which dumpers cannot write. The subset is small (mappings, lists, text, integers,
booleans) and every string is written double-quoted in JSON's escaping, which YAML reads the
same (JSON's escapes are a subset of YAML's): a value can never become a number, a boolean,
``null``, a tag, an anchor or a second key (``"48"``, ``"yes"``, ``"a: b"``, ``"*x"``, a newline).
Keys are written plain, so they are checked instead of quoted. The tests read every manifest
back with PyYAML and compare it to the data it was written from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from torchdoctor.errors import UserError

# A key written plain: what Kubernetes' own keys look like (apiVersion, nvidia.com/gpu).
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
Path = tuple[str | int, ...]


def _outside_yaml(c: str) -> bool:
    """Characters YAML does not allow written as they are (its printable set, YAML 1.1 §5.1);
    written as escapes instead. JSON escapes those below U+0020 already."""
    o = ord(c)
    return o == 0x7F or 0x80 <= o <= 0x9F and o != 0x85 or o in (0xFEFF, 0xFFFE, 0xFFFF)


def scalar(value: object, where: str) -> str:
    """``value`` as a YAML scalar; UserError (naming ``where``) for what YAML cannot hold."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            # Bytes that were not UTF-8 (kept by surrogateescape): no YAML reader takes them.
            raise UserError(f"{where} {value!r}: not valid UTF-8 text; a manifest cannot hold it")
        text = json.dumps(value, ensure_ascii=False)
        return "".join(f"\\u{ord(c):04x}" if _outside_yaml(c) else c for c in text)
    raise TypeError(f"{where}: {type(value).__name__} is not written into manifests")


def comment(text: str) -> str:
    """``text`` safe in a ``#`` comment line: a newline would end the comment and make the rest
    YAML."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def to_yaml(
    doc: Mapping[str, object],
    comments: Mapping[Path, str] | None = None,
    header: Sequence[str] = (),
) -> str:
    """The YAML text of ``doc``; ``comments`` maps a key's path to a line written above it."""
    lines = [f"# {comment(line)}" for line in header]
    _mapping(doc, (), 0, lines, comments or {})
    return "\n".join(lines) + "\n"


def _key(key: object, path: Path) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        where = ".".join(str(p) for p in path) or "manifest"
        raise UserError(f"{where}: key {key!r} cannot be written into a manifest")
    return key


def _mapping(
    doc: Mapping[str, object],
    path: Path,
    indent: int,
    lines: list[str],
    comments: Mapping[Path, str],
    first_prefix: str | None = None,
) -> None:
    pad = " " * indent
    for i, (key, value) in enumerate(doc.items()):
        here = (*path, key)
        name = _key(key, here)
        # The first key of a list item follows its "- " on the same line.
        lead = first_prefix if (i == 0 and first_prefix is not None) else pad
        if here in comments:
            if i == 0 and first_prefix is not None:
                lines.append(f"{first_prefix}# {comment(comments[here])}")
                lead = pad
            else:
                lines.append(f"{pad}# {comment(comments[here])}")
        if isinstance(value, Mapping):
            if not value:
                lines.append(f"{lead}{name}: {{}}")
            else:
                lines.append(f"{lead}{name}:")
                _mapping(value, here, indent + 2, lines, comments)
        elif isinstance(value, list):
            if not value:
                lines.append(f"{lead}{name}: []")
            else:
                lines.append(f"{lead}{name}:")
                _sequence(value, here, indent, lines, comments)
        else:
            lines.append(f"{lead}{name}: {scalar(value, '.'.join(map(str, here)))}")


def _sequence(
    items: list[object], path: Path, indent: int, lines: list[str], comments: Mapping[Path, str]
) -> None:
    pad = " " * indent
    for i, item in enumerate(items):
        here = (*path, i)
        if here in comments:
            lines.append(f"{pad}# {comment(comments[here])}")
        if isinstance(item, Mapping) and item:
            _mapping(item, here, indent + 2, lines, comments, first_prefix=f"{pad}- ")
        elif isinstance(item, Mapping | list):
            lines.append(f"{pad}- {'{}' if isinstance(item, Mapping) else '[]'}")
        else:
            lines.append(f"{pad}- {scalar(item, '.'.join(map(str, here)))}")
