"""A property of the whole command line (issue 16): every command, given bad input, exits
0 or 2 and never prints a traceback; exit 2 is exactly one ``error:`` line, the last.

For each command (found by walking the click group, so a new command is covered
without editing this file) hypothesis draws arguments from the command's own
parameters: paths from a pool of bad files and damaged packages (missing, empty,
garbage, truncated ONNX, a plan.json edited, a manifest re-signed around garbage, an
alias bomb ...), numbers from extremes, texts from junk and near-misses, flags at
random, plus stray tokens. Nothing in the pool lets an expensive command (a compile,
a library build) run to completion; each case has a deadline.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import click
import onnx
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stofc.cli import main
from stofc.package.manifest import build_manifest, read_manifest, write_manifest
from stofc.pipeline import Instruments, compile_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> dict[str, click.Command]:
    out = {}
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            out.update(_commands(cmd, (*path, name)))
        else:
            out[" ".join((*path, name))] = cmd
    return out


COMMANDS = _commands(main)


def _resign(pkg: Path) -> None:
    m = read_manifest(pkg)
    write_manifest(pkg, build_manifest(pkg, stofc=m.stofc, gpu=m.gpu, arch=m.arch, ptx=m.ptx,
                                       dtype=m.dtype))


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> dict[str, list[str]]:
    """Bad inputs by kind; the good model and package only where they cannot run long."""
    root = tmp_path_factory.mktemp("pool")
    model = root / "good.onnx"
    onnx.save(build_model(layers=1), str(model))
    good = compile_model(model, "causal", max_seq_len=64, out_dir=root / "good.stofc",
                         instruments=Instruments(progress=False))
    (root / "empty.onnx").write_bytes(b"")
    (root / "garbage.onnx").write_bytes(b"\x00\xffnot protobuf" * 50)
    (root / "truncated.onnx").write_bytes(model.read_bytes()[:3000])
    (root / "adir").mkdir()
    (root / "notes.txt").write_text("hello")
    damaged = {}
    for name in ("edited", "resigned_plan", "resigned_arch", "resigned_mask", "resigned_lib",
                 "resigned_model", "no_manifest"):
        pkg = Path(shutil.copytree(good, root / f"{name}.stofc"))
        damaged[name] = pkg
    doc = json.loads((good / "plan.json").read_text())
    doc["plan"]["max_seq_len"] = "long"
    (damaged["edited"] / "plan.json").write_text(json.dumps(doc))
    (damaged["resigned_plan"] / "plan.json").write_text(json.dumps({**doc, "mask": 7}))
    manifest = json.loads((good / "manifest.json").read_text())
    (damaged["resigned_arch"] / "manifest.json").write_text(json.dumps({**manifest,
                                                                        "arch": "sm_x"}))
    npz = next((damaged["resigned_mask"] / "masks").glob("*.npz"))
    npz.write_bytes(npz.read_bytes()[:200])
    (damaged["resigned_lib"] / "libstofc_ort.so").write_bytes(b"\x7fELF" + b"\0" * 100)
    (damaged["resigned_model"] / "model.onnx").write_bytes(b"garbage")
    for name in ("resigned_plan", "resigned_mask", "resigned_lib", "resigned_model"):
        _resign(damaged[name])
    (damaged["no_manifest"] / "manifest.json").unlink()
    (root / "bomb.yaml").write_text("a0: &a0 {causal: {}}\n" + "".join(
        f"a{i}: &a{i} {{union: [*a{i - 1}, *a{i - 1}, *a{i - 1}]}}\n" for i in range(1, 12))
        + "mask: *a11\n")
    (root / "deep.yaml").write_text("mask: " + "{union: [" * 300 + "causal" + "]}" * 300 + "\n")
    (root / "cache").mkdir()
    bad_files = [str(root / n) for n in ("missing.onnx", "empty.onnx", "garbage.onnx",
                                         "truncated.onnx", "adir", "notes.txt", "bomb.yaml")]
    packages = [str(p) for p in damaged.values()] + [str(root / "adir"), str(root / "nowhere")]
    return {
        "models": bad_files,                          # compile never gets a model that works
        "models_or_good": [*bad_files, str(model)],   # inspect / verify --model may
        "packages": packages, "packages_or_good": [*packages, str(good)],
        "outputs": [str(root / "out" / "x.png"), str(root / "notes.txt"), str(root / "adir"),
                    str(root / "o.npy"), str(root / "o.npz"), "/proc/none/x.npy", ""],
        "specs": ["causal", "sliding:window=3", "bigbird:block=4,window=3,global=1,random=1",
                  "bogus", "", "causal:causal=maybe", str(root / "bomb.yaml"),
                  str(root / "deep.yaml"), str(root / "missing.yaml"), "global:tokens=[1,x]"],
        "root": [str(root)],
    }


INTS = st.one_of(st.sampled_from(["1", "2", "64"]), st.sampled_from(["1", "2", "64"]),
                 st.sampled_from(["-5", "0", "x", "", "1e3", "999999999999"]),
                 st.integers(-2**63, 2**63).map(str))
FLOATS = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "0.5", "x", "1e308"])
TEXTS = st.one_of(st.sampled_from(["h100", "auto", "a100", "tpu9", "", "-", "--", "causal"]),
                  st.text(max_size=8))
SPECIAL = {  # (command, parameter) -> kind of pool values
    ("compile", "model"): "models", ("inspect", "model"): "models_or_good",
    ("verify", "model"): "models_or_good", ("bench", "model"): "models_or_good",
    ("verify", "package"): "packages_or_good", ("bench", "package"): "packages",
    ("tune", "package_dir"): "packages",
}


def _values(command: str, param: click.Parameter, pool: dict[str, list[str]]):
    kind = SPECIAL.get((command.split()[0], param.name or ""))
    if kind:
        return st.sampled_from(pool[kind])
    if param.name in ("spec", "mask_spec", "mask"):
        return st.one_of(st.sampled_from(pool["specs"]), st.text(max_size=12))
    if param.name in ("output", "out_dir", "json_out", "plot_path", "dump_dir"):
        return st.sampled_from(pool["outputs"])
    ptype = param.type
    if isinstance(ptype, click.Choice):
        return st.one_of(st.sampled_from(list(ptype.choices)), TEXTS)
    if isinstance(ptype, (click.types.IntParamType, click.IntRange)):
        return INTS
    if isinstance(ptype, click.types.FloatParamType):
        return FLOATS
    if isinstance(ptype, click.Path):
        return st.one_of(st.sampled_from(pool["models"] + pool["packages"]), TEXTS)
    return TEXTS


@st.composite
def arguments(draw, command: str, pool: dict[str, list[str]]) -> list[str]:
    cmd = COMMANDS[command]
    args: list[str] = command.split()
    for param in cmd.params:
        if isinstance(param, click.Argument):
            if draw(st.integers(0, 9)):   # usually given
                args.append(draw(_values(command, param, pool)))
            continue
        assert isinstance(param, click.Option)
        if not draw(st.booleans()):
            continue
        flag = draw(st.sampled_from(param.opts))
        if param.is_flag:
            args.append(flag)
        else:
            for _ in range(draw(st.integers(1, 2)) if param.multiple else 1):
                args += [flag, draw(_values(command, param, pool))]
    if not draw(st.integers(0, 4)):   # now and then a stray token
        args.append(draw(st.sampled_from(["--bogus", "extra", "-", "--", "\0"])))
    if command == "ortlib":   # never a real library build: headers from nowhere
        args += ["--ort-include", pool["root"][0] + "/no-headers-here"]
    return args


def check(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    event(f"exit {result.exit_code}")
    text = result.output
    assert "Traceback" not in text, (args, text)
    assert result.exit_code in (0, 2), (args, result.exit_code, text, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    if result.exit_code == 2:
        lines = [line for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error: ")]
        assert len(errors) == 1 and lines[-1] == errors[0], (args, text)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_given_bad_input_exits_0_or_2_in_one_line(command, pool, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path / "cache"))   # `cache clear --yes` too
    monkeypatch.chdir(tmp_path)

    @settings(max_examples=30, deadline=20000, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(args=arguments(command, pool))
    def run(args):
        check(args)

    run()
