"""`secvfl train`: train one algorithm on one dataset with the configured protocols."""

from __future__ import annotations

import argparse
from pathlib import Path

from protocols.plugins import load_plugins
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError

__all__ = ["register", "run", "add_train_arguments", "config_from_args"]

_CORE_DESTS = set(TrainConfig.__dataclass_fields__) - {"options"}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    g = p.add_argument_group("training")
    g.add_argument("--algo", default=d.algo, help="training algorithm (see `secvfl train --list-algos`)")
    g.add_argument("--dataset", default=d.dataset,
                   help="digits | breast_cancer | wine | credit | mnist | a9a | w8a | mushrooms | csv:PATH[:LABEL] | "
                        "idx:DIR | svmlight:PATH[,TEST]")
    g.add_argument("--data-dir", default=None, help="folder of the named real datasets (default $SECVFL_DATA_DIR)")
    g.add_argument("--parties", type=int, default=d.parties, help="number of feature parties K")
    g.add_argument("--epochs", type=int, default=d.epochs)
    g.add_argument("--batch-size", type=int, default=d.batch_size)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--optimizer", default=d.optimizer, choices=["adam", "sgd", "adamw"])
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--device", default=d.device, help="cpu | cuda | auto")
    g.add_argument("--dtype", default=d.dtype, choices=["float32", "float64"])
    g.add_argument("--p-miss-train", default=d.p_miss_train, help="per-block missing probability, or beta:A,B")
    g.add_argument("--p-miss-test", default=d.p_miss_test, help="per-block missing probability at test time")
    g.add_argument("--bottom", default=d.bottom, choices=["mlp", "cnn"], help="feature parties' bottom model")
    g.add_argument("--hidden", type=_ints, default=d.hidden, help="bottom-model hidden widths, e.g. 256,256")
    g.add_argument("--embedding-dim", type=int, default=d.embedding_dim)
    g.add_argument("--head-hidden", type=_ints, default=d.head_hidden, help="head hidden widths")
    g.add_argument("--image-split", default=d.image_split, choices=["auto", "strips", "quadrants", "columns"])
    g.add_argument("--val-fraction", type=float, default=d.val_fraction)
    g.add_argument("--nan-policy", default=d.nan_policy, choices=["mean", "drop", "error"])
    g.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    g.add_argument("--threads", type=int, default=d.threads,
                   help="torch intra-op threads (1 is fastest for small models on a shared machine)")
    for plugin in load_plugins():
        plugin.add_arguments(p.add_argument_group(plugin.name))


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    ns = vars(args)
    core = {k: ns[k] for k in _CORE_DESTS if k in ns}
    skip = _CORE_DESTS | {"func", "command", "config", "out", "resume", "no_progress", "list_algos"}
    options = {k: v for k, v in ns.items() if k not in skip and not k.startswith("_")}
    return TrainConfig(**core, options=options)


def apply_config_file(parser: argparse.ArgumentParser, path: Path) -> None:
    """Values in the TOML file become defaults; flags given on the command line win."""
    from secvfl.runner import load_config_file

    values = load_config_file(path)
    flat = dict(values.pop("options", {}))
    flat.update(values)
    known = {a.dest for a in parser._actions}
    unknown = sorted(k for k in flat if k.replace("-", "_") not in known)
    if unknown:
        raise ConfigError(f"{path}: unknown settings {unknown}; every key must be a `secvfl train` flag name")
    parser.set_defaults(**{k.replace("-", "_"): (tuple(v) if isinstance(v, list) else v) for k, v in flat.items()})


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a VFL model", description=__doc__)
    p.add_argument("--config", type=Path, help="TOML file; any flag can be set there (flags on the command line win)")
    p.add_argument("--out", type=Path, help="run directory for config, metrics, checkpoints and summary")
    p.add_argument("--resume", type=Path, help="continue the run in this directory from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="print a line per epoch instead of a progress bar")
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
    from secvfl.runner import run_training

    cfg = config_from_args(args)
    run_training(cfg, out=args.out, resume=args.resume, progress=not args.no_progress)
    return 0
