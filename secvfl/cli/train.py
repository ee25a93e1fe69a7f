"""`secvfl train`: train one algorithm on one dataset with the configured protocols."""

from __future__ import annotations

import argparse
from pathlib import Path

from secvfl.cli.config_file import typed_defaults
from secvfl.cli.helptext import show_defaults
from secvfl.config import BOTTOMS, DTYPES, TrainConfig
from secvfl.data.partition import IMAGE_SPLITS
from secvfl.data.preprocess import NAN_POLICIES
from secvfl.errors import ConfigError
from secvfl.options import add_option_arguments
from secvfl.plugins import option_groups, unavailable_plugins

__all__ = ["register", "run", "add_train_arguments", "config_from_args"]

_CORE_DESTS = set(TrainConfig.__dataclass_fields__) - {"options"}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


_ints.toml_expected = "an array of integers, e.g. [64, 32] ([] for none)"  # type: ignore[attr-defined]


def _p_miss(text: str) -> str:
    return text.strip()  # checked with the other settings in TrainConfig, so every problem shows at once


_p_miss.toml_expected = 'a number in [0, 1) or a string "beta:A,B"'  # type: ignore[attr-defined]


def _widths(widths: tuple[int, ...]) -> str:
    return ",".join(map(str, widths)) or "''"


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    g = p.add_argument_group("training")
    g.add_argument("--algo", default=d.algo, help="training algorithm (see `secvfl train --list-algos`)")
    g.add_argument("--dataset", default=d.dataset,
                   help="digits | breast_cancer | wine | credit | mnist | a9a | w8a | mushrooms | csv:PATH[:LABEL] | "
                        "idx:DIR | svmlight:PATH[,TEST]")
    g.add_argument("--data-dir", default=None, help="folder of the named real datasets (default $SECVFL_DATA_DIR)")
    g.add_argument("--parties", type=int, default=d.parties,
                   help="number of feature parties K; each holds a contiguous block of columns (an image region)")
    g.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training split")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="training rows per batch")
    g.add_argument("--lr", type=float, default=d.lr, help="learning rate of every party's optimizer (positive)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="L2 weight decay of every optimizer")
    g.add_argument("--optimizer", default=d.optimizer, choices=["adam", "sgd", "adamw"],
                   help="optimizer of every party's model")
    g.add_argument("--seed", type=int, default=d.seed,
                   help="seed of every random choice (validation split, masks, weights, batches), 0 to 2^32-1")
    g.add_argument("--device", default=d.device, help="auto (cuda when available) | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default=d.dtype, choices=list(DTYPES), help="floating-point type of models and messages")
    g.add_argument("--p-miss-train", type=_p_miss, default=d.p_miss_train,
                   help="probability that a party's block of a training row is missing, or beta:A,B (a probability "
                        "per block drawn from Beta(A, B))")
    g.add_argument("--p-miss-test", type=_p_miss, default=d.p_miss_test,
                   help="the same at validation and test time")
    g.add_argument("--bottom", default=d.bottom, choices=list(BOTTOMS),
                   help="feature parties' bottom model: mlp (--hidden widths), cnn (two conv blocks, image regions) or "
                        "resnet (a small ResNet for colour image regions, stem width --hidden's first value)")
    g.add_argument("--hidden", type=_ints, default=d.hidden,
                   help="bottom-model hidden widths, comma-separated, e.g. 256,256; '' for none (a linear bottom) "
                        f"(default: {_widths(d.hidden)})")
    g.add_argument("--embedding-dim", type=int, default=d.embedding_dim,
                   help="width of the embedding each feature party sends")
    g.add_argument("--head-hidden", type=_ints, default=d.head_hidden,
                   help="label party's head hidden widths, comma-separated; '' for none "
                        f"(default: {_widths(d.head_hidden)})")
    g.add_argument("--image-split", default=d.image_split, choices=list(IMAGE_SPLITS),
                   help="how images are cut among parties: auto (quadrants for 4 parties, else strips), strips, "
                        "quadrants (a grid), columns (pixels as table columns)")
    g.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="fraction of training rows held out for validation, in [0, 1)")
    g.add_argument("--nan-policy", default=d.nan_policy, choices=list(NAN_POLICIES),
                   help="missing cells: mean (impute training-split means), drop (remove incomplete rows), error")
    g.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size,
                   help="rows per forward pass when evaluating (memory only; results do not depend on it)")
    g.add_argument("--threads", type=int, default=d.threads,
                   help="torch intra-op threads (1 is fastest for small models on a shared machine)")
    for group in option_groups():  # the algorithm families' options, then the protocol plugins', from their types
        section = p.add_argument_group(group.title, group.options_type.description or None)
        add_option_arguments(section, group.options_type)
    missing = unavailable_plugins()
    if missing:  # their flags are unknown here; say why rather than leave "unrecognized arguments" unexplained
        p.epilog = "protocol plugins that could not be loaded: " + "; ".join(
            f"{name} ({why})" for name, why in missing.items())
    show_defaults(p)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    ns = vars(args)
    core = {k: ns[k] for k in _CORE_DESTS if k in ns}
    skip = _CORE_DESTS | {"func", "command", "config", "out", "resume", "from_epoch", "no_progress", "list_algos"}
    options = {k: v for k, v in ns.items() if k not in skip and not k.startswith("_")}
    return TrainConfig(**core, options=options)


def apply_config_file(parser: argparse.ArgumentParser, path: Path) -> None:
    """Values in the TOML file become defaults; flags given on the command line win.

    Each value must have the type its flag takes (see :mod:`secvfl.cli.config_file`); a saved run's config.toml,
    whose algorithm and protocol options sit in an ``[options]`` table, is read the same way.
    """
    from secvfl.runner import load_config_file

    values = load_config_file(path)
    options = values.pop("options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{path}: options must be a table ([options]) of flag values, got {options!r}")
    flat = {**options, **values}
    parser.set_defaults(**typed_defaults(parser, flat, str(path)))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a VFL model", description=__doc__)
    p.add_argument("--config", type=Path, help="TOML file; any flag can be set there (flags on the command line win)")
    p.add_argument("--out", type=Path,
                   help="run directory for config, metrics, checkpoints, summary and curves.png "
                        "(default: a fresh runs/<algo>-<dataset>-<date>-<time>)")
    p.add_argument("--resume", type=Path, metavar="DIR",
                   help="continue the run in DIR from its last checkpoint, with its own settings; --epochs N trains "
                        "it longer (also a finished run); --data-dir, --threads and --device may change, other flags may "
                        "not")
    p.add_argument("--from-epoch", type=int, default=None, metavar="N",
                   help="with --resume: start from the checkpoint after epoch N (the previous one is kept in case "
                        "the latest is damaged; 0: from the run's beginning); later checkpoints are discarded")
    p.add_argument("--no-progress", action="store_true",
                   help="print a line per epoch instead of a progress bar (the bar is shown only on a terminal)")
    p.add_argument("--list-algos", action="store_true", help="list the algorithms and exit")
    add_train_arguments(p)
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    if args.list_algos:
        from secvfl.algorithms import algorithm_names

        print("\n".join(algorithm_names()))
        return 0
    if args.config is not None:
        parser = args._parser
        apply_config_file(parser, args.config)
        argv = args._argv
        args = parser.parse_args(argv[argv.index("train") + 1 :])
        args._argv = argv
    from secvfl.rundir import default_run_dir
    from secvfl.runner import run_training

    progress = not args.no_progress
    if args.resume is not None:
        from secvfl.deploy.party import deployed_resume_command

        deployed = deployed_resume_command(args.resume)
        if deployed is not None:  # its feature parties' states are in their own processes' directories
            raise ConfigError(f"--resume {args.resume}: this run's parties run in separate processes (it is the label "
                              f"party's directory of a federation), so it continues with `{deployed}`")
        changes = _resume_changes(args)
        run_training(TrainConfig(), resume=args.resume, from_epoch=args.from_epoch, changes=changes, progress=progress)
        return 0
    cfg = config_from_args(args)
    out = args.out if args.out is not None else default_run_dir(cfg)
    run_training(cfg, out=out, from_epoch=args.from_epoch, progress=progress)
    return 0


# Flags that say how to run, not what: they never count as a change of a resumed run.
_RUN_LOCAL = {"no_progress", "resume", "from_epoch", "config", "list_algos"}


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the flags typed on the command line (not defaults, not --config values)."""
    actions = [a for a in parser._actions if a.dest != "help"]
    defaults = [(a, a.default) for a in actions]
    parser_defaults = dict(parser._defaults)
    try:
        for a in actions:
            a.default = argparse.SUPPRESS
        parser._defaults.clear()
        typed = parser.parse_args(argv)
    finally:
        for a, d in defaults:
            a.default = d
        parser._defaults.update(parser_defaults)
    return set(vars(typed))


def _comparable(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if isinstance(value, str):
        try:
            return float(value)  # "0.30" and "0.3" are the same probability
        except ValueError:
            return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _resume_changes(args: argparse.Namespace, command: str = "train", local: frozenset[str] = frozenset()
                    ) -> dict[str, object]:
    """The settings a ``--resume`` command line changes; refuses (one line, listing them) all but RESUME_CHANGES.
    ``command``: the subcommand whose flags these are; ``local``: its flags that are no settings of the run."""
    from secvfl.runner import RESUME_CHANGES, load_config_file, read_run_config

    run_dir = args.resume
    argv = args._argv
    given = _given(args._parser, argv[argv.index(command) + 1 :]) - _RUN_LOCAL - local
    if getattr(args, "config", None) is not None:  # the file's settings count as given too
        values = load_config_file(args.config)
        given |= {k.replace("-", "_") for k in {**values.pop("options", {}), **values}}
    if "out" in given:
        given.discard("out")
        if args.out.resolve() != run_dir.resolve():
            raise ConfigError(f"--out {args.out} cannot be combined with --resume {run_dir}: a resumed run stays in "
                              "its directory; drop --out")
    saved = read_run_config(run_dir).to_dict()
    saved.update(saved.pop("options", {}))
    # the run's settings with what the command line gives, typed and checked together (an option of the run's
    # algorithm, say, is valid only with it): "0.30" and 0.3 are then the same value
    ns = vars(args)
    wanted = TrainConfig.from_dict({**saved, **{d: ns[d] for d in given if d in ns}}).to_dict()
    wanted.update(wanted.pop("options", {}))
    changed = [d for d in sorted(given) if d in wanted and _comparable(wanted[d]) != _comparable(saved.get(d))]
    refused = [d for d in changed if d not in RESUME_CHANGES]
    if refused:
        flags = {a.dest: a.option_strings[0] for a in args._parser._actions if a.option_strings}
        listed = ", ".join(f"{flags.get(d, d)} {wanted[d]!r} (the run has {saved.get(d)!r})" for d in refused)
        raise ConfigError(
            f"--resume {run_dir} continues the run with its own settings (config.toml), but the command line changes "
            f"{listed}; only --epochs (to train longer), --data-dir, --threads, --device and --dp-accept-epsilon may "
            "change: drop the others, or start a new run with --out"
        )
    return {d: wanted[d] for d in changed}
