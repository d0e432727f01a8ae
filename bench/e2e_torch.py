"""The torch side of the long-context benchmark: the same Hugging Face model, compiled.

The model (:func:`e2e_long_models.build`: same config, same seed, so the same weights as
the ONNX export, checked by fingerprint) runs with its attention replaced through
transformers' ``AttentionInterface`` (name ``stofc_bench``; the model then builds no mask
of its own, and the padding mask is ignored: the torch side runs unpadded inputs):

- ``flex``: ``flex_attention`` with each layer's mask taken from the package's own mask
  files (:func:`e2e_long_models.layer_masks`), as a ``BlockMask`` of 128x128 blocks (full
  blocks skip the mask function; partial ones read the bool table ``dense[q, k]``), GQA
  through ``enable_gqa``;
- ``sdpa``: ``scaled_dot_product_attention`` where every layer's mask is dense or causal;
- ``fa4``: FlashAttention-4 (``/tmp/fa4site``, ``../shared/scripts/fa4-wheel-parts.sh``)
  where every layer's mask is dense, causal or a (causal) band, as a ``torch.library``
  custom op so ``torch.compile`` keeps one graph.

:class:`TorchSide` compiles the model once per (attention kind, shape, mode) with
``dynamic=False``; switching to another mask of the same shape copies the new block
masks and tables *into* the tensors the compiled graph reads (they are graph inputs, not
constants: checked without a GPU by the self-test), so the masks of one shape share one
compile. Timing: CUDA events around each call, median of an adaptive number of runs
(:func:`e2e_long_models` does not time). Peak memory: ``torch.cuda.max_memory_allocated``
over the timed runs (weights, mask tables and activations).
"""

from __future__ import annotations

import os
import site
import statistics
import time
from typing import Any

import numpy as np

ATTN_NAME = "stofc_bench"
_STATE: dict = {"impl": "flex", "blocks": {}, "forms": {}}  # read by _attention at trace time
FA4: dict[str, Any] = {"error": None, "func": None}


def load_fa4() -> str | None:
    """Import FA4 from /tmp/fa4site if present; None when usable, else why not."""
    if FA4["func"] is not None or FA4["error"] is not None:
        return FA4["error"]
    if not os.path.isdir("/tmp/fa4site"):
        FA4["error"] = "FA4 not installed (/tmp/fa4site absent: ../shared/scripts/fa4-wheel-parts.sh)"
        return FA4["error"]
    site.addsitedir("/tmp/fa4site")
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as err:  # optional anchor: say why it is missing
        FA4["error"] = f"FA4 import failed: {type(err).__name__}: {str(err)[:200]}"
        return FA4["error"]
    FA4["func"] = flash_attn_func
    return None


def _register() -> None:
    """Register the attention function (and the FA4 custom op) once."""
    import torch
    from transformers import AttentionInterface

    if _STATE.get("registered"):
        return
    AttentionInterface.register(ATTN_NAME, _attention)

    @torch.library.custom_op("stofc_bench::fa4", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, float scale, bool causal, int left, int right) -> Tensor"))
    def fa4(q, k, v, scale, causal, left, right):
        window = (None, None) if left < 0 else (left, right)
        out = FA4["func"](q, k, v, softmax_scale=scale, causal=causal, window_size=window)
        return (out[0] if isinstance(out, tuple) else out).contiguous()

    @fa4.register_fake
    def _(q, k, v, scale, causal, left, right):
        return torch.empty_like(q)

    _STATE["registered"] = True


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               **kwargs):
    """transformers' attention signature: q [B, H, L, D], k/v [B, Hkv, L, D] -> [B, L, H, D]."""
    import torch
    import torch.nn.functional as F

    layer, impl = module.layer_idx, _STATE["impl"]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    gqa = query.shape[1] != key.shape[1]
    if impl == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        fn = flex_attention if torch.compiler.is_compiling() else _STATE["flex_compiled"]
        if query.device.type == "cpu":  # inductor's CPU flex template wants plain layouts
            query, key, value = (t.contiguous() for t in (query, key, value))
        out = fn(query, key, value, block_mask=_STATE["blocks"][layer], scale=scale,
                 enable_gqa=gqa)
    elif impl == "sdpa":
        causal = _STATE["forms"][layer][0]
        out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale,
                                             enable_gqa=gqa)
    else:  # fa4: [B, L, H, D] in and out
        causal, left, right = _STATE["forms"][layer]
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        out = torch.ops.stofc_bench.fa4(q, k, v, scale, causal, -1 if left is None else left,
                                        -1 if right is None else right)
        return out, None
    return out.transpose(1, 2).contiguous(), None


def block_mask(dense, block: int = 128):
    """A FlexAttention ``BlockMask`` of the bool ``[L, L]`` CUDA tensor ``dense``.

    Blocks entirely allowed are "full" (no mask function); blocks with some allowed cells
    are partial and read ``dense[q, k]`` (the table the returned mask_mod closes over).
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import BlockMask

    n = dense.shape[0]
    nb = -(-n // block)
    padded = F.pad(dense, (0, nb * block - n, 0, nb * block - n)) if nb * block != n else dense
    tiles = padded.view(nb, block, nb, block)
    full = tiles.all(dim=3).all(dim=1)
    partial = tiles.any(dim=3).any(dim=1) & ~full

    def blocks(m):  # counts [1, 1, nb] and the allowed block columns first [1, 1, nb, nb]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return m.sum(-1, dtype=torch.int32)[None, None], order[None, None].contiguous()

    table = dense

    def mask_mod(b, h, q, k):
        return table[q, k]

    (kv_n, kv_i), (full_n, full_i) = blocks(partial), blocks(full)
    return BlockMask.from_kv_blocks(kv_n, kv_i, full_n, full_i, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(n, n))


_BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def copy_block_mask(dst, src) -> bool:
    """Copy ``src``'s block tensors and table into ``dst``'s, in place; False (nothing
    copied) when their structure differs (then ``dst`` must be replaced and recompiled)."""
    pairs = [(getattr(dst, f, None), getattr(src, f, None)) for f in _BLOCK_FIELDS]
    pairs.append((_table(dst), _table(src)))
    if dst.BLOCK_SIZE != src.BLOCK_SIZE:
        return False
    for a, b in pairs:
        if (a is None) != (b is None) or (a is not None and b is not None and (
                a.shape != b.shape or a.dtype != b.dtype)):
            return False
    for a, b in pairs:
        if a is not None:
            a.copy_(b)
    return True


def _table(bm):
    cells = bm.mask_mod.__closure__ or ()
    return next(c.cell_contents for c in cells if hasattr(c.cell_contents, "shape"))


class NotExpressible(ValueError):
    """The attention kind cannot express the package's masks exactly (no row, a reason)."""


def keep_rope_frequencies(model, device: str, dtype):
    """``model.to(device, dtype)`` with RoPE's inverse-frequency buffers left in float32.

    ``Module.to`` rounds every floating buffer. transformers computes the rotation angles
    in float32 from ``*inv_freq``, but from a float16 copy of it: at position 8191 the
    angles then move by radians (the fp16 Llama anchor was 1.5-1.8e-1 away from the same
    model in fp32 at (1, 8192), while the stofc package, whose tables come from the fp32
    export, was 1.9e-3 away). The anchor must compute the model it is timed against.
    """
    import torch

    kept = {name: buf.detach().to(torch.float32).clone()
            for name, buf in model.named_buffers() if name.endswith("inv_freq")}
    model = model.to(device=device, dtype=dtype)
    for name, buf in kept.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buf.to(device)
    return model

class TorchSide:
    """One model on the GPU in one dtype (fp32 for the reference), attention swappable.

    Use: :meth:`use` (attention kind and masks), then :meth:`compile` for a shape and
    mode, then :meth:`forward`. ``compiled=False`` runs the model eagerly with a compiled
    ``flex_attention`` (the fp32 reference: no ``L x L`` scores are materialised).
    """

    def __init__(self, name: str, dtype: str, *, small: bool = False,
                 fingerprint: str | None = None, device: str = "cuda") -> None:
        import torch
        from e2e_long_models import build
        from e2e_long_models import fingerprint as digest

        _register()
        model = build(name, small)
        self.fingerprint = digest(model)
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise RuntimeError(f"rebuilt {name} has weights {self.fingerprint}, the export "
                               f"{fingerprint}: the torch side would be another model")
        model.config._attn_implementation = ATTN_NAME
        self.torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16,
                            "fp32": torch.float32}[dtype]
        self.device = device
        self.model = keep_rope_frequencies(model, device, self.torch_dtype)
        self.compiled = None
        self.key: tuple | None = None     # (impl, batch, seq, mode) of self.compiled
        self.impl = "flex"
        self.groups: list = []            # one BlockMask per distinct layer mask
        self.of_layer: dict[int, int] = {}
        self.blocks: dict[int, object] = {}   # layer -> its group's BlockMask
        self.forms: dict[int, tuple] = {}

    def use(self, impl: str, of_layer: dict[int, int], dense: list[np.ndarray],
            specs: list[dict]) -> bool:
        """Attend with ``impl`` (flex | sdpa | fa4) and these per-layer masks.

        Returns True when a graph compiled before still computes the new masks (same kind
        and structure; flex: the new block masks were copied into its tensors).
        Raises :class:`NotExpressible` when sdpa/fa4 cannot express the masks.
        """
        import torch
        from e2e_long_models import window_form

        if impl in ("sdpa", "fa4"):
            found = [window_form(s, d) for s, d in zip(specs, dense, strict=True)]
            forms = [f for f in found if f is not None]
            if len(forms) != len(found) or (impl == "sdpa" and any(
                    f[1] is not None for f in forms)):
                raise NotExpressible(f"{impl} cannot express these masks exactly (" + "; ".join(
                    str(s.get("mask", s)) for s in specs)[:300] + ")")
            new_forms = {layer: forms[g] for layer, g in of_layer.items()}
            same = self.impl == impl and self.forms == new_forms
            if not same:  # the same objects when unchanged: dynamo guards on them
                self.impl, self.forms = impl, new_forms
            self._publish()
            return same
        # a private copy: the swap writes into these tables (on the CPU, .to() would alias
        # the caller's array)
        new = [block_mask(torch.tensor(np.ascontiguousarray(d), device=self.device))
               for d in dense]
        same = (self.impl == "flex" and len(new) == len(self.groups) and self.of_layer == of_layer
                and all(copy_block_mask(o, n) for o, n in zip(self.groups, new, strict=True)))
        if not same:  # else the graph's own tensors now hold the new masks
            self.groups, self.of_layer, self.impl = new, dict(of_layer), "flex"
            self.blocks = {layer: self.groups[g] for layer, g in of_layer.items()}
        self._publish()
        return same

    def _publish(self) -> None:
        """Point the attention function at this side's masks (the same objects as long as
        they are unchanged; another side's in between makes dynamo recompile, correctly)."""
        _STATE.update(impl=self.impl, blocks=self.blocks, forms=self.forms)

    def compile(self, batch: int, seq: int, mode: str | None, still_valid: bool) -> bool:
        """``torch.compile`` the model for this shape and mode unless the current compile
        is for the same key and ``still_valid``; True if a new compile was set up (it
        happens on the next call)."""
        import torch

        key = (self.impl, batch, seq, mode)
        if still_valid and self.key == key and self.compiled is not None:
            return False
        torch._dynamo.reset()
        self.compiled = torch.compile(self.model, dynamic=False, mode=mode)
        self.key = key
        return True

    def forward(self, ids, compiled: bool = True):
        """``last_hidden_state`` for the int64 ``ids`` tensor (no grad)."""
        import torch

        if not compiled and "flex_compiled" not in _STATE:
            from torch.nn.attention.flex_attention import flex_attention

            _STATE["flex_compiled"] = torch.compile(flex_attention, dynamic=False)
        fn = self.compiled if compiled and self.compiled is not None else self.model
        with torch.no_grad():
            return fn(input_ids=ids).last_hidden_state


def time_cuda(fn, *, warmup: int = 10, repeat: int = 50, budget_s: float = 3.0,
              cuda: bool = True) -> dict:
    """Median/p10/p90 ms of ``fn`` with CUDA events (``cuda=False``: ``perf_counter``, for
    the CPU rehearsal); the number of runs adapts to the time of one (:func:`plan_runs`)."""
    import torch

    def sync():
        if cuda:
            torch.cuda.synchronize()

    start = time.time()
    fn()
    sync()
    warm, reps = plan_runs(time.time() - start, warmup, repeat, budget_s)
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=10)
    return {"ms": statistics.median(times), "p10": q[0], "p90": q[-1], "runs": reps}


def plan_runs(one_s: float, warmup: int, repeat: int, budget_s: float) -> tuple[int, int]:
    """(warmup, repeat) for a call of ``one_s`` seconds: ``repeat`` runs when they fit in
    ``budget_s``, else as many as fit but at least 5; warmup a fifth of that, at least 2."""
    fit = int(budget_s / max(one_s, 1e-6))
    reps = max(5, min(repeat, fit))
    return max(2, min(warmup, reps // 5 if fit < repeat else warmup)), reps
