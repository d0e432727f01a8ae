"""What a layer's SparseAttention node reads besides Q, K and V.

One rule, used by the planner (which kernel variant: ``has_key_bits``, ``has_bias``),
the tuner (the variant it measures) and the model rewrite (the node's inputs):

* a padding mask the graph applies (additive, ``Where`` or boolean forms) becomes the
  node's ``key_padding_mask`` when it comes from a ``[batch, sequence]`` graph input;
  the model's own constant causal mask is not one (it is ANDed into the structured
  mask instead);
* an additive score bias (T5's relative bias, ALiBi) becomes its ``bias`` input.
"""

from __future__ import annotations

from collections.abc import Iterable

from stofc.errors import PlanError
from stofc.frontend.types import AttentionBlock, ValueInfo

PADDING_FORMS = ("additive", "boolean_where", "boolean")
BIAS_FORMS = ("relative_bias", "bias")


def attention_reads(block: AttentionBlock) -> tuple[bool, bool]:
    """``(key padding mask, score bias)``: whether the node reads each (the module rule)."""
    forms = set(str(block.mask_form).split("+"))
    key_padding = bool(forms & set(PADDING_FORMS)) and block.mask_source is not None
    return key_padding, bool(forms & set(BIAS_FORMS))


def attention_inputs(block: AttentionBlock, graph_inputs: Iterable[ValueInfo]
                     ) -> tuple[str | None, str | None]:
    """``(key_padding_mask, bias)`` value names of a block's node, or a PlanError saying
    why it cannot run (a mask not from a 2-D input, an unknown form)."""
    kpm = bias = None
    inputs = {v.name: v for v in graph_inputs}
    for form in block.mask_form.split("+"):
        if form == "none":
            continue
        if form in PADDING_FORMS:
            if block.mask_source is None:
                continue  # a constant mask (causal, window, buffer): in the model's own mask
            src = inputs.get(block.mask_source or "")
            if src is None or len(src.shape) != 2:
                raise PlanError(
                    f"layer {block.layer}: the attention mask ({form}) does not come from a "
                    f"[batch, sequence] padding input, so SparseAttention cannot take it",
                    hint="export the model with a 2-D attention_mask input")
            kpm = src.name
        elif form in BIAS_FORMS:
            if not block.bias_input:
                raise PlanError(f"layer {block.layer}: an additive score bias without a value",
                                hint="this is a stofc bug; report it")
            bias = block.bias_input
        else:
            raise PlanError(f"layer {block.layer}: attention mask form {form!r} is not supported "
                            "by the package writer", hint="report the model to stofc")
    return kpm, bias
