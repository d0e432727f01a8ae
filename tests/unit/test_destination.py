"""Issue 16, data loss: ``-o DIR`` is replaced only when it is a verified stofc package.

Each test names the defect it guards; before the fix ``check_destination`` looked for any
file called ``plan.json`` and then deleted the whole directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

import stofc
from stofc.cli import main
from stofc.errors import PackageError
from stofc.package.destination import check_destination, tmp_prefix
from stofc.pipeline import Instruments, compile_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

MASK = "sliding:window=16"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(build_model(layers=1), str(path))
    return path


def compile_to(example: Path, out: Path, mask: str = MASK) -> Path:
    return compile_model(example, mask, max_seq_len=64, out_dir=out,
                         instruments=Instruments(progress=False))


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), result.output
    assert sum(line.startswith("error: ") for line in lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[-1]


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_directory_with_a_plan_json_is_not_a_package(example, tmp_path):
    """Defect: any directory holding a file named plan.json was deleted by `compile -o`."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "plan.json").write_text('{"my": "plan"}')
    (mine / "thesis.tex").write_text("years of work")
    before = snapshot(mine)
    line = one_error_line(run("compile", str(example), "--mask", MASK, "--max-seq-len", "64",
                              "-o", str(mine), "--quiet"))
    assert "is not a stofc package" in line and "no manifest.json" in line
    assert snapshot(mine) == before


def test_output_set_to_the_models_own_folder_is_refused(example, tmp_path):
    """Defect: `-o` equal to the model's folder would replace the folder with the model in it."""
    folder = tmp_path / "work"
    folder.mkdir()
    model = folder / "model.onnx"
    model.write_bytes(example.read_bytes())
    line = one_error_line(run("compile", str(model), "--mask", MASK, "--max-seq-len", "64",
                              "-o", str(folder), "--quiet"))
    assert f"holds {model}" in line and "reads" in line
    assert model.read_bytes() == example.read_bytes()
    # also when the folder is otherwise a stofc package: the model would still go
    pkg = compile_to(example, tmp_path / "pkg")
    inside = pkg / "copy.onnx"
    inside.write_bytes(example.read_bytes())
    with pytest.raises(PackageError, match="holds"):
        compile_model(inside, MASK, max_seq_len=64, out_dir=pkg,
                      instruments=Instruments(progress=False))
    assert inside.is_file()


def test_a_file_the_manifest_does_not_list_is_named(example, tmp_path):
    """A verified package with a user's file added is not replaced; the file is named."""
    pkg = compile_to(example, tmp_path / "pkg")
    (pkg / "kernels" / "notes.md").write_text("mine")
    before = snapshot(pkg)
    line = one_error_line(run("compile", str(example), "--mask", "causal", "--max-seq-len", "64",
                              "-o", str(pkg), "--quiet"))
    assert "kernels/notes.md is not in its manifest.json" in line
    assert snapshot(pkg) == before


@pytest.mark.parametrize("edit", ["format", "version", "garbage"])
def test_a_manifest_that_is_not_stofcs_is_refused(example, tmp_path, edit):
    pkg = compile_to(example, tmp_path / "pkg")
    manifest = pkg / "manifest.json"
    data = json.loads(manifest.read_text())
    if edit == "format":
        data["format"] = "someone-else"
        manifest.write_text(json.dumps(data))
    elif edit == "version":
        data["manifest_version"] = 99
        manifest.write_text(json.dumps(data))
    else:
        manifest.write_text("not json")
    before = snapshot(pkg)
    with pytest.raises(PackageError, match="is not a stofc package"):
        check_destination(pkg)
    with pytest.raises(PackageError):
        compile_to(example, pkg, "causal")
    assert snapshot(pkg) == before


def test_a_verified_package_is_replaced_and_symlinks_are_refused(example, tmp_path):
    pkg = compile_to(example, tmp_path / "pkg")
    compile_to(example, pkg, "causal")
    assert json.loads((pkg / "plan.json").read_text())["mask"]["spec"] == "causal"
    stofc.load(pkg, providers=["CPUExecutionProvider"])
    link = tmp_path / "link"
    link.symlink_to(pkg)
    with pytest.raises(PackageError, match="symbolic link"):
        compile_to(example, link)


def test_the_mask_file_may_not_live_in_the_output(example, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spec = out / "mask.yaml"
    spec.write_text("mask: {causal: {}}\n")
    with pytest.raises(PackageError, match=r"mask\.yaml"):
        compile_to(example, out, str(spec))
    assert spec.is_file()


def _hold_lock(path: Path) -> subprocess.Popen:
    """A process that holds an flock on ``path`` (a live writer) until killed."""
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_stale_temporaries_are_swept_but_a_live_one_is_kept(example, tmp_path):
    """Defect: a killed compile's .NAME.stofc.tmp-* stayed forever. The next write removes
    the ones no live process holds (flock), never another compile's, nor other files."""
    out = tmp_path / "model.stofc"
    stale = tmp_path / f"{tmp_prefix(out)}abcd1234"
    (stale / "kernels").mkdir(parents=True)
    (stale / "kernels" / "k.cubin").write_bytes(b"half")
    old = tmp_path / ".model.stofc.old-zz99yy88"
    old.mkdir()
    live = tmp_path / f"{tmp_prefix(out)}live5678"
    live.mkdir()
    unrelated = tmp_path / ".model.stofc.tmp-notmine-at-all"
    unrelated.mkdir()
    holder = _hold_lock(live)
    try:
        compile_to(example, out)
        assert not stale.exists() and not old.exists()
        assert live.is_dir() and unrelated.is_dir()
    finally:
        holder.kill()
        holder.wait()
    compile_to(example, out, "causal")   # the holder is gone: now it is stale
    assert not live.exists() and unrelated.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [out.name, unrelated.name])


def test_the_package_is_swapped_in_while_locked_and_leaves_nothing(example, tmp_path,
                                                                   monkeypatch):
    """While a package is built its temporary directory is locked by the writer."""
    seen = {}
    from stofc.package import destination

    real_swap = destination._swap

    def spy(new, dest):
        fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["locked"] = False
            except BlockingIOError:
                seen["locked"] = True
        finally:
            os.close(fd)
        return real_swap(new, dest)

    monkeypatch.setattr(destination, "_swap", spy)
    compile_to(example, tmp_path / "pkg")
    assert seen == {"locked": True}
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]
