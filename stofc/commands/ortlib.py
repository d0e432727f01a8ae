"""``stofc ortlib``: build the ONNX Runtime custom-op library on its own."""

from __future__ import annotations

import click

from stofc.package.ort_headers import find_ort_headers
from stofc.package.ortlib import build_library


@click.command("ortlib")
@click.option("-o", "--out", "out_dir", default=".", show_default=True,
              type=click.Path(file_okay=False), help="Directory to write libstofc_ort.so into.")
@click.option("--ort-include", type=click.Path(), default=None,
              help="Directory holding onnxruntime_cxx_api.h (API >= 21). Default: "
                   "$STOFC_ORT_INCLUDE, /usr/include/onnxruntime, the cache, else apt.")
@click.option("--cxx", default=None, help="C++17 compiler. Default: $CXX, else g++.")
def ortlib(out_dir: str, ort_include: str | None, cxx: str | None) -> None:
    """Build libstofc_ort.so (the ai.stofc ops for ONNX Runtime) into OUT.

    The library is cached; the ops and how to load it are in cuda/ort/OPS.md.
    """
    headers = find_ort_headers(ort_include)
    path = build_library(out_dir, ort_include=headers.include_dir, compiler=cxx)
    click.echo(f"{path}  (ONNX Runtime API {headers.api_version} headers from {headers.source}: "
               f"{headers.include_dir})")
