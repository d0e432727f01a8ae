"""Reading mask specs: the command-line form ``NAME[:key=value,...]`` and YAML files.

:func:`parse_mask` is the one entry point. Every problem raises
:class:`~stofc.errors.MaskSpecError` with one line that names where (the
command-line text, or the YAML file and line), the family and key, and the
accepted values.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from stofc.errors import LimitError, MaskSpecError
from stofc.masks.cli_form import (
    FAMILIES,
    accepted_keys,
    make_family,
    one_line,
    parse_cli_node,
)
from stofc.masks.limits import (
    MAX_MASK_NODES,
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
)
from stofc.masks.spec import COMBINE_OPS, Combine, Family, MaskSpec, Node, Override

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
                            f"got {value!r}", hint=f"accepted keys: {accepted_keys(key)}")
    for pk in value:
        if pk != "causal" and pk not in FAMILIES[key]:
            raise MaskSpecError(f"{file} line {value.lines[pk]}: unknown parameter '{pk}' "
                                f"for mask family '{key}'",
                                hint=f"accepted: {accepted_keys(key)}")
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
