"""The resolved configuration of a training run (every flag, from the CLI or a TOML file).

The core settings are fields of :class:`TrainConfig`; the options of the algorithm families and protocol plugins
come by flag name (``options``) and are resolved on construction into one typed, validated instance per options type
(:mod:`secvfl.options`), read with :meth:`TrainConfig.options_for`.
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from secvfl.data.masks import parse_p_miss
from secvfl.data.partition import IMAGE_SPLITS
from secvfl.data.preprocess import NAN_POLICIES
from secvfl.errors import ConfigError, DataError
from secvfl.options import Options

__all__ = ["TrainConfig", "DTYPES", "BOTTOMS", "MAX_SEED", "MAX_WIDTH", "MAX_THREADS"]

O = TypeVar("O", bound=Options)  # noqa: E741 - the conventional name of a type variable


@dataclass(frozen=True)
class TrainConfig:
    algo: str = "splitnn"
    dataset: str = "digits"
    data_dir: str | None = None
    parties: int = 4
    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    optimizer: str = "adam"
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"
    p_miss_train: str = "0"
    p_miss_test: str = "0"
    bottom: str = "mlp"
    hidden: tuple[int, ...] = (64,)
    embedding_dim: int = 16
    head_hidden: tuple[int, ...] = (32,)
    image_split: str = "auto"
    val_fraction: float = 0.1
    nan_policy: str = "mean"
    eval_batch_size: int = 4096
    threads: int = 1
    # Options of the algorithm families and protocol plugins by flag name (e.g. {"privacy": "dp", "epsilon": 3.0}),
    # as the command line and config.toml hold them. On construction every known option is filled in, typed.
    options: Mapping[str, Any] = field(default_factory=dict)
    # The options, one validated instance per options type (see options_for).
    _typed: dict[type[Options], Options] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        # Every problem in one line, so a user fixes them all at once; ranges only once the types are right.
        problems = _type_problems(self)
        if not problems:
            for name in _WIDTH_FIELDS:  # lists from TOML/JSON become the tuples the dataclass promises
                object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
            problems = _range_problems(self)
        if isinstance(self.options, Mapping) and isinstance(self.algo, str):
            from secvfl.plugins import check_options, resolve_options

            typed, flat, found = resolve_options(self.algo, self.options)
            problems += found
            object.__setattr__(self, "_typed", typed)
            object.__setattr__(self, "options", flat)
        if not problems:
            problems = _unused_setting_problems(self)
        if problems:
            raise ConfigError("; ".join(problems))
        check_options(self.options)

    def options_for(self, kind: type[O]) -> O:
        """The run's options of type ``kind`` (an algorithm family's or a protocol plugin's), validated."""
        try:
            return self._typed[kind]  # type: ignore[return-value]
        except KeyError:
            raise ConfigError(f"{kind.__name__} are not options of this build: no loaded algorithm family or protocol "
                              "plugin declares them") from None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        d["hidden"], d["head_hidden"] = list(self.hidden), list(self.head_hidden)
        d["options"] = dict(self.options)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        core = {k: v for k, v in d.items() if k in names and k != "options"}
        if not isinstance(d.get("options", {}), Mapping):
            raise ConfigError(f"'options' must be a table of flag values, got {d['options']!r}")
        options = dict(d.get("options", {}))
        options.update({k: v for k, v in d.items() if k not in names})
        return cls(**core, options=options)  # __post_init__ checks the types and turns width lists into tuples


# -- validation -------------------------------------------------------------------------------------------------
MAX_SEED = 2**32 - 1  # numpy's global seeding takes 32 bits; torch and default_rng take more
MAX_WIDTH = 65_536  # a wider layer than this is a typo that would end in an out-of-memory crash, not a model
MAX_THREADS = 1024  # far more intra-op threads than that exhausts the process's memory mapping
MAX_FLOAT32 = 3.4028234663852886e38  # optimizer settings are applied to float32 parameters: larger is an overflow
DTYPES = ("float32", "float64")
BOTTOMS = ("mlp", "cnn", "resnet")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_STR_FIELDS = ("algo", "dataset", "optimizer", "device", "dtype", "bottom", "image_split", "nan_policy")
_INT_FIELDS = ("parties", "epochs", "batch_size", "seed", "embedding_dim", "eval_batch_size", "threads")
_FLOAT_FIELDS = ("lr", "weight_decay", "val_fraction")
_WIDTH_FIELDS = ("hidden", "head_hidden")
_P_MISS_FIELDS = ("p_miss_train", "p_miss_test")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _type_problems(cfg: TrainConfig) -> list[str]:
    def bad(name: str, expected: str) -> str:
        v = getattr(cfg, name)
        return f"{_flag(name)} must be {expected}, got {v!r} ({type(v).__name__})"

    problems = [bad(n, "a string") for n in _STR_FIELDS if not isinstance(getattr(cfg, n), str)]
    problems += [bad(n, "an integer") for n in _INT_FIELDS if not _is_int(getattr(cfg, n))]
    problems += [bad(n, "a number") for n in _FLOAT_FIELDS if not _is_real(getattr(cfg, n))]
    problems += [bad(n, "a list of integers like [64, 32]") for n in _WIDTH_FIELDS
                 if not (isinstance(getattr(cfg, n), (list, tuple)) and all(_is_int(v) for v in getattr(cfg, n)))]
    problems += [bad(n, "a number in [0, 1) or 'beta:A,B'") for n in _P_MISS_FIELDS
                 if not (isinstance(getattr(cfg, n), str) or _is_real(getattr(cfg, n)))]
    if cfg.data_dir is not None and not isinstance(cfg.data_dir, (str, os.PathLike)):
        problems.append(bad("data_dir", "a folder path"))
    if not isinstance(cfg.options, Mapping):
        problems.append(f"options must be a dictionary of flag values, got {type(cfg.options).__name__}")
    return problems


def _unused_setting_problems(cfg: TrainConfig) -> list[str]:
    """Core settings given (other than their default) that the algorithm does not read (Algorithm.unused_settings)."""
    from secvfl.algorithms import algorithm_names, get_algorithm

    if cfg.algo not in algorithm_names():  # an unknown algorithm is refused when the run is built, with the names
        return []
    return [f"{_flag(name)} does not apply to --algo {cfg.algo} (drop it): {why}"
            for name, why in get_algorithm(cfg.algo).unused_settings.items()
            if getattr(cfg, name) != getattr(TrainConfig, name)]


def _range_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    for name in ("parties", "epochs", "batch_size", "eval_batch_size"):
        if getattr(cfg, name) < 1:
            problems.append(f"{_flag(name)} must be at least 1, got {getattr(cfg, name)}")
    if not 0 <= cfg.seed <= MAX_SEED:
        problems.append(f"--seed must be in [0, {MAX_SEED}], got {cfg.seed}")
    if not 0 < cfg.lr <= MAX_FLOAT32:  # also refuses nan and inf
        problems.append(f"--lr must be positive and finite (e.g. --lr 0.001), got {cfg.lr}")
    if not 0 <= cfg.weight_decay <= MAX_FLOAT32:
        problems.append(f"--weight-decay must be non-negative and finite (0 turns it off), got {cfg.weight_decay}")
    if not 0 <= cfg.val_fraction < 1:  # also refuses nan
        problems.append(f"--val-fraction must be in [0, 1) (0: no validation split), got {cfg.val_fraction}")
    if not 1 <= cfg.embedding_dim <= MAX_WIDTH:
        problems.append(f"--embedding-dim must be between 1 and {MAX_WIDTH}, got {cfg.embedding_dim}")
    for name in _WIDTH_FIELDS:
        widths = getattr(cfg, name)
        if any(not 1 <= w <= MAX_WIDTH for w in widths):
            problems.append(
                f"{_flag(name)} widths must be between 1 and {MAX_WIDTH}, got {','.join(map(str, widths))} (a "
                f"zero-width layer cuts the model off from its input): e.g. {_flag(name)} 64,32, or "
                f"{_flag(name)} '' for no hidden layer"
            )
    if not 1 <= cfg.threads <= MAX_THREADS:
        problems.append(f"--threads must be between 1 and {MAX_THREADS}, got {cfg.threads}")
    for name in _P_MISS_FIELDS:
        try:
            parse_p_miss(getattr(cfg, name))
        except DataError as exc:
            problems.append(f"{_flag(name)}: {exc}")
    choices = {"dtype": DTYPES, "bottom": BOTTOMS, "image_split": IMAGE_SPLITS, "nan_policy": NAN_POLICIES}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            problems.append(f"{_flag(name)} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    if not _DEVICE.fullmatch(cfg.device):
        problems.append(f"--device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")
    for name in ("algo", "dataset"):
        if not getattr(cfg, name).strip():
            problems.append(f"{_flag(name)} must not be empty")
    return problems
