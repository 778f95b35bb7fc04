"""Where the standard points live in each family of Hugging Face transformers.

An :class:`Architecture` names, for one family, the modules that hold each standard point:
paths relative to the *base model* (``model.base_model``: ``transformer`` of GPT-2, ``model``
of Llama, ``gpt_neox`` of Pythia, ``bert`` of BERT), per-block paths relative to a block, and
the unembedding relative to the model itself. :func:`architecture` finds a model's entry by its
``config.model_type``; :func:`register` adds a family (or replaces one) without editing
funhooks.

Cost: a dict lookup per call; nothing runs per forward.
"""

from __future__ import annotations

import threading

import attrs
from torch import nn

from funhooks import _frozen
from funhooks.errors import SelectorError

__all__ = ["Architecture", "architecture", "register"]


@_frozen.frozen
@attrs.frozen
class Architecture:
    """Where one family of transformers keeps its standard points.

    Paths are dot-separated module paths. ``blocks``, ``embed`` and ``final_norm`` are relative
    to the base model; ``attn``, ``mlp``, the norms and the projections are relative to one
    block; ``unembed`` is relative to the model given (absent from a base model, which has no
    head).

    Example:
        >>> import funhooks as fh
        >>> fh.transformer.architecture("gpt2").blocks
        'h'
    """

    name: str
    """The family, e.g. ``"gpt2"``; also the ``config.model_type`` it is found by."""
    blocks: str
    """The ``ModuleList`` of blocks (layers)."""
    embed: str
    """The token embedding."""
    attn: str
    """The attention module of a block (its output's element 0 is ``attn_out``, unless
    `attn_out` names another module)."""
    mlp: str
    """The MLP of a block (its output is ``mlp_out``, unless `mlp_out` names another module)."""
    attn_norm: str | None
    """The norm before attention (``ln_1``); None for post-norm blocks (BERT)."""
    mlp_norm: str | None
    """The norm before the MLP; its input is ``resid_mid`` (None for parallel blocks)."""
    qkv: tuple[str, ...]
    """The projections making q, k, v: one fused module (GPT-2's ``attn.c_attn``, NeoX's
    ``attention.query_key_value``) or three (``q_proj``, ``k_proj``, ``v_proj``). A fused
    output is read as `fused` says."""
    attn_proj: str
    """The attention's output projection: its input is ``z`` (heads side by side)."""
    mlp_proj: str
    """The MLP's output projection: its input is ``mlp_post`` (after the activation)."""
    final_norm: str | None
    """The norm after the last block (None where there is none, e.g. post-norm BERT)."""
    unembed: str | None
    """The unembedding (``lm_head``), relative to the model with a language-modelling head."""
    parallel: bool = False
    """Attention and MLP both read the block's input (GPT-J, Pythia): no ``resid_mid``. A model whose
    ``config.use_parallel_residual`` is False (GPT-NeoX built so) is read as sequential."""
    post_norm: bool = False
    """Norms after each residual add (BERT): ``resid_mid`` is the attention block's output."""
    extra: tuple[tuple[str, str], ...] = ()
    """Further ``(name, path)`` pairs a family needs (e.g. BERT's prediction transform)."""
    resid_in: str | None = None
    """The module (relative to the base model) whose output is layer 0's ``resid_pre``: the
    embeddings' dropout (GPT-2's ``drop``), or None for `embed` itself (Llama)."""
    mlp_pre: str | None = None
    """The MLP's first projection, relative to a block: its output is ``mlp_pre`` (the gate
    projection of a gated MLP, as in TransformerLens)."""
    mlp_in: str | None = None
    """The module of a block whose first input is ``mlp_in``; None for `mlp`."""
    attn_out: str | None = None
    """The module of a block whose output (element 0) is ``attn_out``; None for `attn`."""
    mlp_out: str | None = None
    """The module of a block whose output is ``mlp_out``; None for `mlp`."""
    pos_embed: str | None = None
    """The learned position embedding (relative to the base model) whose output is added to
    the token embedding's (GPT-2's ``wpe``); None for a family without one (rotary)."""
    fused: str = "thirds"
    """How one fused `qkv` output holds q, k, v: ``"thirds"`` (``[q | k | v]`` along the last
    dimension, GPT-2) or ``"heads"`` (per head ``[q_h | k_h | v_h]``, GPT-NeoX)."""


_BUILTIN = (
    Architecture("gpt2", blocks="h", embed="wte", attn="attn", mlp="mlp", attn_norm="ln_1", mlp_norm="ln_2",
                 qkv=("attn.c_attn",), attn_proj="attn.c_proj", mlp_proj="mlp.c_proj", final_norm="ln_f",
                 unembed="lm_head", resid_in="drop", mlp_pre="mlp.c_fc", pos_embed="wpe"),
    Architecture("gpt_neox", blocks="layers", embed="embed_in", attn="attention", mlp="mlp",
                 attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                 qkv=("attention.query_key_value",), attn_proj="attention.dense", mlp_proj="mlp.dense_4h_to_h",
                 final_norm="final_layer_norm", unembed="lm_head", parallel=True, resid_in="emb_dropout",
                 mlp_pre="mlp.dense_h_to_4h", fused="heads"),
    Architecture("llama", blocks="layers", embed="embed_tokens", attn="self_attn", mlp="mlp",
                 attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                 qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), attn_proj="self_attn.o_proj",
                 mlp_proj="mlp.down_proj", final_norm="norm", unembed="lm_head", mlp_pre="mlp.gate_proj"),
    Architecture("bert", blocks="encoder.layer", embed="embeddings.word_embeddings", attn="attention",
                 mlp="output", attn_norm=None, mlp_norm=None,
                 qkv=("attention.self.query", "attention.self.key", "attention.self.value"),
                 attn_proj="attention.output.dense", mlp_proj="output.dense", final_norm=None,
                 unembed="cls.predictions.decoder", post_norm=True,
                 extra=(("unembed_transform", "cls.predictions.transform"),), resid_in="embeddings",
                 mlp_pre="intermediate.dense", mlp_in="intermediate", attn_out="attention.output.dense",
                 mlp_out="output.dense", pos_embed="embeddings.position_embeddings"),
)
_ALIASES = {"mistral": "llama", "qwen2": "llama"}
"""Families whose modules are Llama's (RoPE, grouped-query attention, RMSNorm)."""
_BEFORE_5 = {"gpt_neox": ("embed_out", "lm_head")}
"""A built-in family's unembedding as transformers 4.x names it, and as 5 does: a model with the
old name and not the new one is read with the old (GPT-NeoX's head was ``embed_out`` before 5)."""
_TABLE: dict[str, Architecture] = {a.name: a for a in _BUILTIN}
_LOCK = threading.Lock()


def register(arch: Architecture, *, model_types: tuple[str, ...] = ()) -> Architecture:
    """Add (or replace) a family: found afterwards for models whose ``config.model_type`` is
    ``arch.name`` or one of `model_types`. Returns `arch`.

    Example:
        >>> import attrs, funhooks as fh
        >>> mine = attrs.evolve(fh.transformer.architecture("llama"), name="my_llama")
        >>> fh.transformer.register(mine).name
        'my_llama'
    """
    if not isinstance(arch, Architecture):
        raise TypeError(f"register: takes an `fh.transformer.Architecture`, got {arch!r}. Build one with its fields.")
    with _LOCK:
        for name in (arch.name, *model_types):
            _TABLE[name] = arch
    return arch


def architecture(model: nn.Module | str) -> Architecture:
    """The :class:`Architecture` of a Hugging Face model (by ``config.model_type``) or of a
    family name; a :class:`~funhooks.SelectorError` listing the known ones otherwise."""
    kind = model if isinstance(model, str) else getattr(getattr(model, "config", None), "model_type", None)
    found = _TABLE.get(_ALIASES.get(kind, kind)) if isinstance(kind, str) else None
    if found is None:
        what = f"model type {kind!r}" if kind is not None else f"a {type(model).__name__} without a `config.model_type`"
        raise SelectorError(
            f"fh.transformer: the standard points are known for {sorted({*_TABLE, *_ALIASES})}, got {what}. "
            "Declare where your family keeps them with `fh.transformer.register(fh.transformer.Architecture(...))` "
            "(see docs/transformers.md)."
        )
    renamed = _BEFORE_5.get(found.name)
    if renamed is not None and found.unembed == renamed[1] and not isinstance(model, str) \
            and not hasattr(model, renamed[1]) and hasattr(model, renamed[0]):
        return attrs.evolve(found, unembed=renamed[0])
    return found
