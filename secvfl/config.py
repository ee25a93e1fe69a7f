"""The resolved configuration of a training run (every flag, from the CLI or a TOML file)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from secvfl.errors import ConfigError

__all__ = ["TrainConfig"]


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
    # Options of protocol layers and algorithm extensions, by flag name (e.g. {"privacy": "dp", "epsilon": 3.0}).
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if self.parties < 1:
            problems.append(f"--parties must be at least 1, got {self.parties}")
        if self.epochs < 1:
            problems.append(f"--epochs must be at least 1, got {self.epochs}")
        if self.batch_size < 1:
            problems.append(f"--batch-size must be at least 1, got {self.batch_size}")
        if not self.lr > 0:
            problems.append(f"--lr must be positive, got {self.lr}")
        if self.weight_decay < 0:
            problems.append(f"--weight-decay must be non-negative, got {self.weight_decay}")
        if self.embedding_dim < 1:
            problems.append(f"--embedding-dim must be at least 1, got {self.embedding_dim}")
        if self.threads < 1:
            problems.append(f"--threads must be at least 1, got {self.threads}")
        if self.dtype not in ("float32", "float64"):
            problems.append(f"--dtype must be float32 or float64, got {self.dtype}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            problems.append(f"--device must be auto, cpu or cuda[:N], got {self.device}")
        if problems:
            raise ConfigError("; ".join(problems))

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hidden"], d["head_hidden"] = list(self.hidden), list(self.head_hidden)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        core = {k: v for k, v in d.items() if k in names and k != "options"}
        options = dict(d.get("options", {}))
        options.update({k: v for k, v in d.items() if k not in names})
        for k in ("hidden", "head_hidden"):
            if k in core:
                core[k] = tuple(int(v) for v in core[k])
        return cls(**core, options=options)
