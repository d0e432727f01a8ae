"""Where stofc finds its templates, CUDA headers and caches.

``templates/`` and ``cuda/`` live at the repository root (the design card's
layout). An editable install and a source checkout find them beside the
package; ``STOFC_HOME`` points elsewhere for an unusual install.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def project_root() -> Path:
    """The directory holding ``templates/`` and ``cuda/``.

    ``$STOFC_HOME`` if set; else the source checkout (or editable install) the
    package lives in; else ``<prefix>/share/stofc`` where a wheel installs them.
    """
    env = os.environ.get("STOFC_HOME")
    if env:
        return Path(env).resolve()
    if (PACKAGE_DIR.parent / "templates").is_dir():
        return PACKAGE_DIR.parent
    installed = Path(sys.prefix) / "share" / "stofc"
    return installed if (installed / "templates").is_dir() else PACKAGE_DIR.parent


def templates_dir() -> Path:
    """The Jinja2 template root (``templates/``)."""
    return project_root() / "templates"


def cuda_dir() -> Path:
    """The hand-written CUDA headers and custom-op library sources (``cuda/``)."""
    return project_root() / "cuda"


def cache_dir() -> Path:
    """The user cache directory for compiled kernels and the tuning database.

    ``STOFC_CACHE_DIR`` overrides; otherwise ``$XDG_CACHE_HOME/stofc`` or
    ``~/.cache/stofc``. Created on first use by whoever writes there.
    """
    env = os.environ.get("STOFC_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "stofc"
