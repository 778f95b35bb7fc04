"""The ``funhooks`` command line: ``funhooks summary`` and ``funhooks demo``.

``python -m funhooks`` is the same command. A bad argument ends the command with one line
on stderr, ``funhooks <command>: <what is wrong>. <how to fix>.``, and a non-zero exit
status (2 for a malformed command line, 1 for a model or factory that fails); never with a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # torch is imported when a command needs it: `funhooks --help` stays fast
    import torch
    from torch import nn

__all__ = ["main"]

_EXIT_FAILED = 1  # the command ran and something it ran failed
_EXIT_USAGE = 2  # the command line itself is wrong (argparse's convention)
_EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64")


class _CommandError(Exception):
    """A failure to report as one line and exit status :data:`_EXIT_FAILED`."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, not the usage block plus a line."""

    def error(self, message: str) -> NoReturn:
        self.exit(_EXIT_USAGE, f"{self.prog}: {message}. Run `{self.prog} --help` for usage.\n")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _positive(text: str, option: str = "--input-size") -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"`{option}` takes positive integers, got {text!r}")
    return value


def _depth(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"`--depth` takes an integer >= 0, got {text!r}")
    return value


class _Kwarg(argparse.Action):
    """``--kwarg NAME[:DTYPE] N [N ...]``: one keyword input, stored as ``(name, dtype, size)``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[object] | None, option_string: str | None = None) -> None:
        tokens = [str(v) for v in values or ()]
        name, _, dtype = tokens[0].partition(":")
        if not name.isidentifier() or (dtype and dtype not in _DTYPES) or len(tokens) < 2:
            parser.error(f"argument --kwarg: takes `NAME[:DTYPE] N [N ...]` (DTYPE one of {', '.join(_DTYPES)}), "
                         f"got {' '.join(tokens)!r}; write e.g. `--kwarg input_ids:int64 2 16`")
        try:
            size = [_positive(t, "--kwarg") for t in tokens[1:]]
        except argparse.ArgumentTypeError as err:
            parser.error(f"argument --kwarg: {err}")
        getattr(namespace, self.dest).append((name, dtype or None, size))


def _target(text: str) -> str:
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise argparse.ArgumentTypeError(f"the target is `MODULE:FACTORY`, got {text!r}; write e.g. `mypkg.models:make_model`")
    return text


# -- summary ----------------------------------------------------------------------------------------


def _import(target: str) -> object:
    """The object named by ``MODULE:ATTR`` (MODULE may be a ``.py`` file; ATTR may be dotted)."""
    module_name, _, attr = target.partition(":")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise _CommandError(f"the file {module_name!r} does not exist. Check the path")
            spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            assert spec is not None and spec.loader is not None  # a .py file always has a loader
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())  # `funhooks summary mymodel:make` finds ./mymodel.py
            module = importlib.import_module(module_name)
    except _CommandError:
        raise
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise _CommandError(
                f"no module named {err.name!r} (looked in the current directory and sys.path), got target "
                f"{target!r}. Check the spelling or install the package"
            ) from None
        raise _CommandError(f"importing {module_name!r} raised {_first_line(err)}. Fix that module") from None
    except Exception as err:  # noqa: BLE001 - any import-time failure of user code becomes one line
        raise _CommandError(f"importing {module_name!r} raised {_first_line(err)}. Fix that module") from None
    obj: object = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = ".".join([module_name, *attr.split(".")[:i]])
            names = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise _CommandError(
                f"{where!r} has no attribute {part!r}, got target {target!r}. Public names there: {names[:10]}"
            )
        obj = getattr(obj, part)
    return obj


def _build_model(target: str) -> nn.Module:
    from torch import nn

    factory = _import(target)
    if isinstance(factory, nn.Module):
        return factory
    if not callable(factory):
        raise _CommandError(f"{target!r} is a factory or an nn.Module, got {type(factory).__name__}. Point at one")
    try:
        model = factory()
    except Exception as err:  # noqa: BLE001 - the user's factory failing is reported, not re-raised
        raise _CommandError(f"the factory {target!r} raised {_first_line(err)}. Fix the factory") from None
    if not isinstance(model, nn.Module):
        raise _CommandError(
            f"the factory {target!r} returns an nn.Module, got {type(model).__name__}. Return the model"
        )
    return model


def _input(model: nn.Module, size: Sequence[int], dtype_name: str | None) -> torch.Tensor:
    import torch

    if dtype_name is None:
        floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
    else:
        dtype = getattr(torch, dtype_name)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if not dtype.is_floating_point:
        return torch.zeros(tuple(size), dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    return (torch.rand(tuple(size), generator=gen) * 2 - 1).to(device=device, dtype=dtype)


def _summary(args: argparse.Namespace) -> int:
    from .summary.utilities import module_summary

    model = _build_model(args.target)
    xb = [_input(model, size, args.dtype) for size in args.input_size]
    kwargs = {name: _input(model, size, dtype or args.dtype) for name, dtype, size in args.kwarg}
    try:
        summary = module_summary(model, *xb, depth=args.depth, layout=args.layout, **kwargs)
    except Exception as err:  # noqa: BLE001 - the model rejecting the input is a user-facing error
        sizes = " and ".join([*(str(tuple(s)) for s in args.input_size),
                              *(f"{name}={tuple(s)}" for name, _, s in args.kwarg)])
        raise _CommandError(
            f"{type(model).__name__} rejected an input of size {sizes}: {_first_line(err)}. "
            "Pass the size the model expects with `--input-size` or `--kwarg`"
        ) from None
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary)
    return 0


# -- demo ------------------------------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from . import demo
    from .errors import ExtraError

    fast = args.fast or os.environ.get("FUNHOOKS_FAST", "") not in ("", "0")
    try:
        demo.run(out=args.out, epochs=args.epochs, fast=fast, progress=False if args.no_progress else None)
    except ExtraError as err:
        raise _CommandError(str(err).rstrip(".")) from None
    except OSError as err:
        raise _CommandError(f"cannot write the plots into {args.out!r}: {_first_line(err)}. Pass a writable `--out`") from None
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="funhooks", description="Functional, immutable hooks for PyTorch.")
    parser.add_argument("--version", action="version", version=f"funhooks {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("summary", help="print a model's layer table and parameter totals",
                       description="Build a model from a factory and print its summary: fastai's table for "
                       "positional inputs, or the full table (every module down to --depth with input and output "
                       "shapes, parameters, MACs, FLOPs and memory estimates) with --kwarg, --depth or "
                       "--layout full. Example for a Hugging Face model: `funhooks summary my_models:tiny_bert "
                       "--kwarg input_ids:int64 2 16 --kwarg attention_mask:int64 2 16 --depth 2`.")
    p.add_argument("target", metavar="MODULE:FACTORY", type=_target,
                   help="a module (or .py file) and a callable in it returning an nn.Module, or an nn.Module")
    p.add_argument("--input-size", type=_positive, nargs="+", action="append", default=[], metavar="N",
                   help="a positional input's shape, batch first, e.g. `1 3 32 32`; repeat for a model with several "
                   "inputs")
    p.add_argument("--kwarg", action=_Kwarg, nargs="+", default=[], metavar="NAME[:DTYPE] N",
                   help="a keyword input: its name, optionally its dtype, and its shape, e.g. "
                   "`--kwarg input_ids:int64 2 16`; repeat for several (integer inputs are zeros)")
    p.add_argument("--dtype", choices=_DTYPES, help="the inputs' dtype (default: the model's; int64 for indices)")
    p.add_argument("--depth", type=_depth, metavar="N",
                   help="list modules down to N path segments in the full table (0: the model alone; "
                   "default: every module); implies --layout full")
    p.add_argument("--layout", choices=("fastai", "full"),
                   help="fastai's leaf table, or the full table (default: fastai for positional inputs alone)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.set_defaults(run=_summary)

    d = sub.add_parser("demo", help="train a small CNN on scikit-learn's digits and plot its activations",
                       description="Train a small CNN on the 8x8 digits that ship with scikit-learn, fold "
                       "ActivationStats over the steps and write the plots as PNG files.")
    d.add_argument("--out", default="funhooks-demo", help="directory for the PNG files (default: %(default)s)")
    d.add_argument("--epochs", type=_positive, default=None, help="epochs to train (default: 8; 1 with --fast)")
    d.add_argument("--fast", action="store_true", help="one epoch on a small subset (also FUNHOOKS_FAST=1)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(run=_demo)
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("funhooks")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``funhooks`` command line.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 1 when the model or factory fails, 2 for a malformed
        command line (argparse exits with it itself), 130 on Ctrl-C.

    Example:
        >>> from funhooks.cli import main
        >>> main(["summary", "torch.nn:Identity", "--input-size", "2", "3"])
        Identity (Input shape: ['2 x 3'])
        ================================================================
        Layer (type)         Output Shape         Param #    Trainable
        ================================================================
        Identity             2 x 3
        ________________________________________________________________
        <BLANKLINE>
        Total params: 0
        Total trainable params: 0
        Total non-trainable params: 0
        0
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "summary" and not args.input_size and not args.kwarg:
        parser.exit(_EXIT_USAGE, "funhooks summary: an input is required: pass `--input-size N [N ...]` or "
                    "`--kwarg NAME N [N ...]`. Run `funhooks summary --help` for usage.\n")
    try:
        return args.run(args)
    except _CommandError as err:
        print(f"funhooks {args.command}: {err}.", file=sys.stderr)
        return _EXIT_FAILED
    except KeyboardInterrupt:
        print(f"funhooks {args.command}: interrupted.", file=sys.stderr)
        return _EXIT_INTERRUPTED
