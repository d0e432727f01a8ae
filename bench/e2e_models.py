"""The two models of the issue-7 end-to-end table and their torch.compile mirrors.

- ``export_bert`` / ``export_gpt2``: Hugging Face BERT-base / GPT-2-small with random
  weights from the config (2048 positions, eager attention so ONNX Runtime's optimizer
  can fuse it), exported with ``torch.onnx.export`` (TorchScript, opset 17), inputs
  ``input_ids`` + ``attention_mask``, output ``last_hidden_state``; ``b``/``s`` dynamic.
- ``BertMirror``: the anchors' 12-layer post-LN encoder (``shared/bench/anchors_mha.py``'s
  ``Encoder``) with FlexAttention inside; ``Gpt2Mirror``: the same sizes as a pre-LN
  GPT-2 stack (``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` with tanh-GELU, final LayerNorm).
  Neither has the embeddings (a gather and an add: noise at these sizes), both take the
  hidden states and a FlexAttention block mask.
- ``package_dense_mask``: the bool ``[L_max, L_max]`` mask a compiled package applies,
  read from its own mask files, so GPT-2's causal intersection is included and the
  mirror computes the same masking as the package.
- the run machinery of ``bench/e2e.py`` and ``bench/e2e_long.py``: :class:`Recorder`
  (JSONL rows as they come, tables rewritten, a deadline guard), ``one_line``,
  ``rel_error``, ``parse_cases``, ``environment``.
- ``time_flex``: median ms of ``torch.compile(mirror)`` with that mask (default mode or
  ``reduce-overhead`` = CUDA graphs), torch._dynamo reset per point, ``dynamic=False``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

T0 = time.time()  # the deadline of a run counts from the import (the process start)
PROVIDERS = ["CUDAExecutionProvider", "CPUExecutionProvider"]

HIDDEN, HEADS, FFN, LAYERS, POSITIONS = 768, 12, 3072, 12, 2048


def export_text_model(model, path: Path, vocab: int, *, seq: int = 128, pad: int = 0) -> None:
    """``torch.onnx.export`` (TorchScript, opset 17) of a text model's ``last_hidden_state``.

    Inputs ``input_ids`` + ``attention_mask`` (int64), axes ``b``/``s`` dynamic. The example
    is batch 2 of length ``seq``; with ``pad`` > 0 its second row ends in ``pad`` padding
    tokens, so no all-ones shortcut of the model's mask code can be traced into the graph.
    """
    import torch

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, vocab, (2, seq))
    am = torch.ones(2, seq, dtype=torch.long)
    if pad:
        am[1, seq - pad:] = 0
    dyn = {"b": 0, "s": 1}
    axes = {n: {i: a for a, i in dyn.items()}
            for n in ("input_ids", "attention_mask", "last_hidden_state")}
    with torch.no_grad():
        torch.onnx.export(Wrap(model).eval(), (ids, am), str(path),
                          input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)


def export_bert(path: Path) -> None:
    """HF BERT-base, random weights, eager attention, 2048 positions -> ONNX at ``path``."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(max_position_embeddings=POSITIONS)
    cfg._attn_implementation = "eager"
    export_text_model(tf.BertModel(cfg, add_pooling_layer=False).eval(), path, 30000)


def export_gpt2(path: Path) -> None:
    """HF GPT-2-small, random weights, eager attention, n_positions 2048 -> ONNX at ``path``."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_positions=POSITIONS, use_cache=False)
    cfg._attn_implementation = "eager"
    export_text_model(tf.GPT2Model(cfg).eval(), path, cfg.vocab_size)


def _mirror_classes():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    lin, norm = torch.nn.Linear, torch.nn.LayerNorm

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.ModuleList(lin(HIDDEN, 3 * HIDDEN) for _ in range(LAYERS))
            self.o = torch.nn.ModuleList(lin(HIDDEN, HIDDEN) for _ in range(LAYERS))
            self.f1 = torch.nn.ModuleList(lin(HIDDEN, FFN) for _ in range(LAYERS))
            self.f2 = torch.nn.ModuleList(lin(FFN, HIDDEN) for _ in range(LAYERS))
            self.ln1 = torch.nn.ModuleList(norm(HIDDEN) for _ in range(LAYERS))
            self.ln2 = torch.nn.ModuleList(norm(HIDDEN) for _ in range(LAYERS))

        def attend(self, i, x, block_mask):
            b, s, h = x.shape
            q, k, v = self.qkv[i](x).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
            a = flex_attention(q, k, v, block_mask=block_mask)
            return self.o[i](a.transpose(1, 2).reshape(b, s, h))

    class BertMirror(Stack):
        """Post-LN (BERT): x = LN(x + attn(x)); x = LN(x + FFN(x)), erf-GELU."""

        def forward(self, x, block_mask):
            for i in range(LAYERS):
                x = self.ln1[i](x + self.attend(i, x, block_mask))
                x = self.ln2[i](x + self.f2[i](F.gelu(self.f1[i](x))))
            return x

    class Gpt2Mirror(Stack):
        """Pre-LN (GPT-2): x += attn(LN(x)); x += FFN(LN(x)), tanh-GELU; final LN."""

        def __init__(self):
            super().__init__()
            self.ln_f = norm(HIDDEN)

        def forward(self, x, block_mask):
            for i in range(LAYERS):
                x = x + self.attend(i, self.ln1[i](x), block_mask)
                x = x + self.f2[i](F.gelu(self.f1[i](self.ln2[i](x)), approximate="tanh"))
            return self.ln_f(x)

    return {"bert": BertMirror, "gpt2": Gpt2Mirror}


@dataclass(frozen=True)
class ModelCase:
    """One model of the table: how to export it and its torch.compile mirror."""

    name: str          # "bert" | "gpt2"
    label: str         # as printed in the table
    export: object     # callable(Path) -> None
    ort_model_type: str  # what optimized_baseline should pick (checked, not forced)


MODELS = {
    "bert": ModelCase("bert", "BERT-base", export_bert, "bert"),
    "gpt2": ModelCase("gpt2", "GPT-2-small", export_gpt2, "gpt2"),
}


def mirror(model: str):
    """A fresh fp16 CUDA mirror of ``model`` (random weights), eval mode."""
    return _mirror_classes()[model]().cuda().half().eval()


def package_dense_mask(package: Path) -> np.ndarray:
    """The bool ``[L_max, L_max]`` mask of ``package`` (its own mask files, head 0).

    Raises ValueError if layers or heads use different masks: one block mask per
    mirror would then not be the package's function.
    """
    from stofc.masks import load, to_dense

    doc = json.loads((Path(package) / "plan.json").read_text())
    entries = doc["mask"]["formats"]
    if len(entries) != 1:
        raise ValueError(f"{package}: {len(entries)} distinct layer masks; the mirror takes one")
    fmt = load(Path(package) / entries[0]["npz"])
    dense = to_dense(fmt, 0)
    for h in range(1, fmt.num_heads):
        if not np.array_equal(dense, to_dense(fmt, h)):
            raise ValueError(f"{package}: head {h} has its own mask; the mirror takes one")
    return dense


def fused_ops(path: Path) -> dict[str, int]:
    """Op-type counts of ORT's fused ops in an optimized model (what the optimizer did)."""
    import onnx

    names = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "SkipLayerNormalization",
             "LayerNormalization", "BiasGelu", "FastGelu", "Gelu", "EmbedLayerNormalization",
             "Softmax", "MatMul", "Gemm"}
    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type in names:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def time_flex(module, dense: np.ndarray, batch: int, seq: int, *,
              mode: str | None) -> tuple[float, float, int]:
    """(median ms, compile s, CUDA-graph skips) of ``torch.compile(module, mode=mode)``.

    The mask is ``dense[:seq, :seq]``. ``mode="reduce-overhead"`` runs under CUDA graphs
    (inputs copied into static buffers each call, as a user gets it); a few calls before
    timing so the graph is recorded. The third value is how many times inductor said it
    skipped CUDA graphs (its ``cudagraph_skips`` counter): non-zero means the
    reduce-overhead figure ran without them.
    """
    import torch
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask
    from triton.testing import do_bench

    torch._dynamo.reset()
    allowed = torch.from_numpy(np.ascontiguousarray(dense[:seq, :seq])).cuda()

    def mask_mod(b, h, q, k):
        return allowed[q, k]

    comp = torch.compile(module, dynamic=False, mode=mode)
    bm = create_block_mask(mask_mod, None, None, seq, seq, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + seq)
    x = torch.randn(batch, seq, HIDDEN, device="cuda", dtype=torch.float16, generator=gen)
    skips = counters["inductor"]["cudagraph_skips"]
    with torch.no_grad():
        start = time.time()
        for _ in range(3 if mode == "reduce-overhead" else 1):
            y = comp(x, bm)
        torch.cuda.synchronize()
        compile_s = time.time() - start
        if not torch.isfinite(y).all():
            raise RuntimeError("the mirror's output is not finite")
        ms = do_bench(lambda: comp(x, bm), warmup=10, rep=50, return_mode="median")
    skips = counters["inductor"]["cudagraph_skips"] - skips
    torch._dynamo.reset()  # drops the compiled graphs (and CUDA graphs) of this point
    return ms, compile_s, skips


# ----------------------------------------------------------------------------- run machinery

def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"1:128 8:512"`` -> ``[(1, 128), (8, 512)]``."""
    return [(int(b), int(s)) for b, s in (c.split(":") for c in text.split())]


def one_line(err: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line (ORT's multi-line messages joined), at most ``limit``."""
    text = " | ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return f"{type(err).__name__}: {text}"[:limit]


def rel_error(out: np.ndarray, ref: np.ndarray, real: np.ndarray) -> float:
    """max |out - ref| / max |ref| over real (unpadded) token positions; inf if not finite."""
    out, ref = np.asarray(out, np.float64)[real], np.asarray(ref, np.float64)[real]
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


class Recorder:
    """Appends rows to ``out/jsonl`` as they come and rewrites the tables after each
    timing-like row (``tables(rows, out)``), so a run cut short still leaves its tables.

    ``costs``: seconds a step may take; :meth:`fits` skips (and records) a step when less
    than that is left before ``deadline`` seconds from :data:`T0`.
    """

    TABLE_KINDS = ("time", "refused", "skip", "verify", "check", "profile")

    def __init__(self, out: Path, deadline: float, costs: Mapping[str, float], *,
                 jsonl: str = "e2e.jsonl",
                 tables: Callable[[list[dict], Path], str] | None = None) -> None:
        self.out, self.deadline, self.costs = out, deadline, costs
        self.rows: list[dict] = []
        self.jsonl, self.tables = jsonl, tables
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - (time.time() - T0)

    def fits(self, step: str, **where) -> bool:
        """True if ``step`` fits before the deadline; else record the skip."""
        if self.left() >= self.costs[step]:
            return True
        self.emit(kind="skip", step=step, why=f"deadline: {self.left():.0f} s left, "
                  f"step needs ~{self.costs[step]} s", **where)
        return False

    def emit(self, **row) -> dict:
        row["t"] = round(time.time() - T0, 1)
        self.rows.append(row)
        print(json.dumps(row)[:2000], flush=True)
        with (self.out / self.jsonl).open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tables is not None and row["kind"] in self.TABLE_KINDS:
            self.tables(self.rows, self.out)
        return row


def environment() -> dict:
    """The ``env`` row: onnxruntime (file, providers), torch, transformers, GPU name."""
    import onnxruntime as ort

    env = {"kind": "env", "onnxruntime": ort.__version__, "ort_file": ort.__file__,
           "providers": ort.get_available_providers()}
    try:
        import torch
        import transformers

        env.update(torch=torch.__version__, transformers=transformers.__version__,
                   gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    except Exception as err:  # the table still says what it can
        env["env_err"] = one_line(err)
    return env
