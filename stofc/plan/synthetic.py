"""Hand-built layer chains (BERT post-LN, GPT-2/ViT pre-LN, T5 RMSNorm, Llama SwiGLU).

These follow the frontend's contract exactly (op kinds, roles, params, ONNX-like
value names) so plans, runners, tests and benchmarks can be exercised without
an ONNX model. :func:`random_weights` draws matching parameters.
"""

from __future__ import annotations

import numpy as np

from stofc.frontend.types import AttentionBlock, ChainOp, Layer, OpKind


def synthetic_layer(*, hidden: int = 768, heads: int = 12, ffn: int = 3072,
                    norm_order: str = "post", norm: str = "layernorm", bias: bool = True,
                    gelu: str = "none", activation: str = "gelu", epsilon: float = 1e-5,
                    index: int = 0, weight_layout: str = "KN", glu: str = "") -> Layer:
    """One transformer layer chain with value names ``L<index>/...``.

    ``glu`` (``silu``, ``gelu_erf``, ``gelu_tanh``, ``relu``): a gated FFN instead of
    ``activation``: ``ffn_in`` projects to ``2 * ffn`` (``[gate | up]``) and a ``gated``
    operator forms ``act(gate) * up``, as the frontend gives it.
    """
    p = f"L{index}/"
    ops: list[ChainOp] = []
    norm_kind = OpKind.LAYERNORM if norm == "layernorm" else OpKind.RMSNORM

    def add(kind: OpKind, role: str, inputs: tuple[str, ...], output: str, **params) -> str:
        ops.append(ChainOp(index=len(ops), kind=kind, role=role, nodes=(f"{p}n{len(ops)}",),
                           inputs=inputs, outputs=(output,),
                           params=tuple(sorted(params.items()))))
        return output

    def add_norm(x: str, name: str) -> str:
        params: dict = {"scale": f"{p}{name}.gamma", "epsilon": epsilon, "form": "op"}
        if norm_kind == OpKind.LAYERNORM:
            params["bias"] = f"{p}{name}.beta" if bias else None
        return add(norm_kind, name, (x, params["scale"]), f"{p}{name}.out", **params)

    def linear(x: str, role: str, k: int, n: int) -> str:
        w = f"{p}{role}.weight"
        y = add(OpKind.GEMM, role, (x, w), f"{p}{role}.mm", in_features=k, out_features=n,
                weight=w, weight_layout=weight_layout, fused_bias=False)
        if bias:
            b = f"{p}{role}.bias"
            y = add(OpKind.BIAS_ADD, role, (y, b), f"{p}{role}.out", bias=b, features=n)
        return y

    x = f"{p}input"
    h_in = add_norm(x, "ln_attn") if norm_order == "pre" else x
    qkv = linear(h_in, "qkv", hidden, 3 * hidden)
    attn = add(OpKind.ATTENTION, "attention", (qkv,), f"{p}attention.out", layer=index)
    o = linear(attn, "out", hidden, hidden)
    h = add(OpKind.RESIDUAL_ADD, "attn_residual", (o, x), f"{p}attn_residual.out")
    ffn_in_x = add_norm(h, "ln_ffn")
    residual2 = ffn_in_x if norm_order == "post" else h
    f = linear(ffn_in_x, "ffn_in", hidden, 2 * ffn if glu else ffn)
    if glu:
        f = add(OpKind.GATED, "gated", (f,), f"{p}gated.out", act=glu, features=ffn)
    elif activation == "gelu":
        f = add(OpKind.GELU, "act", (f,), f"{p}act.out", approximation=gelu,
                form="op" if gelu == "none" else "tanh")
    else:
        f = add(OpKind.ACTIVATION, "act", (f,), f"{p}act.out", op=activation)
    y = linear(f, "ffn_out", ffn, hidden)
    y = add(OpKind.RESIDUAL_ADD, "ffn_residual", (y, residual2), f"{p}ffn_residual.out")
    if norm_order == "post":
        add_norm(y, "ln_out")
    block = AttentionBlock(layer=index, num_heads=heads, head_dim=hidden // heads,
                           hidden_size=hidden, nodes=(f"{p}attention",), q_input=qkv,
                           k_input=qkv, v_input=qkv, output=attn, packed_qkv=True,
                           scale=(hidden // heads) ** -0.5, scale_form="mul_scores",
                           mask_form="none", mask_source=None, bias_input=None,
                           softmax_guarded=False, causal_in_graph=False)
    return Layer(index=index, norm_order=norm_order, attention=block, chain=tuple(ops))


def bert_layer(hidden: int = 768, heads: int = 12, ffn: int = 3072, **kw) -> Layer:
    """BERT/RoBERTa post-LN layer (15 chain ops with a packed QKV projection)."""
    return synthetic_layer(hidden=hidden, heads=heads, ffn=ffn, norm_order="post", **kw)


def gpt2_layer(hidden: int = 768, heads: int = 12, ffn: int = 3072, **kw) -> Layer:
    """GPT-2/ViT pre-LN layer (tanh GELU for GPT-2 by default)."""
    kw.setdefault("gelu", "tanh")
    return synthetic_layer(hidden=hidden, heads=heads, ffn=ffn, norm_order="pre", **kw)


def t5_layer(hidden: int = 512, heads: int = 8, ffn: int = 2048, **kw) -> Layer:
    """T5 layer: pre-RMSNorm, no biases, ReLU FFN."""
    return synthetic_layer(hidden=hidden, heads=heads, ffn=ffn, norm_order="pre",
                           norm="rmsnorm", bias=False, activation="Relu", epsilon=1e-6, **kw)


def llama_layer(hidden: int = 512, heads: int = 8, ffn: int = 1408, **kw) -> Layer:
    """Llama/Mistral layer: pre-RMSNorm, no biases, SwiGLU FFN (gate and up packed)."""
    kw.setdefault("glu", "silu")
    kw.setdefault("bias", False)
    return synthetic_layer(hidden=hidden, heads=heads, ffn=ffn, norm_order="pre",
                           norm="rmsnorm", epsilon=1e-6, **kw)


def random_weights(layer: Layer, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Float32 parameters for every initializer the chain names (ONNX layouts)."""
    out: dict[str, np.ndarray] = {}
    for op in layer.chain:
        if op.kind == OpKind.GEMM:
            k, n = op.param("in_features"), op.param("out_features")
            shape = (k, n) if op.param("weight_layout", "KN") == "KN" else (n, k)
            out[op.param("weight")] = (rng.standard_normal(shape) / np.sqrt(k)).astype(np.float32)
        elif op.kind == OpKind.BIAS_ADD:
            out[op.param("bias")] = (0.1 * rng.standard_normal(op.param("features"))
                                     ).astype(np.float32)
    for op in layer.chain:
        if op.kind in (OpKind.LAYERNORM, OpKind.RMSNORM):
            width = layer.attention.hidden_size
            out[op.param("scale")] = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)
            if op.param("bias") is not None:
                out[op.param("bias")] = (0.1 * rng.standard_normal(width)).astype(np.float32)
    return out
