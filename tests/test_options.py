"""Typed options: each algorithm family and protocol plugin declares its options once (secvfl.options), and the
flags, the TOML checks and the validation of ``TrainConfig(options=...)`` all come from that declaration.

References: the command line (a flag's parsed value must be what the typed conversion of the same value gives), the
Python types of the annotations (a value of another JSON kind must be refused), and the run directory (a run's
config.toml must read back into the same configuration).
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path

import pytest
import tomli_w

from secvfl.cli.main import main
from secvfl.cli.train import add_train_arguments
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.options import OptionField, build_options, option_fields
from secvfl.plugins import option_groups
from secvfl.runner import read_run_config


def _fields() -> list[tuple[str, OptionField, type]]:
    """(an algorithm the option applies to, the field, its options type) for every declared option."""
    out = []
    for g in option_groups():
        for f in option_fields(g.options_type):
            algo = (f.spec.algos or g.algorithms or ("splitnn",))[0]
            out.append((algo, f, g.options_type))
    return out


FIELDS = _fields()
IDS = [f.name for _, f, _ in FIELDS]


def _inner(annotation: object) -> object:
    """The annotation without ``| None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _kind(annotation: object) -> object:
    """bool, int, float, str, or "choice" for a Literal."""
    inner = _inner(annotation)
    return "choice" if typing.get_origin(inner) is typing.Literal else inner


def _valid(annotation: object) -> object:
    inner = _inner(annotation)
    return typing.get_args(inner)[-1] if typing.get_origin(inner) is typing.Literal else _VALID[inner]


_WRONG = {bool: ["false", 1, 0.0], int: [True, 1.5, "3"], float: [True, "0.1", [0.5]], str: [3, False, ["a"]],
          "choice": ["nope", 1, True]}
_VALID = {bool: True, int: 3, float: 0.5, str: "party0"}


def test_every_option_is_declared_once_with_a_kind_the_tests_know() -> None:
    names = [f.name for _, f, _ in FIELDS]
    assert len(names) == len(set(names)) and len(names) >= 30
    assert {_kind(f.type) for _, f, _ in FIELDS} <= set(_WRONG)
    # the algorithm families' options are theirs, not protocols'
    families = {g.options_type.__name__: g.algorithms for g in option_groups() if g.algorithms is not None}
    assert set(families) == {"MissingOptions", "SaddleOptions", "OnlineOptions", "VIMOptions"}
    assert "plugvfl" in families["MissingOptions"] and "eg-mlp" in families["SaddleOptions"]


@pytest.mark.parametrize("algo, field, kind", FIELDS, ids=IDS)
def test_every_option_refuses_a_value_of_another_type(algo: str, field: OptionField, kind: type) -> None:
    for value in _WRONG[_kind(field.type)]:
        with pytest.raises(ConfigError) as err:
            TrainConfig(algo=algo, options={field.name: value})
        message = str(err.value)
        assert f"{field.flag} must be" in message and f"({type(value).__name__})" in message and "\n" not in message


@pytest.mark.parametrize("algo, field, kind", [x for x in FIELDS if x[1].spec.cli],
                         ids=[f.name for _, f, _ in FIELDS if f.spec.cli])
def test_a_flag_parses_to_what_the_typed_conversion_gives(algo: str, field: OptionField, kind: type) -> None:
    k, value = _kind(field.type), _valid(field.type)
    if field.spec.check is not None and not field.spec.check[0](value):  # out of this option's range: its default
        value = field.default
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    argv = [field.flag] if k is bool else [field.flag, str(value)]
    parsed = vars(parser.parse_args(argv))
    from_cli, _ = build_options(kind, {n: parsed[n] for n in parsed if n == field.name})
    typed, _ = build_options(kind, {field.name: value})
    assert from_cli is not None and from_cli == typed
    assert parser.parse_args([]).__dict__[field.name] == field.default  # the flag's default is the field's


@pytest.mark.parametrize("algo, options, message", [
    ("splitnn", {"p_drop": 0.3}, "--p-drop applies to --algo plugvfl only, not splitnn"),
    ("laser", {"p_drop": 0.3}, "--p-drop applies to --algo plugvfl only, not laser"),
    ("splitnn", {"class_balanced": True}, "--class-balanced applies to --algo combinatorial/ensemble/laser/"),
    ("eg", {"admm_rho": 2.0}, "--admm-rho applies to --algo admm only, not eg"),
    ("gd", {"saddle_step": "theory"}, "--saddle-step applies to --algo eg only, not gd"),
    ("eg-mlp", {"saddle_iters": 5}, "--saddle-iters applies to --algo eg/gd/nesterov/admm only, not eg-mlp"),
    ("vafl", {"saddle_loss": "squared"}, "--saddle-loss applies to --algo admm/eg/eg-mlp/gd/nesterov only, not vafl"),
    ("plugvfl", {"p_drop": 1.0}, "--p-drop must be in [0, 1), got 1.0"),
    ("eg", {"saddle_participation": 0}, "--saddle-participation must be in (0, 1], got 0.0"),
    ("eg", {"saddle_mu": float("inf")}, "--saddle-mu must be a finite number >= 0, got inf"),
    ("vafl", {"ckks_workers": -1}, "--ckks-workers must be a non-negative integer, got -1"),
    ("splitnn", {"epsilon": 3.0}, "--epsilon only take effect with --privacy dp"),
    ("splitnn", {"privacy": "dp", "dp_accept_epsilon": float("inf")}, "--dp-accept-epsilon must be a finite number > 0"),
])
def test_an_option_outside_its_algorithms_or_range_is_refused(algo: str, options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig(algo=algo, options=options)
    assert message in str(err.value)


def test_every_problem_of_core_and_options_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig(algo="eg", epochs=0, options={"saddle_iters": 0, "admm_rho": 1.0, "secure_channel": "no"})
    parts = str(err.value).split("; ")
    assert [p.split(" ")[0] for p in parts] == ["--epochs", "--saddle-iters", "--admm-rho", "--secure-channel"]


def test_options_are_typed_and_read_back_from_a_saved_configuration() -> None:
    from secvfl.algorithms.saddle.flags import SaddleOptions

    cfg = TrainConfig(algo="eg", options={"saddle_iters": 7, "saddle_mu": 1, "compress": "topk:0.1"})
    assert cfg.options_for(SaddleOptions).saddle_iters == 7
    assert isinstance(cfg.options_for(SaddleOptions).saddle_mu, float)  # an integer is fine for a number
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig.from_dict(tomli_w_round_trip(cfg.to_dict())) == cfg


def tomli_w_round_trip(d: dict) -> dict:
    import tomllib

    def drop_none(x: dict) -> dict:  # as the runner writes config.toml: TOML has no null
        return {k: drop_none(v) if isinstance(v, dict) else v for k, v in x.items() if v is not None}

    return tomllib.loads(tomli_w.dumps(drop_none(d)))


def test_a_saved_option_of_the_wrong_type_is_refused_not_read_as_true() -> None:
    # "false" is a non-empty string: read as a flag value, it would switch the channel on
    with pytest.raises(ConfigError, match=r"--secure-channel must be a boolean, got 'false' \(str\)"):
        TrainConfig.from_dict({"dataset": "wine", "options": {"secure_channel": "false"}})


def test_a_resume_compares_typed_option_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    base = ["train", "--algo", "plugvfl", "--dataset", "wine", "--parties", "2", "--hidden", "8", "--no-progress",
            "--device", "cpu"]
    assert main([*base, "--epochs", "1", "--p-drop", "0.3", "--class-balanced", "--out", str(run)]) == 0
    saved = read_run_config(run)
    assert saved.options["p_drop"] == pytest.approx(0.3) and saved.options["class_balanced"] is True
    # the same value written differently is no change
    assert main(["train", "--resume", str(run), "--epochs", "2", "--p-drop", "0.30", "--no-progress"]) == 0
    assert main(["train", "--resume", str(run), "--epochs", "3", "--p-drop", "0.2", "--no-progress"]) == 2
    assert "changes --p-drop 0.2 (the run has 0.3)" in capsys.readouterr().err
    (run / "config.toml").write_text((run / "config.toml").read_text().replace("p_drop = 0.3", 'p_drop = "0.3"'))
    assert main(["train", "--resume", str(run), "--epochs", "3", "--no-progress"]) == 2
    assert "--p-drop must be a number, got '0.3' (str)" in capsys.readouterr().err
