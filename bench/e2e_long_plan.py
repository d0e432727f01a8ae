"""What ``bench/e2e_long.py`` runs: its arguments, and per model the cases, target points
and stages (:class:`Run`, the state a model carries across the stages)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from e2e_long_models import MODELS, LongModel
from e2e_models import parse_cases

SHORT_MAX = 512  # --cases: a case this long or shorter is a short point (graphs, rounds)
# the --rehearse run: toy models, L_max 512, these cases (short up to 128), its verify case
REHEARSAL_MAX, REHEARSAL_CASES, REHEARSAL_SHORT = 512, "1:512 2:384 1:128", 128
REHEARSAL_VERIFY = (2, 384)
STAGES = ("prep", "packages", "core_key", "check", "torch_key", "graph", "core_rest",
          "torch_rest", "profile")
BLOCKS = (("prep",), ("packages", "core_key"), ("check",), ("torch_key",), ("graph",),
          ("core_rest",), ("torch_rest",), ("profile",))
PART_OF = {"prep": "core", "packages": "core", "core_key": "core", "core_rest": "core",
           "torch_key": "torch", "torch_rest": "torch", "graph": "graph", "check": "check",
           "profile": "profile"}


def arguments(argv=None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="bench/e2e_long.py", description="Long-context end to end on the GPU, one "
        "process: stofc packages vs ORT vs torch.compile (see the script's docstring).")
    p.add_argument("--out", default=env("OUT", "bench/results"))
    p.add_argument("--work", default="/tmp/stofc-e2e-long")
    p.add_argument("--models", default=env("E2E_MODELS", "bert32k"),
                   help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--masks", default=env("E2E_MASKS"),
                   help="only these of each model's masks (table names, comma-separated)")
    p.add_argument("--cases", default=env("E2E_CASES"),
                   help='"B:L ..." instead of each model\'s own cases (long and short)')
    p.add_argument("--parts", default=env("E2E_PARTS", "core,torch,graph,check"),
                   help="core (stofc/ORT), torch (Flex/SDPA/FA4), graph (CUDA graphs), "
                        "check (fp32 torch reference at the longest point), profile; or "
                        f"single stages ({', '.join(STAGES[2:])}); prep and packages run "
                        "whenever a stage needs them (a warm --work dir is reused)")
    p.add_argument("--profile", action="store_true", help="add the profile part")
    p.add_argument("--profile-cases", default="1:8192 1:16384")
    p.add_argument("--deadline", type=float, default=float(env("E2E_DEADLINE_S", "500")),
                   help="seconds from start after which nothing new starts")
    p.add_argument("--tag", default=env("E2E_TAG", ""), help="appended to the file names")
    p.add_argument("--compile-wait", type=float, default=0.0,
                   help="seconds a model's packages may still compile after its ORT model is "
                        "built (0: until the deadline's reserve); a compile still running "
                        "then is killed and recorded")
    p.add_argument("--ort-site", default=env("STOFC_ORT_SITE"),
                   help="directory holding an onnxruntime with the CUDA EP (put first on sys.path)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--table-from", nargs="+", default=None, metavar="JSONL")
    p.add_argument("--selftest", action="store_true")
    p.add_argument("--rehearse", action="store_true",
                   help="run the whole flow on the CPU with toy models (ORT CPU EP, packages "
                        "on the CPU twins, torch on the CPU, no CUDA graphs): checks the "
                        "script before a device call; no figure means anything")
    args = p.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    parts = set(args.parts.split(",")) | ({"profile"} if args.profile else set())
    bad = parts - set(PART_OF.values()) - set(STAGES)
    if bad:
        p.error(f"unknown part(s) {', '.join(sorted(bad))}; known: core, torch, graph, check, "
                f"profile and the stages {', '.join(STAGES[2:])}")
    args.part_set = parts
    if args.rehearse:  # the CPU runs the flow, not the timings: few runs each
        args.warmup, args.repeat = min(args.warmup, 1), min(args.repeat, 3)
    return args


@dataclass
class Run:
    """One model's state across the stages."""

    case: LongModel
    work: Path
    args: Any                                                 # the parsed arguments
    masks: dict[str, str] = field(default_factory=dict)       # table name -> spec
    info: dict = field(default_factory=dict)                  # export record (fingerprint)
    graph: Any = None                                         # stofc ModelGraph
    base: Path | None = None
    packages: dict[str, Path] = field(default_factory=dict)
    layer_masks: dict[str, tuple] = field(default_factory=dict)
    feeds: dict = field(default_factory=dict)
    outs: dict = field(default_factory=dict)                  # kept outputs, see keep()
    torch: Any = None                                         # e2e_torch.TorchSide
    compiles: list = field(default_factory=list)              # running stofc compiles
    failed: str | None = None

    @property
    def name(self) -> str:
        return self.case.name

    @property
    def src(self) -> Path:
        return self.work / f"{self.name}.onnx"

    @property
    def small(self) -> bool:
        """A rehearsal on the CPU: toy models, L <= 512 (the REHEARSAL_* cases)."""
        return bool(self.args.rehearse)

    @property
    def max_seq_len(self) -> int:
        """The packages' L_max: the longest point run (``--cases`` can lower it)."""
        if self.small:
            return REHEARSAL_MAX
        if self.args.cases:
            return min(self.case.max_seq_len, max(s for _, s in parse_cases(self.args.cases)))
        return self.case.max_seq_len

    def cases(self, short: bool) -> list[tuple[int, int]]:
        if self.args.cases or self.small:
            text = self.args.cases or REHEARSAL_CASES
            given = [c for c in parse_cases(text) if c[1] <= self.max_seq_len]
            top = REHEARSAL_SHORT if self.small else SHORT_MAX
            return [c for c in given if (c[1] <= top) == short]
        return list(self.case.short if short else self.case.cases)

    def key_cases(self) -> list[tuple[int, int]]:
        """The target points: (1, 8192), (1, 16384) and the model's longest at batch 1."""
        long = self.cases(False)
        top = max((s for b, s in long if b == 1), default=None)
        return [c for c in long if c in ((1, 8192), (1, 16384)) or c == (1, top)]

    def inputs(self, b: int, s: int):
        from stofc.package.verify import make_inputs

        if (b, s) not in self.feeds:
            self.feeds[(b, s)] = make_inputs(self.graph, b, s, np.random.default_rng(b * 7919 + s))
        return self.feeds[(b, s)]

    def keep(self, b: int, s: int) -> bool:
        """Outputs kept for later comparisons: short (graphs), torch and check points."""
        return (b, s) in set(self.cases(True)) | set(self.torch_cases()) | set(self.check_cases())

    def torch_cases(self) -> list[tuple[int, int]]:
        if self.small:
            return self.key_cases()
        return [c for c in self.case.torch_cases if c in self.cases(False)]

    def check_cases(self) -> list[tuple[int, int]]:
        if self.small:
            return [c for c in self.key_cases() if c[0] == 1]
        return [c for c in self.case.check_cases if c in self.cases(False)]
