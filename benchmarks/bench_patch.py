"""Interventions: an activation-patching sweep as one vmapped call, and op-level recording.

**Sweep.** Patch the residual stream before each layer (``resid_pre``: the outputs of
``transformer.drop`` and ``transformer.h.*``) of a small HF GPT-2 (random weights from a
config) at each position, from a clean run into a corrupted one, and read the logit
difference of two tokens: ``LAYERS x POSITIONS = 32`` patches. Cases, each returning the
``(layer, position)`` table, checked equal before timing:

- ``python loop``: ``f(corrupt, layer=l, pos=p)`` once per patch, with
  ``f = fh.capture(model, fh.patch(resid_pre, clean_record, nth=fh.arg("layer"),
  index=fh.arg("pos")))``: the baseline of the ratios;
- ``fh vmap``: ``torch.func.vmap`` of the same function over the 32 (layer, position)
  pairs: one call;
- ``hand-batched torch hooks``: the careful idiom without a library, its floor: one forward
  of the corrupted prompt repeated 32 times, a ``register_forward_hook`` per ``resid_pre``
  module writing row i's position from the clean run's values by hand indexing;
- ``fh per-row patch (one batched forward)``: the same idiom in funhooks, the loop's spec
  with ``per_row=True``: ``f(corrupt repeated 32 times, layer=layers, pos=positions)``,
  row i patched at ``layers[i]``, ``positions[i]``;
- peers, each only when importable (``pip install funhooks[bench]``): TransformerLens'
  ``patching.get_act_patch_resid_pre`` on a ``TransformerBridge`` wrapping a copy of the HF
  model (same weights); nnsight, one ``trace`` per patch setting the module's output; and
  nnsight batched by hand, the same idiom as the torch hooks in one ``trace``.

**Op-level recording.** Store the attention pattern (the ``softmax`` inside every
``transformer.h.*.attn``, eager attention) on each forward, against the bare forward:
``fh.with_hooks`` and ``fh.capture`` with ``fh.op_outputs``, and the module-level
``fh.outputs`` of the same modules for scale. *Unselected modules unchanged*: the MLP of
block 0 called alone, bare and inside an open op run on the attention modules; on issue 28's
model (GPT-2, n_embd 64, 4 layers, batch 8 x 12), ``op_outputs(attn, "softmax")`` and
``outputs(attn)`` against the bare eager forward (goal <= 1.15x), and
``op_outputs(attn, fh.attention_pattern)`` under SDPA against the bare SDPA forward (goal <= 1.20x).
Beside them, the floors of the design (a ``TorchFunctionMode`` entered for the selected
modules' own calls): a one-line forward wrapper on each attention module entering an empty
mode (``__torch_function__`` just calls func), and the same wrapper entering the leanest mode
doing the job the same way (storing ``softmax``'s output; under SDPA, computing the pattern
from the call's query, key and mask).

Models: GPT-2 with 4 layers, width 128, 4 heads, vocabulary 512; the sweep on one prompt of
8 tokens, the recording on a batch of 8 x 32 tokens; eval mode, ``torch.no_grad()``.

Run: ``python benchmarks/bench_patch.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens' patching shows a progress bar per call

import torch
from torch.overrides import TorchFunctionMode

import _common
import funhooks as fh

NAME = "patch"
LAYERS, WIDTH, HEADS, VOCAB = 4, 128, 4, 512
POSITIONS = 8
RECORD_BATCH, RECORD_LENGTH = 8, 32
QUICK = {"layers": 2, "width": 16, "heads": 2, "positions": 3, "batch": 2, "length": 5}
TOKENS = (7, 8)
"""The logit difference read at the last position: token 7 minus token 8."""
ATOL = 1e-4
RESID_PRE = ["transformer.drop", "transformer.h.*"]
ATTN = "transformer.h.*.attn"


def gpt2(layers: int, width: int, heads: int) -> torch.nn.Module:
    """A small GPT-2 from a config: random weights, eager attention, no download."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).eval()


def logit_diff(logits: torch.Tensor) -> torch.Tensor:
    return logits[..., -1, TOKENS[0]] - logits[..., -1, TOKENS[1]]


# -- the sweep --------------------------------------------------------------------------------


def sweep_cases(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor, layers: int,
                positions: int, *, peers: bool = True) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> a call of no arguments returning the ``(layers, positions)`` table (the
    hand-batched forward's and the peers' only with `peers`)."""
    _, rec = fh.capture(model, fh.outputs(RESID_PRE))(clean)
    f = fh.capture(model, fh.patch(RESID_PRE, rec, nth=fh.arg("layer"), index=fh.arg("pos")))

    def one(layer: Any, pos: Any) -> torch.Tensor:
        return logit_diff(f(corrupt, layer=layer, pos=pos, use_cache=False)[0].logits[0])

    def loop() -> torch.Tensor:
        return torch.stack([torch.stack([one(layer, pos) for pos in range(positions)]) for layer in range(layers)])

    pairs = (torch.arange(layers).repeat_interleave(positions), torch.arange(positions).repeat(layers))
    swept = torch.func.vmap(one)

    def vmapped() -> torch.Tensor:
        return swept(*pairs).reshape(layers, positions)

    batch = corrupt.expand(layers * positions, -1)
    rows = fh.capture(model, fh.patch(RESID_PRE, rec, nth=fh.arg("layer"), index=fh.arg("pos"), per_row=True))

    def per_row() -> torch.Tensor:
        return logit_diff(rows(batch, layer=pairs[0], pos=pairs[1], use_cache=False)[0].logits).reshape(layers, positions)

    cases = {"python loop": loop, "fh vmap": vmapped, PER_ROW: per_row}
    if peers:
        cases[HAND] = _hand_batched(model, rec, corrupt, layers, positions)
    for name, (module, build) in (PEERS if peers else {}).items():
        if importlib.util.find_spec(module) is None:
            continue
        try:
            cases[name] = build(model, clean, corrupt, layers, positions)
        except Exception as err:  # a peer that imports but fails here is reported, not fatal
            print(f"{name} skipped: {type(err).__name__}: {err}")
    return cases


PER_ROW = "fh per-row patch (one batched forward)"
HAND = "hand-batched torch hooks"


def _resid_pre(layers: int) -> list[str]:
    """The paths of the modules whose outputs are the `layers` first ``resid_pre``s."""
    return ["transformer.drop"] + [f"transformer.h.{i}" for i in range(layers - 1)]


def _rows(layers: int, positions: int) -> torch.Tensor:
    """The rows of a batch of ``layers x positions`` patches, by (layer, position): row
    ``layer * positions + pos`` patches (layer, pos), so the logit differences reshape to the table."""
    return torch.arange(layers * positions).reshape(layers, positions)


def _hand_batched(model: torch.nn.Module, rec: fh.Record, corrupt: torch.Tensor, layers: int,
                  positions: int) -> Callable[[], torch.Tensor]:
    """The idiom by hand without a library: the corrupted prompt repeated once per patch, one
    ``register_forward_hook`` per ``resid_pre`` module writing its rows' positions from the
    clean run's values (in place, under ``no_grad``), removed after the forward."""
    paths = _resid_pre(layers)
    sources = [rec[p]["output"][0] for p in paths]
    rows, at = _rows(layers, positions), torch.arange(positions)
    batch = corrupt.expand(layers * positions, -1)

    def writer(layer: int) -> Callable[..., torch.Tensor]:
        def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            output[rows[layer], at] = sources[layer]
            return output

        return hook

    modules = [model.get_submodule(p) for p in paths]

    def call() -> torch.Tensor:
        handles = [m.register_forward_hook(writer(i)) for i, m in enumerate(modules)]
        try:
            logits = model(batch, use_cache=False).logits
        finally:
            for h in handles:
                h.remove()
        return logit_diff(logits).reshape(layers, positions)

    return call


def _transformer_lens(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor, layers: int,
                      positions: int) -> Callable[[], torch.Tensor]:
    """``get_act_patch_resid_pre`` on a bridge around a copy of the HF model, same weights (the
    bridge re-registers the model's modules, which would change the other cases' model); no
    tokenizer download: a word-level one made in memory."""

    import tokenizers
    import transformer_lens
    import transformers
    from transformer_lens.model_bridge import TransformerBridge  # TransformerLens 3.9 and 4

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")))
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=copy.deepcopy(model), tokenizer=tok)
    _, cache = bridge.run_with_cache(clean)

    def call() -> torch.Tensor:
        return transformer_lens.patching.get_act_patch_resid_pre(bridge, corrupt, cache, lambda lg: logit_diff(lg[0]))

    return call


def _nnsight(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor, layers: int,
             positions: int) -> Callable[[], torch.Tensor]:
    """One nnsight ``trace`` per patch, setting the module's output at the position."""
    import nnsight

    # NNsight installs its own forwards on the model it wraps, for good: a copy keeps them off the other cases
    wrapped = nnsight.NNsight(copy.deepcopy(model))
    envoys = [wrapped.transformer.drop] + [wrapped.transformer.h[i] for i in range(layers - 1)]
    _, rec = fh.capture(model, fh.outputs(RESID_PRE))(clean)
    sources = [rec[p]["output"] for p in _resid_pre(layers)]

    def call() -> torch.Tensor:
        table = torch.empty(layers, positions)
        for layer in range(layers):
            for pos in range(positions):
                with wrapped.trace(corrupt):
                    envoys[layer].output[:, pos] = sources[layer][:, pos]
                    logits = wrapped.lm_head.output.save()
                table[layer, pos] = logit_diff(logits[0])
        return table

    return call


def _nnsight_batched(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor, layers: int,
                     positions: int) -> Callable[[], torch.Tensor]:
    """nnsight's careful idiom: ONE ``trace`` of the corrupted prompt repeated once per patch,
    each ``resid_pre`` module's output set at its rows' positions by hand indexing (modules
    in the order they run, as nnsight requires), the logits saved."""
    import nnsight

    # NNsight installs its own forwards on the model it wraps, for good: a copy keeps them off the other cases
    wrapped = nnsight.NNsight(copy.deepcopy(model))
    envoys = [wrapped.transformer.drop] + [wrapped.transformer.h[i] for i in range(layers - 1)]
    saved = []
    with wrapped.trace(clean):
        for envoy in envoys:
            saved.append(envoy.output.save())
    sources = [s[0] for s in saved]
    rows, at = _rows(layers, positions), torch.arange(positions)
    batch = corrupt.expand(layers * positions, -1)

    def call() -> torch.Tensor:
        with wrapped.trace(batch):
            for layer, envoy in enumerate(envoys):
                envoy.output[rows[layer], at] = sources[layer]
            logits = wrapped.lm_head.output.save()
        return logit_diff(logits).reshape(layers, positions)

    return call


PEERS = {
    "TransformerLens get_act_patch_resid_pre": ("transformer_lens", _transformer_lens),
    "nnsight, one trace per patch": ("nnsight", _nnsight),
    "nnsight batched by hand": ("nnsight", _nnsight_batched),
}


# -- op-level recording -----------------------------------------------------------------------


class _OpenRun:
    """A call of `fn` while a ``with_hooks`` block on `model` is open (entered per round)."""

    def __init__(self, model: torch.nn.Module, specs: Any, fn: Callable[[], Any]) -> None:
        self.run = fh.with_hooks(model, specs)
        self.run.__enter__()
        self.fn = fn

    def __call__(self) -> Any:
        return self.fn()

    def close(self) -> None:
        self.run.__exit__(None, None, None)


def record_cases(model: torch.nn.Module, x: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """The forward cases (name -> call) and the unselected-module cases."""
    pattern = fh.op_outputs(ATTN, "softmax")

    def in_run(spec: fh.Spec) -> Callable[[], Any]:
        def call() -> Any:
            with fh.with_hooks(model, spec) as run:
                model(x, use_cache=False)
            return run.record

        return call

    forward = {"bare": lambda: model(x, use_cache=False),
               "fh.with_hooks op_outputs(attn, softmax)": in_run(pattern),
               "fh.capture op_outputs(attn, softmax)": _common.PerRound(lambda: _bound(fh.capture(model, pattern), x)),
               "fh.with_hooks outputs(attn), for scale": in_run(fh.outputs(ATTN))}
    mlp = model.transformer.h[0].mlp
    h = torch.randn(*x.shape, model.config.n_embd)
    unselected = {"mlp of block 0, bare": lambda: mlp(h),
                  "mlp of block 0, inside an open op run": _common.PerRound(lambda: _OpenRun(model, pattern, lambda: mlp(h)))}
    return forward, unselected


ISSUE_MODEL = {"layers": 4, "width": 64, "heads": 4, "batch": 8, "length": 12}
"""Issue 28's model for the op-spec speed goals: GPT-2, n_embd 64, 4 layers, batch 8 x 12."""


def attention_cases(size: dict[str, int]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Issue 28's rows: under eager attention, the bare forward, ``outputs(attn)``,
    ``op_outputs(attn, "softmax")``, ``op_outputs(attn, fh.attention_pattern)`` and the two
    floors (:func:`floor_cases`); under SDPA, the bare SDPA forward,
    ``op_outputs(attn, fh.attention_pattern)`` and its floors; and whether every recorded
    pattern (SDPA's, the floors') equals eager's ``output_attentions``."""

    torch.manual_seed(0)
    eager = gpt2(size["layers"], size["width"], size["heads"])
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    x = torch.randint(0, VOCAB, (size["batch"], size["length"]))

    def captured(model: torch.nn.Module, spec: fh.Spec) -> _common.PerRound:
        return _common.PerRound(lambda: _bound(fh.capture(model, spec), x))

    pattern = fh.op_outputs(ATTN, fh.attention_pattern)
    eager_cases = {"bare (eager)": lambda: eager(x, use_cache=False),
                   "fh.capture outputs(attn)": captured(eager, fh.outputs(ATTN)),
                   "fh.capture op_outputs(attn, softmax)": captured(eager, fh.op_outputs(ATTN, "softmax")),
                   "fh.capture op_outputs(attn, fh.attention_pattern)": captured(eager, pattern),
                   **floor_cases(eager, x, _Softmax, "softmax")}
    sdpa_cases = {"bare SDPA forward": lambda: sdpa(x, use_cache=False),
                  "fh.capture op_outputs(attn, fh.attention_pattern)": captured(sdpa, pattern),
                  **floor_cases(sdpa, x, _SdpaPattern, "SDPA pattern")}
    expected = eager(x, output_attentions=True, use_cache=False).attentions
    _, rec = fh.capture(sdpa, pattern)(x, use_cache=False)
    floors = [_resolve_floor(case) for case in (eager_cases["floor: that mode taking the softmax"],
                                                sdpa_cases["floor: that mode taking the SDPA pattern"])]
    same = all(torch.allclose(rec[f"transformer.h.{i}.attn"]["attention_pattern"], a, atol=1e-6)
               and torch.equal(floors[0][i], a) and torch.allclose(floors[1][i], a, atol=1e-6)
               for i, a in enumerate(expected))
    return eager_cases, sdpa_cases, same


class _Pass(TorchFunctionMode):
    """The floor of an op spec's design: a mode whose ``__torch_function__`` just calls func."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        return func(*args, **kwargs) if kwargs else func(*args)


class _Softmax(_Pass):
    """The leanest mode taking eager attention's pattern: store ``softmax``'s output."""

    def __init__(self, stored: list[torch.Tensor]) -> None:
        super().__init__()
        self.stored = stored

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        if func is _SOFTMAX:
            self.stored.append(out.detach())
        return out


class _SdpaPattern(_Softmax):
    """The leanest mode computing an SDPA call's pattern from its query, key and mask (``q @
    kᵀ`` scaled, the mask applied, a softmax), stored; the call itself is SDPA's."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is _SDPA:
            a = {"attn_mask": None, "is_causal": False, "scale": None, **dict(zip(("query", "key"), args)), **kwargs}
            q, k = a["query"], a["key"]
            scores = torch.matmul(q, k.transpose(-2, -1)).mul_(a["scale"] or q.size(-1) ** -0.5)
            if a["is_causal"]:
                scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool).triu_(1), -math.inf)
            if a["attn_mask"] is not None:
                mask = a["attn_mask"]
                scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
            self.stored.append(torch.softmax(scores, -1))
        return func(*args, **kwargs) if kwargs else func(*args)


_SOFTMAX, _SDPA = torch.nn.functional.softmax, torch.nn.functional.scaled_dot_product_attention


class _Floor:
    """`model(x)` with a one-line forward wrapper on each attention module entering a mode
    (``mode(stored)``, made once per module) around its call; the wrappers are put on per
    round and taken off by ``close``. Returns what the modes stored."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, mode: Callable[[list], TorchFunctionMode]) -> None:
        self.model, self.x, self.stored = model, x, []
        self.modules = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
        for m in self.modules:
            m.forward = self._wrap(m.forward, mode(self.stored))

    @staticmethod
    def _wrap(forward: Callable[..., Any], mode: TorchFunctionMode) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with mode:
                return forward(*args, **kwargs)

        return wrapper

    def __call__(self) -> list[torch.Tensor]:
        self.stored.clear()
        self.model(self.x, use_cache=False)
        return list(self.stored)

    def close(self) -> None:
        for m in self.modules:
            del m.forward


def floor_cases(model: torch.nn.Module, x: torch.Tensor, mode: Callable[[list], TorchFunctionMode],
                name: str) -> dict[str, _common.PerRound]:
    """The two floor rows of `model`: the empty mode around each attention call, and `mode`
    taking the pattern (`name`)."""
    return {"floor: empty TorchFunctionMode per attn call": _common.PerRound(lambda: _Floor(model, x, lambda _: _Pass())),
            f"floor: that mode taking the {name}": _common.PerRound(lambda: _Floor(model, x, mode))}


def _resolve_floor(case: _common.PerRound) -> list[torch.Tensor]:
    """What a floor case stores in one call (its wrappers taken off after)."""
    floor = case.factory()
    try:
        return floor()
    finally:
        floor.close()


def _bound(f: Callable[..., Any], x: torch.Tensor) -> Callable[[], Any]:
    return lambda: f(x, use_cache=False)


def check_records(model: torch.nn.Module, x: torch.Tensor) -> bool:
    """The recorded patterns are the attention weights HF returns with ``output_attentions``."""
    out = model(x, output_attentions=True, use_cache=False)
    with fh.with_hooks(model, fh.op_outputs(ATTN, "softmax")) as run:
        model(x, use_cache=False)
    _, rec = fh.capture(model, fh.op_outputs(ATTN, "softmax"))(x, use_cache=False)
    return all(torch.equal(run.record[f"transformer.h.{i}.attn"]["softmax"], a)
               and torch.equal(rec[f"transformer.h.{i}.attn"]["softmax"], a) for i, a in enumerate(out.attentions))


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup(args.clock)
    size = QUICK if args.quick else {"layers": LAYERS, "width": WIDTH, "heads": HEADS, "positions": POSITIONS,
                                     "batch": RECORD_BATCH, "length": RECORD_LENGTH}
    torch.manual_seed(0)
    model = gpt2(size["layers"], size["width"], size["heads"])
    clean = torch.randint(0, VOCAB, (1, size["positions"]))
    corrupt = clean.clone()
    corrupt[0, size["positions"] // 2] = (corrupt[0, size["positions"] // 2] + 1) % VOCAB
    x = torch.randint(0, VOCAB, (size["batch"], size["length"]))
    timing = {"rounds": args.rounds, "warmup": args.warmup, "inner": args.inner, "clock": args.clock}
    with torch.no_grad():
        sweeps = sweep_cases(model, clean, corrupt, size["layers"], size["positions"])
        reference = sweeps["python loop"]()
        checks = {name: bool(torch.allclose(case().float(), reference, atol=ATOL)) for name, case in sweeps.items()}
        _common.check(all(checks.values()), f"sweep tables differ: {checks}")
        swept = _common.time_cases(sweeps, baseline="python loop", **timing)
        checks["op recording == output_attentions"] = check_records(model, x)
        _common.check(checks["op recording == output_attentions"], "recorded patterns != HF attention weights")
        forward, unselected = record_cases(model, x)
        recorded = _common.time_cases(forward, baseline="bare", **timing)
        alone = _common.time_cases(unselected, baseline="mlp of block 0, bare", **timing)
        eager_cases, sdpa_cases, checks["SDPA pattern == eager pattern"] = attention_cases(QUICK if args.quick else ISSUE_MODEL)
        _common.check(checks["SDPA pattern == eager pattern"], "SDPA patterns != eager attention weights")
        eager_attn = _common.time_cases(eager_cases, baseline="bare (eager)", **timing)
        sdpa_attn = _common.time_cases(sdpa_cases, baseline="bare SDPA forward", **timing)
    patches = size["layers"] * size["positions"]
    print(_common.format_table(f"patching sweep, {patches} patches (ratio: time / python loop)", swept))
    speedup = 1 / swept["fh vmap"]["ratio"]["median"]
    print(f"vmap speed-up over the python loop: {speedup:.1f}x")
    per_row = swept[PER_ROW]["ratio"]["median"] / swept[HAND]["ratio"]["median"]
    print(f"fh per-row / hand-batched torch hooks: {per_row:.2f}x (goal <= 1.0)")
    print(_common.format_table(f"attention pattern on every forward, batch {tuple(x.shape)}", recorded))
    print(_common.format_table("an unselected module while an op run is open", alone))
    print(_common.format_table("issue 28's model, eager attention (ratio: time / bare eager forward)", eager_attn))
    print(_common.format_table("issue 28's model, SDPA attention (ratio: time / bare SDPA forward)", sdpa_attn))
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "rounds": args.rounds, "warmup": args.warmup,
        "model": size, "correct": all(checks.values()), "checks": checks,
        "results": {"sweep": {"patches": patches, "cases": swept, "speedup": speedup, "per_row_to_hand": per_row},
                    "record": {"batch": list(x.shape), "cases": recorded},
                    "unselected": {"cases": alone},
                    "attention": {"model": ISSUE_MODEL, "eager": eager_attn, "sdpa": sdpa_attn}},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
