"""Protocol plugins are found through entry points (group ``secvfl.protocols``), in a fixed order, and a run that
switches on an option no loaded plugin takes is refused instead of training without that protocol."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import pytest

import secvfl.plugins as plugins
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError, UnsupportedError
from secvfl.registry import Registry

INSTALLED = ["channel", "compress", "dp", "he", "secagg"]  # algorithm families' options are no plugins
CLASSES = ["ChannelPlugin", "CompressionPlugin", "DPPlugin", "CKKSTrainPlugin", "SecAggPlugin"]


@pytest.fixture
def fresh_plugins(monkeypatch: pytest.MonkeyPatch):
    """secvfl.plugins with an empty registry, loading what ``set_entry_points`` provides."""
    monkeypatch.setattr(plugins, "PROTOCOLS", Registry("protocol"))
    monkeypatch.setattr(plugins, "_unavailable", {})
    monkeypatch.setattr(plugins, "_loaded", False)

    def set_entry_points(eps: list[EntryPoint]) -> None:
        monkeypatch.setattr(plugins, "_entry_points", lambda: eps)

    return set_entry_points


def _installed_except(*names: str) -> list[EntryPoint]:
    return [ep for ep in entry_points(group=plugins.ENTRY_POINT_GROUP) if ep.name not in names]


def test_installed_plugins_load_in_name_order() -> None:
    loaded = plugins.load_plugins()
    assert plugins.PROTOCOLS.names() == INSTALLED
    assert [type(p).__name__ for p in loaded] == CLASSES
    assert plugins.load_plugins() == loaded  # loaded once: the same objects every time


def test_order_does_not_depend_on_the_order_entry_points_are_listed(fresh_plugins) -> None:
    fresh_plugins(list(reversed(_installed_except())))
    assert [type(p).__name__ for p in plugins.load_plugins()] == CLASSES
    assert plugins.PROTOCOLS.names() == INSTALLED


def test_an_option_of_a_plugin_that_is_not_installed_is_refused(fresh_plugins) -> None:
    fresh_plugins(_installed_except("he"))
    with pytest.raises(ConfigError, match=r"--he 'ckks': no installed protocol plugin takes this option") as err:
        TrainConfig(options={"he": "ckks", "ckks_workers": 1})
    assert "plugins: channel, compress, dp, secagg" in str(err.value)
    # a run saved while the plugin was installed, which did not use it, still runs without it
    saved = TrainConfig(options={"he": "none", "ckks_params": "default", "ckks_workers": 0})
    assert saved.options["he"] == "none"  # kept as given, for the run's config.toml
    # what the loaded plugins and algorithm families take is never refused
    plugins.check_options(TrainConfig(options={"privacy": "dp", "epsilon": 3.0, "compress_ratio": 0.1,
                                               "saddle_iters": 3}, algo="eg").options)


def test_a_plugin_that_cannot_be_imported_is_named_with_the_reason(fresh_plugins) -> None:
    broken = EntryPoint("quantum", "secvfl_no_such_module:QuantumPlugin", plugins.ENTRY_POINT_GROUP)
    fresh_plugins([*_installed_except(), broken])
    assert [type(p).__name__ for p in plugins.load_plugins()] == CLASSES  # the others load
    assert "No module named 'secvfl_no_such_module'" in plugins.unavailable_plugins()["quantum"]
    with pytest.raises(UnsupportedError, match=r"--quantum-link True: .*plugin 'quantum' could not be loaded "
                                                r"\(secvfl_no_such_module:QuantumPlugin: No module named"):
        TrainConfig(options={"quantum_link": True})


def test_train_help_says_which_plugins_could_not_be_loaded(fresh_plugins) -> None:
    import argparse

    from secvfl.cli.train import add_train_arguments

    fresh_plugins([*_installed_except("he"),
                   EntryPoint("he", "secvfl_no_such_module:CKKS", plugins.ENTRY_POINT_GROUP)])
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert "--he " not in parser.format_help() and "--ckks-params" not in parser.format_help()
    assert "protocol plugins that could not be loaded: he (secvfl_no_such_module:CKKS: No module named" in parser.epilog


def test_an_entry_point_that_is_no_plugin_is_a_packaging_error(fresh_plugins) -> None:
    fresh_plugins([EntryPoint("oops", "secvfl.config:TrainConfig", plugins.ENTRY_POINT_GROUP)])
    with pytest.raises(TypeError, match="oops = 'secvfl.config:TrainConfig' .* is not a ProtocolPlugin"):
        plugins.load_plugins()


def test_no_plugin_default_switches_a_protocol_on() -> None:
    # What makes a saved run resumable where a plugin it did not use is missing: its defaults ask for nothing.
    for name, defaults in plugins.option_defaults().items():
        on = {k: v for k, v in defaults.items() if plugins._switches_on(v)}
        assert not on, f"plugin {name}: defaults {on} would count as switched on"
