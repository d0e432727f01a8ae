"""Errors that reach the user.

Every error a user can cause is a :class:`StofcError`: the command line prints
its one-line message (``str(err)``) and exits with code 2, with no traceback.
Subclasses say which stage raised it and carry what the user needs to fix it
(a file and line, an operator, a compiler log).
"""

from __future__ import annotations


class StofcError(Exception):
    """A problem the user can fix. ``str()`` is one line: the problem, then the fix."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message)

    def __str__(self) -> str:
        text = self.message.rstrip(".")
        return f"{text}; {self.hint}" if self.hint else text


class ModelError(StofcError):
    """The ONNX model cannot be read or understood."""


class MaskSpecError(StofcError):
    """A mask spec (command line, YAML, layout or bitmap file) is invalid."""


class PlanError(StofcError):
    """No executable fusion plan exists for what was asked."""


class CompileError(StofcError):
    """NVRTC rejected a rendered kernel. Carries the log and the dumped source path."""

    def __init__(self, message: str, *, log: str = "", source_path: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.log = log
        self.source_path = source_path

    def __str__(self) -> str:
        first = self.log.strip().splitlines()[0] if self.log.strip() else ""
        where = f" (source: {self.source_path})" if self.source_path else ""
        detail = f": {first}" if first else ""
        fix = f"; {self.hint}" if self.hint else ""
        return f"{self.message}{detail}{where}{fix}"


class TargetError(StofcError):
    """An unknown GPU name, or a GPU that does not match the one asked for."""


class DeviceError(StofcError):
    """A GPU is needed and is missing, or a kernel launch failed."""


class PackageError(StofcError):
    """A package directory is missing, incomplete or was edited."""


class FileSystemError(StofcError):
    """A file or directory cannot be read or written (read-only, permissions, disk full,
    missing parent); the message names the path and the operating system's reason."""


class LimitError(StofcError):
    """A request exceeds a documented size limit (sequence length, memory, YAML size)."""


class CheckError(StofcError):
    """The package just written does not compute the model (``stofc compile``'s check)."""


class RegistryError(ValueError):
    """Two registered units claiming one key (a kernel family's name or (segment,
    template) pair, a segment kind's emitter or runtime executor, an attention family's
    launch form): raised at import time, so two modules never silently replace each other."""
