"""Bad input is refused with one clear line: TrainConfig ranges and TOML config types.

The references are independent of the validation code: the command line (a TOML value must give the flag the value
its command-line text gives), and the consumers of a setting (numpy and torch accept every seed the config accepts).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tomli_w
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.cli.main import main
from secvfl.cli.train import add_train_arguments, apply_config_file
from secvfl.config import MAX_SEED, TrainConfig
from secvfl.errors import ConfigError


# -- TrainConfig ---------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_seed_is_accepted_exactly_when_numpy_and_torch_take_it(seed: int) -> None:
    try:
        TrainConfig(seed=seed)
        accepted = True
    except ConfigError as exc:
        assert str(exc).startswith("--seed must be in [0, 4294967295]")
        accepted = False
    assert accepted == (0 <= seed < 2**32)
    if accepted:  # the seed's consumers in the runner take it (the legacy global numpy seed is the narrowest)
        _consume_seed(seed)


def _consume_seed(seed: int) -> None:
    np_state, torch_state = np.random.get_state(), torch.get_rng_state()
    try:
        np.random.seed(seed)
        np.random.default_rng([seed, 101])
        torch.manual_seed(seed * 100_003 + 10_000)
    finally:
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)


def test_the_largest_seed_runs_through_the_consumers() -> None:
    _consume_seed(MAX_SEED)
    with pytest.raises(ValueError):
        _consume_seed(MAX_SEED + 1)  # why the bound is 2^32 - 1


@settings(max_examples=80, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_lr_must_be_positive_and_finite_in_float32(lr: float) -> None:
    ok = 0 < lr <= float(np.finfo(np.float32).max)  # the parameters' type: a larger step overflows in torch
    if ok:
        assert TrainConfig(lr=lr).lr == lr
    else:
        with pytest.raises(ConfigError, match=r"--lr must be positive and finite"):
            TrainConfig(lr=lr)


@pytest.mark.parametrize("field, value, message", [
    ("eval_batch_size", 0, "--eval-batch-size must be at least 1"),
    ("hidden", (64, 0), "--hidden widths must be between 1 and 65536"),
    ("head_hidden", (-1,), "--head-hidden widths must be between 1 and 65536"),
    ("embedding_dim", 10**9, "--embedding-dim must be between 1 and 65536"),
    ("weight_decay", float("inf"), "--weight-decay must be non-negative and finite"),
    ("weight_decay", 1e308, "--weight-decay must be non-negative and finite"),  # was a RuntimeError in torch
    ("val_fraction", float("nan"), "--val-fraction must be in [0, 1)"),
    ("threads", 0, "--threads must be between 1 and 1024"),
    ("p_miss_test", "beta:2", "--p-miss-test: bad Beta spec"),
    ("p_miss_train", float("nan"), "--p-miss-train: p_miss must be in [0, 1)"),
    ("device", "cuda:x", "--device must be auto, cpu, cuda or cuda:N"),
    ("nan_policy", "zero", "--nan-policy must be one of mean, drop, error"),
    ("parties", [1, 2], "--parties must be an integer, got [1, 2] (list)"),
    ("epochs", True, "--epochs must be an integer, got True (bool)"),
    ("lr", "0.1", "--lr must be a number, got '0.1' (str)"),
    ("hidden", (64, 0.5), "--hidden must be a list of integers"),
])
def test_each_bad_field_gets_its_flag_and_fix(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig(**{field: value})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_problem_is_reported_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig(epochs=0, lr=float("inf"), seed=-1, hidden=(0,))
    parts = str(err.value).split("; ")
    assert [p.split(" ")[0] for p in parts] == ["--epochs", "--seed", "--lr", "--hidden"]


def test_empty_widths_are_a_linear_model_and_lists_become_tuples() -> None:
    cfg = TrainConfig(hidden=[], head_hidden=[8, 4])
    assert cfg.hidden == () and cfg.head_hidden == (8, 4)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


# -- TOML config files ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="secvfl train")
    p.add_argument("--out", type=Path)
    add_train_arguments(p)
    return p


def _from_toml(values: dict) -> argparse.Namespace:
    p = _parser()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.toml"
        path.write_text(tomli_w.dumps(values))
        apply_config_file(p, path)
    return p.parse_args([])


def _from_cli(args: list[str]) -> argparse.Namespace:
    return _parser().parse_args(args)


_VALUES = {  # flag dest -> (strategy of TOML values, command-line text of a value)
    "epochs": (st.integers(1, 10**6), str),
    "seed": (st.integers(0, 2**32 - 1), str),
    "secagg_frac_bits": (st.integers(0, 60), str),  # a plugin's flag
    "lr": (st.one_of(st.integers(1, 100), st.floats(1e-9, 10.0)), str),  # an integer is fine for a float flag
    "epsilon": (st.floats(0.01, 100.0), str),  # a plugin's flag
    "p_drop": (st.floats(0.0, 0.99), str),  # an algorithm family's flags
    "saddle_iters": (st.integers(1, 10**4), str),
    "hidden": (st.lists(st.integers(1, 512), max_size=4), lambda v: ",".join(map(str, v))),
    "p_miss_train": (st.one_of(st.floats(0.0, 0.99), st.just("beta:2,2")), str),
    "optimizer": (st.sampled_from(["adam", "sgd", "adamw"]), str),
    "dataset": (st.sampled_from(["wine", "csv:x.csv:label"]), str),
}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(_VALUES)).flatmap(lambda k: st.tuples(st.just(k), _VALUES[k][0])))
def test_a_toml_value_sets_what_its_command_line_text_sets(case: tuple[str, object]) -> None:
    dest, value = case
    flag = "--" + dest.replace("_", "-")
    expected = getattr(_from_cli([f"{flag}={_VALUES[dest][1](value)}"]), dest)
    assert getattr(_from_toml({dest: value}), dest) == expected


@pytest.mark.parametrize("value", [True, False])
def test_switches_take_toml_booleans(value: bool) -> None:
    assert _from_toml({"secure_channel": value}).secure_channel is value
    assert _from_toml({"dp_reproducible": value}).dp_reproducible is value


def _switches() -> list[str]:
    return [a.dest for a in _parser()._actions
            if isinstance(a, argparse._StoreConstAction) and isinstance(a.const, bool)]


@pytest.mark.parametrize("dest", _switches())
@pytest.mark.parametrize("value", ["false", "true", 0, 1, [True]])
def test_every_switch_refuses_anything_but_a_boolean(dest: str, value: object) -> None:
    # A non-empty string is truthy: `secure_channel = "false"` used to switch the channel on.
    with pytest.raises(ConfigError, match=rf"{dest} = .* but --{dest.replace('_', '-')} takes a boolean"):
        _from_toml({dest: value})


def _numeric_flags() -> list[str]:
    return [a.dest for a in _parser()._actions if a.type in (int, float)]


@pytest.mark.parametrize("dest", _numeric_flags())
@pytest.mark.parametrize("value", [True, "3", [3], {"a": 3}])
def test_every_number_flag_refuses_other_toml_types(dest: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"{dest} = .* is an? (boolean|string|array|table), but --"):
        _from_toml({dest: value})


def test_int_flags_refuse_floats_and_float_flags_take_ints() -> None:
    with pytest.raises(ConfigError, match="seed = 2.0 is a float, but --seed takes an integer"):
        _from_toml({"seed": 2.0})
    assert _from_toml({"lr": 1}).lr == 1.0


def _choice_flags() -> list[str]:
    return [a.dest for a in _parser()._actions if a.choices is not None and a.option_strings]


@pytest.mark.parametrize("dest", _choice_flags())
def test_every_choice_flag_refuses_a_value_outside_its_choices(dest: str) -> None:
    with pytest.raises(ConfigError, match=rf'{dest} = "nope" is a string, but --.* takes one of'):
        _from_toml({dest: "nope"})


def test_all_problems_of_a_file_in_one_line_and_saved_runs_read_back(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _from_toml({"parties": [1, 2], "secure_channel": "false", "options": {"he": 1}})
    assert str(err.value).count(" but --") == 3 and "\n" not in str(err.value)
    # A run's own config.toml (plugin flags in [options]) is a valid config file.
    assert main(["train", "--dataset", "wine", "--parties", "2", "--epochs", "1", "--hidden", "8,4",
                 "--no-progress", "--device", "cpu", "--out", str(tmp_path / "r")]) == 0
    ns = _parser()
    apply_config_file(ns, tmp_path / "r" / "config.toml")
    args = ns.parse_args([])
    assert (args.dataset, args.parties, args.hidden, args.secure_channel) == ("wine", 2, (8, 4), False)


# -- the CLI's one-line warnings -----------------------------------------------------------------------------------
def test_a_dropped_column_is_one_warning_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = ["a,empty,b,y"] + [f"{i},,{(i * 7) % 11},{i % 2}" for i in range(60)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    assert main(["train", "--dataset", f"csv:{tmp_path / 't.csv'}", "--parties", "2", "--epochs", "1",
                 "--no-progress", "--device", "cpu", "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line.lower()]
    assert warnings == ["secvfl: warning: t.csv: column(s) 'empty' have no value in the training split; dropped them "
                        "(a column without values carries no information)"]


def test_an_option_without_a_flag_is_read_from_toml_typed() -> None:
    # vim_z_tol is declared cli=False (library use and config.toml only): a file may set it, with its declared type.
    from secvfl.algorithms.vim.options import VIMOptions
    from secvfl.cli.train import config_from_args

    cfg = config_from_args(_from_toml({"algo": "vimadmm", "vim_z_tol": 1e-8}))
    assert cfg.options_for(VIMOptions).vim_z_tol == pytest.approx(1e-8)
    with pytest.raises(ConfigError, match="z-tol must be a number"):
        config_from_args(_from_toml({"algo": "vimadmm", "vim_z_tol": "small"}))
