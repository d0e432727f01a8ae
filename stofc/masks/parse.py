"""Reading mask specs: the command-line form ``NAME[:key=value,...]`` and YAML files.

:func:`parse_mask` is the one entry point. Every problem raises
:class:`~stofc.errors.MaskSpecError` with one line that names where (the
command-line text, or the YAML file and line), the family and key, and the
accepted values.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TypeVar

import numpy as np
import yaml

from stofc.errors import LimitError, MaskSpecError, StofcError
from stofc.masks.limits import (
    MAX_ARRAY_BYTES,
    MAX_MASK_NODES,
    MAX_SEQ_LEN,
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
)
from stofc.masks.spec import COMBINE_OPS, ArrayRef, Combine, Family, MaskSpec, Node, Override

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


def _accepted_keys(family: str) -> str:
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
            if reader is None:  # a later format: read the header the private way
                shape, _, dtype = np.lib.format._read_array_header(f, version)
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
    params: dict[str, object] = {}
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
                                hint=f"accepted: {_accepted_keys(name) or 'causal'}")
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
    parts, depth, cur = [], 0, []
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
                                    hint=f"accepted keys for {name}: {_accepted_keys(name)}")
            if key in raw:
                raise MaskSpecError(f"{where}: parameter '{key}' given twice")
            if key != "causal" and key not in FAMILIES[name]:
                raise MaskSpecError(f"{where}: unknown parameter '{key}' for mask family "
                                    f"'{name}'", hint=f"accepted: {_accepted_keys(name)}")
            raw[key] = _cli_value(name, key, value, where)
    return make_family(name, raw, where, base)


# ---------------------------------------------------------------- YAML form


class _LineDict(dict):
    """A YAML mapping that remembers the line of every key (1-based)."""

    line: int = 0
    lines: dict


class _Loader(yaml.SafeLoader):
    """SafeLoader with limits (:mod:`stofc.masks.limits`): nesting depth while composing,
    and the node count with every alias expanded, checked before anything is constructed
    (an alias bomb is a few hundred bytes whose expansion is exponential)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise LimitError(f"line {mark.line + 1}: the YAML nests deeper than "
                                 f"{MAX_YAML_DEPTH} levels",
                                 hint=f"flatten the spec (limit: MAX_YAML_DEPTH = {MAX_YAML_DEPTH})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node):
        _check_expanded_size(node)
        return super().construct_document(node)


def _check_expanded_size(root: yaml.Node) -> None:
    """Raise a LimitError when ``root`` expands to more than MAX_YAML_NODES nodes (an alias
    counts each time it is used) or refers to itself."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise LimitError(f"line {node.start_mark.line + 1}: a YAML alias refers to the "
                             "collection that contains it", hint="remove the recursive alias")
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                break
        active.discard(key)
        sizes[key] = total
        if total > MAX_YAML_NODES:
            raise LimitError(f"the YAML expands to more than {MAX_YAML_NODES} nodes (aliases "
                             "counted each time they are used)",
                             hint=f"write a smaller spec (limit: MAX_YAML_NODES = {MAX_YAML_NODES})")
        return total

    size(root)


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> _LineDict:
    loader.flatten_mapping(node)
    out = _LineDict()
    out.line = node.start_mark.line + 1
    out.lines = {}
    for knode, vnode in node.value:
        if not isinstance(knode, yaml.ScalarNode):
            raise MaskSpecError(f"line {knode.start_mark.line + 1}: a mapping key must be a name "
                                "or a number, not a list or a mapping",
                                hint="write keys such as mask, union, window or \"0-3\"")
        key = loader.construct_object(knode, deep=True)
        if key in out:
            raise MaskSpecError(f"line {knode.start_mark.line + 1}: key '{key}' appears twice")
        out[key] = loader.construct_object(vnode, deep=True)
        out.lines[key] = knode.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)

_NODE_KEYS = ", ".join([*FAMILIES, *COMBINE_OPS, "causal"])


def _yaml_node(obj: object, file: str, line: int, base: Path) -> Node:
    where = f"{file} line {line}"
    if isinstance(obj, str):
        return parse_cli_node(obj, base, where)
    if not isinstance(obj, _LineDict):
        raise MaskSpecError(f"{where}: expected a mask (a mapping such as "
                            f"{{sliding: {{window: 128}}}}), got {obj!r}",
                            hint=f"accepted keys: {_NODE_KEYS}")
    # 'causal: true/false' is the modifier; 'causal: {}' (or null) is the causal family.
    causal = False
    modifier = "causal" in obj and isinstance(obj["causal"], bool)
    if modifier:
        causal = obj["causal"]
    keys = [k for k in obj if not (k == "causal" and modifier)]
    for k in keys:
        if k not in FAMILIES and k not in COMBINE_OPS:
            raise MaskSpecError(f"{file} line {obj.lines[k]}: unknown key '{k}'",
                                hint=f"accepted: {_NODE_KEYS}")
    if len(keys) != 1:
        if not keys and causal:
            return Family("causal", ())
        raise MaskSpecError(f"{where}: a mask level needs exactly one family or "
                            f"union/intersect/subtract, got {keys or 'none'}",
                            hint="nest several masks under union, intersect or subtract")
    key = keys[0]
    kline = obj.lines[key]
    value = obj[key]
    if key in COMBINE_OPS:
        if not isinstance(value, list) or not value:
            raise MaskSpecError(f"{file} line {kline}: '{key}' needs a non-empty list of masks",
                                hint="e.g. union: [{causal: {}}, {global: {first: 1}}]")
        children = tuple(_yaml_node(item, file, getattr(item, "line", kline), base)
                         for item in value)
        return Combine(op=key, children=children, causal=causal)
    if value is None:
        value = _LineDict()
        value.lines = {}
    if not isinstance(value, _LineDict):
        raise MaskSpecError(f"{file} line {kline}: parameters of '{key}' must be a mapping, "
                            f"got {value!r}", hint=f"accepted keys: {_accepted_keys(key)}")
    for pk in value:
        if pk != "causal" and pk not in FAMILIES[key]:
            raise MaskSpecError(f"{file} line {value.lines[pk]}: unknown parameter '{pk}' "
                                f"for mask family '{key}'",
                                hint=f"accepted: {_accepted_keys(key)}")
    key_where = {pk: f"{file} line {pl}" for pk, pl in value.lines.items()}
    return make_family(key, dict(value), f"{file} line {kline}", base, causal=causal,
                       key_where=key_where)


def _range_key(key: object, file: str, line: int, what: str) -> tuple[int, int]:
    text = str(key).strip()
    m = re.match(r"^([0-9]+)(?:\s*-\s*([0-9]+))?$", text) if not isinstance(key, bool) else None
    if not m:
        raise MaskSpecError(f"{file} line {line}: {what} key {key!r} is not an index or range",
                            hint='accepted: an integer such as 3 or a range such as "0-3"')
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if hi < lo:
        raise MaskSpecError(f"{file} line {line}: {what} range '{text}' is empty",
                            hint='write the range low-high, e.g. "0-3"')
    return lo, hi


def _overrides(obj: object, file: str, line: int, base: Path, what: str) -> tuple[Override, ...]:
    if not isinstance(obj, _LineDict):
        raise MaskSpecError(f"{file} line {line}: '{what}' must map indices or ranges to masks",
                            hint=f'e.g. {what}: {{"0-3": {{causal: {{}}}}}}')
    out: list[Override] = []
    for key, value in obj.items():
        kl = obj.lines[key]
        lo, hi = _range_key(key, file, kl, what)
        for o in out:
            if lo <= o.hi and o.lo <= hi:
                raise MaskSpecError(f"{file} line {kl}: {what} '{key}' overlaps '{o.key}'",
                                    hint="give every index at most one override")
        out.append(Override(lo, hi, _yaml_node(value, file, kl, base)))
    return tuple(sorted(out, key=lambda o: o.lo))


def parse_yaml(path: Path) -> MaskSpec:
    file = str(path)
    try:
        if path.stat().st_size > MAX_YAML_BYTES:
            raise LimitError(f"mask file {file} is {path.stat().st_size} bytes, above the "
                             f"{MAX_YAML_BYTES}-byte limit for a YAML spec",
                             hint=f"write a smaller spec (limit: MAX_YAML_BYTES = {MAX_YAML_BYTES})")
        text = path.read_text()
    except OSError as err:
        raise MaskSpecError(f"mask file {file} cannot be read ({err.strerror})",
                            hint="give the path of a .yaml mask spec") from None
    except UnicodeDecodeError as err:
        raise MaskSpecError(f"mask file {file} is not UTF-8 text ({err.reason} at byte "
                            f"{err.start})", hint="save the YAML as UTF-8") from None
    try:
        doc = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except (MaskSpecError, LimitError) as err:
        err.message = f"{file} {err.message}"
        raise
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context, cmark = getattr(err, "context", None), getattr(err, "context_mark", None)
        if context and cmark is not None:
            problem = f"{problem} ({context} started on line {cmark.line + 1})"
        raise MaskSpecError(f"{file}{line}: YAML syntax error: {problem}",
                            hint="fix the YAML (indentation, colons, brackets)") from None
    if not isinstance(doc, _LineDict):
        raise MaskSpecError(f"{file} line 1: expected a mapping with key 'mask'",
                            hint="accepted top-level keys: mask, layers, heads")
    for key in doc:
        if key not in ("mask", "layers", "heads"):
            raise MaskSpecError(f"{file} line {doc.lines[key]}: unknown top-level key '{key}'",
                                hint="accepted top-level keys: mask, layers, heads")
    if "mask" not in doc:
        raise MaskSpecError(f"{file} line {doc.line}: missing key 'mask'",
                            hint="accepted top-level keys: mask, layers, heads")
    base = path.parent
    default = _yaml_node(doc["mask"], file, doc.lines["mask"], base)
    layers = (_overrides(doc["layers"], file, doc.lines["layers"], base, "layers")
              if "layers" in doc else ())
    heads = (_overrides(doc["heads"], file, doc.lines["heads"], base, "heads")
             if "heads" in doc else ())
    spec = MaskSpec(default=default, layers=layers, heads=heads, source=file)
    count = sum(_count_nodes(n) for n in (default, *(o.node for o in (*layers, *heads))))
    if count > MAX_MASK_NODES:
        raise LimitError(f"{file}: the spec has {count} mask families and combinations, above "
                         f"the limit of {MAX_MASK_NODES}",
                         hint=f"write a smaller spec (limit: MAX_MASK_NODES = {MAX_MASK_NODES})")
    return spec


def _count_nodes(node: Node) -> int:
    if isinstance(node, Combine):
        return 1 + sum(_count_nodes(c) for c in node.children)
    return 1


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


def parse_mask(text: str) -> MaskSpec:
    """Parse ``NAME[:key=value,...]`` or the path of a ``.yaml`` / ``.yml`` spec file."""
    try:
        return _parse_mask(text)
    except (MaskSpecError, LimitError) as err:
        raise one_line(err) from None


def _parse_mask(text: str) -> MaskSpec:
    if not isinstance(text, str) or not text.strip():
        raise MaskSpecError("empty mask spec",
                            hint="e.g. causal, sliding:window=128 or a .yaml file")
    text = text.strip()
    if text.lower().endswith((".yaml", ".yml")):
        path = Path(text).expanduser()
        if not path.is_file():
            raise MaskSpecError(f"mask file {text} does not exist",
                                hint="give the path of a .yaml mask spec or NAME[:key=value,...]")
        return parse_yaml(path)
    return MaskSpec(default=parse_cli_node(text), source=text)
