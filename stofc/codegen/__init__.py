"""Code generation: Jinja2 templates (``templates/``) to CUDA C++ sources.

One :class:`jinja2.Environment` with ``StrictUndefined``: a value the template
names and the caller does not pass fails loudly. Templates are logic-free:
Python decides every value, the template substitutes. ``cuda/`` headers are
not inlined here; NVRTC finds them on its include path (``stofc.compile``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import jinja2

from stofc.paths import templates_dir


@dataclass(frozen=True)
class Source:
    """A rendered CUDA translation unit.

    ``name`` is a stable, file-name-safe identifier (used for dumps and the
    package's ``kernels/`` directory); ``entry_points`` are the ``extern "C"``
    kernel names it defines; ``params`` are the values it was rendered with.
    """

    name: str
    code: str
    template: str
    entry_points: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def sha256(self) -> str:
        """Hash of the code, the first part of every compile cache key."""
        return hashlib.sha256(self.code.encode()).hexdigest()


@cache
def environment() -> jinja2.Environment:
    """The one template environment (StrictUndefined, no autoescape, keep newlines)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, name: str, entry_points: tuple[str, ...], **values: Any) -> Source:
    """Render ``templates/<template>`` with ``values`` into a :class:`Source`.

    Raises ``jinja2.UndefinedError`` when the template uses a value not given:
    that is a bug in the caller, not a user error.
    """
    code = environment().get_template(template).render(**values)
    return Source(name=name, code=code, template=template, entry_points=entry_points,
                  params=tuple(sorted(values.items())))


@dataclass(frozen=True)
class RenderedKernel:
    """A rendered source with how its family compiles it: the NVRTC ``options`` and, per
    package target (``sm_90``, ``compute_90``), the NVRTC target (``sm_90a`` for a kernel
    using sm_90a-only instructions)."""

    source: Source
    options: tuple[str, ...] = ()
    targets: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.source.name

    def nvrtc_target(self, target: str) -> str:
        """The NVRTC target for package target ``target``."""
        return dict(self.targets).get(target, target)
