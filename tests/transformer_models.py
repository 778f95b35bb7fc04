"""Tiny Hugging Face transformers built from configs with random weights (no download): the
models the standard-point tests and docs run on. 2 layers, hidden 32, 4 heads, vocab 50, 16
positions; Llama with 2 key-value heads; GPT-NeoX parallel or not; BERT with a padded mask. Each
builder takes the attention implementation and config fields to override."""

from __future__ import annotations

import torch
import transformers

transformers.logging.set_verbosity_error()

VOCAB, HIDDEN, HEADS, LAYERS, POSITIONS = 50, 32, 4, 2, 16
ATTENTION = ("eager", "sdpa")


def _built(model_cls, config) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_cls(config).eval()


def gpt2(attn: str = "eager", **config: object) -> torch.nn.Module:
    """GPT-2; `config` overrides or adds config fields (e.g. ``initializer_range``)."""
    return _built(transformers.GPT2LMHeadModel, transformers.GPT2Config(**{
        "vocab_size": VOCAB, "n_embd": HIDDEN, "n_head": HEADS, "n_layer": LAYERS, "n_positions": POSITIONS,
        "attn_implementation": attn, **config}))


def neox(attn: str = "eager", parallel: bool = True, **config: object) -> torch.nn.Module:
    return _built(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(**{
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
        "intermediate_size": 4 * HIDDEN, "max_position_embeddings": POSITIONS, "use_parallel_residual": parallel,
        "attn_implementation": attn, **config}))


def llama(attn: str = "eager", **config: object) -> torch.nn.Module:
    """Llama with grouped-query attention (2 key-value heads); untied unless ``tie_word_embeddings=True``."""
    return _built(transformers.LlamaForCausalLM, transformers.LlamaConfig(**{
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": 2,
        "num_hidden_layers": LAYERS, "intermediate_size": 64, "max_position_embeddings": POSITIONS,
        "attn_implementation": attn, **config}))


def bert(attn: str = "eager", **config: object) -> torch.nn.Module:
    return _built(transformers.BertForMaskedLM, transformers.BertConfig(**{
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
        "intermediate_size": 64, "max_position_embeddings": POSITIONS, "attn_implementation": attn, **config}))


BUILDERS = {"gpt2": gpt2, "neox": neox, "neox_seq": lambda attn="eager": neox(attn, parallel=False),
            "llama": llama, "bert": bert}
"""Every family the standard points are tested on, by name."""


def inputs(name: str, batch: int = 2, length: int = 6) -> dict[str, torch.Tensor]:
    """Token ids (and for BERT an attention mask with padding in the second row)."""
    ids = torch.arange(batch * length).reshape(batch, length) % VOCAB
    if name != "bert":
        return {"input_ids": ids}
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}
