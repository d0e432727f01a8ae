"""Mask families and their parameters, and the command-line form ``NAME[:key=value,...]``.

:data:`FAMILIES` names every family of MASKS.md with its parameters' kinds;
:func:`make_family` validates parameters (already typed) into a
:class:`~stofc.masks.spec.Family`, loading ``.npy`` arrays within stofc's limits;
:func:`parse_cli_node` reads the command-line form. The YAML form and the entry point
:func:`~stofc.masks.parse.parse_mask` are in :mod:`stofc.masks.parse`.
"""


from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TypeVar

import numpy as np

from stofc.errors import LimitError, MaskSpecError, StofcError
from stofc.masks.limits import (
    MAX_ARRAY_BYTES,
    MAX_SEQ_LEN,
)
from stofc.masks.spec import ArrayRef, Family

# Parameter kinds and what a user may write for them.
ACCEPTED = {
    "int0": "an integer >= 0",
    "int1": "an integer >= 1",
    "odd": "an odd integer >= 1",
    "tokens": "a list of integers >= 0, e.g. [0,17,255]",
    "file": "a path to a .npy file of bools",
    "bool": "true or false",
}
MAX_INT = 2**31 - 1

# family -> {parameter: kind}; every parameter is required unless in DEFAULTS.
FAMILIES: dict[str, dict[str, str]] = {
    "dense": {},
    "causal": {},
    "sliding": {"window": "int0"},
    "global": {"tokens": "tokens", "first": "int0"},
    "longformer": {"window": "int0", "global": "int0"},
    "bigbird": {"block": "int1", "window": "odd", "global": "int0", "random": "int0",
                "seed": "int0"},
    "strided": {"stride": "int1"},
    "dilated": {"window": "int0", "dilation": "int1"},
    "blocksparse": {"layout": "file", "block": "int1"},
    "bitmap": {"file": "file"},
}
DEFAULTS: dict[tuple[str, str], int] = {("bigbird", "seed"): 0}
_INT_RE = re.compile(r"^[0-9]+$")
E = TypeVar("E", bound=StofcError)


def accepted_keys(family: str) -> str:
    return ", ".join([*FAMILIES[family], "causal"])


def _check_int(value: object, kind: str, where: str, family: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MaskSpecError(f"{where}: {family} parameter '{key}' is {value!r}",
                            hint=f"accepted: {ACCEPTED[kind]}")
    low = 0 if kind == "int0" else 1
    if value < low or value > MAX_INT or (kind == "odd" and value % 2 == 0):
        what = "even" if kind == "odd" and value % 2 == 0 and value >= low else "out of range"
        raise MaskSpecError(f"{where}: {family} parameter '{key}' = {value} is {what}",
                            hint=f"accepted: {ACCEPTED[kind]}")
    return value


def load_array(path_text: str, base: Path | None, where: str, family: str, key: str) -> ArrayRef:
    """Read a bool ``[N, N]`` or ``[H, N, N]`` ``.npy`` file into a content-named ArrayRef."""
    if not isinstance(path_text, str) or not path_text:
        raise MaskSpecError(f"{where}: {family} parameter '{key}' is {path_text!r}",
                            hint=f"accepted: {ACCEPTED['file']}")
    path = Path(path_text).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    try:
        _check_array_header(path, where, family, key)
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise MaskSpecError(f"{where}: {family} {key} file {path} does not exist",
                            hint="give the path of a .npy file of bools") from None
    except LimitError:
        raise
    except Exception as err:  # numpy raises several types for a non-.npy file
        raise MaskSpecError(f"{where}: {family} {key} file {path} is not a readable .npy array "
                            f"({type(err).__name__})", hint="save it with numpy.save") from None
    if not isinstance(arr, np.ndarray) or arr.dtype != np.bool_:
        dtype = getattr(arr, "dtype", type(arr).__name__)
        raise MaskSpecError(f"{where}: {family} {key} file {path} has dtype {dtype}",
                            hint="accepted: dtype bool (numpy.save(path, array.astype(bool)))")
    if arr.ndim not in (2, 3) or arr.shape[-1] != arr.shape[-2] or 0 in arr.shape:
        raise MaskSpecError(f"{where}: {family} {key} file {path} has shape {list(arr.shape)}",
                            hint="accepted: a square [N, N] or per-head [H, N, N] array")
    arr = np.ascontiguousarray(arr)
    arr.flags.writeable = False
    digest = hashlib.sha256(f"{arr.shape}".encode() + arr.tobytes()).hexdigest()
    return ArrayRef(sha256=digest, shape=tuple(int(s) for s in arr.shape), path=str(path),
                    data=arr)


def _check_array_header(path: Path, where: str, family: str, key: str) -> None:
    """Refuse an array too large for stofc from its ``.npy`` header, before reading it."""
    if not path.is_file():
        return  # np.load reports a missing file
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            reader = {(1, 0): np.lib.format.read_array_header_1_0,
                      (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if reader is None:  # a later format: read the header the private (untyped) way
                read = np.lib.format._read_array_header  # type: ignore[attr-defined]
                shape, _, dtype = read(f, version)
            else:
                shape, _, dtype = reader(f)
    except Exception:  # not a .npy file: np.load reports it
        return
    size = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize if shape else dtype.itemsize
    if size > MAX_ARRAY_BYTES or (len(shape) >= 2 and shape[-1] > MAX_SEQ_LEN):
        raise LimitError(f"{where}: {family} {key} file {path} holds an array of shape "
                         f"{list(shape)} ({size} bytes), above stofc's limits "
                         f"({MAX_ARRAY_BYTES} bytes, N <= {MAX_SEQ_LEN})",
                         hint="use a smaller layout or bitmap")


def make_family(name: str, raw: dict[str, object], where: str, base: Path | None,
                causal: bool = False, key_where: dict[str, str] | None = None) -> Family:
    """Validate ``raw`` parameters (already typed: int, bool, list, str) into a Family.

    ``key_where`` gives a more precise location (a YAML line) per parameter.
    """
    key_where = key_where or {}
    if name not in FAMILIES:
        raise MaskSpecError(f"{where}: unknown mask family '{name}'",
                            hint=f"accepted: {', '.join(FAMILIES)}")
    kinds = FAMILIES[name]
    params: dict[str, int | tuple[int, ...] | ArrayRef] = {}
    for key, value in raw.items():
        at = key_where.get(key, where)
        if key == "causal":
            if not isinstance(value, bool):
                raise MaskSpecError(f"{at}: {name} parameter 'causal' is {value!r}",
                                    hint=f"accepted: {ACCEPTED['bool']}")
            causal = causal or value
            continue
        if key not in kinds:
            raise MaskSpecError(f"{at}: unknown parameter '{key}' for mask family '{name}'",
                                hint=f"accepted: {accepted_keys(name) or 'causal'}")
        kind = kinds[key]
        if kind == "file":
            params[key] = load_array(value, base, at, name, key)  # type: ignore[arg-type]
        elif kind == "tokens":
            items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
            if not isinstance(items, (list, tuple)):
                raise MaskSpecError(f"{at}: {name} parameter '{key}' is {value!r}",
                                    hint=f"accepted: {ACCEPTED[kind]}")
            toks = [_check_int(t, "int0", at, name, key) for t in items]
            params[key] = tuple(sorted(set(toks)))
        else:
            params[key] = _check_int(value, kind, at, name, key)
    if name == "global":
        if ("tokens" in params) == ("first" in params):
            raise MaskSpecError(f"{where}: mask family 'global' needs exactly one of 'tokens' "
                                "or 'first'", hint="e.g. global:first=2 or global:tokens=[0,17]")
    else:
        for key in kinds:
            if key not in params:
                if (name, key) in DEFAULTS:
                    params[key] = DEFAULTS[(name, key)]
                else:
                    raise MaskSpecError(f"{where}: mask family '{name}' needs parameter '{key}'",
                                        hint=f"accepted: {ACCEPTED[kinds[key]]}")
    return Family(name=name, params=tuple(sorted(params.items())), causal=causal)


# ---------------------------------------------------------------- command-line form


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _cli_value(name: str, key: str, text: str, where: str) -> object:
    kind = "bool" if key == "causal" else FAMILIES.get(name, {}).get(key, "int0")
    text = text.strip()
    if kind == "bool":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise MaskSpecError(f"{where}: {name} parameter 'causal' is {text!r}",
                            hint=f"accepted: {ACCEPTED['bool']}")
    if kind == "file":
        return text
    if kind == "tokens":
        body = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        items = [t.strip() for t in body.replace(";", ",").split(",") if t.strip()]
        if not all(_INT_RE.match(t) for t in items):
            raise MaskSpecError(f"{where}: {name} parameter '{key}' is {text!r}",
                                hint=f"accepted: {ACCEPTED[kind]}")
        return [int(t) for t in items]
    if not _INT_RE.match(text):
        raise MaskSpecError(f"{where}: {name} parameter '{key}' is {text!r}",
                            hint=f"accepted: {ACCEPTED.get(kind, ACCEPTED['int0'])}")
    return int(text)


def parse_cli_node(text: str, base: Path | None = None, where: str | None = None) -> Family:
    """``NAME`` or ``NAME:key=value,key=value`` (lists as ``tokens=[0,17]``)."""
    where = where or f"mask '{text}'"
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if name not in FAMILIES:
        raise MaskSpecError(f"{where}: unknown mask family '{name}'",
                            hint=f"accepted: {', '.join(FAMILIES)} (or a .yaml file)")
    raw: dict[str, object] = {}
    if rest.strip():
        for item in _split_top(rest):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise MaskSpecError(f"{where}: '{item}' is not key=value",
                                    hint=f"accepted keys for {name}: {accepted_keys(name)}")
            if key in raw:
                raise MaskSpecError(f"{where}: parameter '{key}' given twice")
            if key != "causal" and key not in FAMILIES[name]:
                raise MaskSpecError(f"{where}: unknown parameter '{key}' for mask family "
                                    f"'{name}'", hint=f"accepted: {accepted_keys(name)}")
            raw[key] = _cli_value(name, key, value, where)
    return make_family(name, raw, where, base)


def one_line(err: E) -> E:
    """Escape control characters a user put in the spec so the message stays one line."""
    def clean(text: str | None) -> str | None:
        if text is None:
            return None
        return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                       for ch in text)

    err.message = clean(err.message) or ""
    err.hint = clean(err.hint)
    return err
