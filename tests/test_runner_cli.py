import json
import subprocess
import sys

import pytest

from secvfl.cli.main import main
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.runner import run_training


def _cfg(**kw):
    base = dict(dataset="breast_cancer", parties=3, epochs=4, batch_size=32, embedding_dim=8)
    base.update(kw)
    return TrainConfig(**base)


def test_run_directory_contents_and_summary(tmp_path):
    s = run_training(_cfg(), out=tmp_path / "r", progress=False, log=lambda *_: None)
    d = tmp_path / "r"
    assert {p.name for p in d.iterdir()} >= {"config.toml", "metrics.jsonl", "summary.json", "checkpoints"}
    saved = json.loads((d / "summary.json").read_text())
    assert saved["algo"] == "splitnn" and saved["parties"] == 3 and saved["seed"] == 0
    assert set(saved["metrics"]["test"]) >= {"accuracy", "f1", "auc"}
    assert saved["metrics"]["test"]["auc"] > 0.9
    assert saved["comm"]["bytes_total"] == sum(v["sent"] for v in saved["comm"]["bytes_by_party"].values())
    assert "wall_seconds" in saved and s["comm"] == saved["comm"]
    lines = (d / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3, 4]


@pytest.mark.parametrize("algo", ["splitnn", "vafl", "local"])
def test_resume_after_interruption_matches_uninterrupted(tmp_path, algo):
    full = run_training(_cfg(algo=algo), out=tmp_path / "full", progress=False, log=lambda *_: None)

    class Stop(Exception):
        pass

    calls = {"n": 0}
    from secvfl.algorithms import get_algorithm

    cls = get_algorithm(algo)
    orig = cls.train_epoch

    def crash(self, epoch, progress=None):
        calls["n"] += 1
        if calls["n"] == 3:  # killed in the middle of the third epoch
            raise Stop
        return orig(self, epoch, progress)

    cls.train_epoch = crash
    try:
        with pytest.raises(Stop):
            run_training(_cfg(algo=algo), out=tmp_path / "cut", progress=False, log=lambda *_: None)
    finally:
        cls.train_epoch = orig
    assert json.loads((tmp_path / "cut/checkpoints/latest.json").read_text())["epoch"] == 2
    resumed = run_training(_cfg(), resume=tmp_path / "cut", progress=False, log=lambda *_: None)
    assert resumed["metrics"]["test"] == full["metrics"]["test"]
    assert resumed["comm"]["bytes_total"] == full["comm"]["bytes_total"]
    hist = [json.loads(x) for x in (tmp_path / "cut/metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2, 3, 4]


def test_out_dir_with_a_run_is_not_overwritten(tmp_path):
    run_training(_cfg(epochs=1), out=tmp_path / "r", progress=False, log=lambda *_: None)
    with pytest.raises(ConfigError, match="--resume"):
        run_training(_cfg(epochs=1), out=tmp_path / "r", progress=False, log=lambda *_: None)


def test_same_seed_same_result():
    a = run_training(_cfg(epochs=2), progress=False, log=lambda *_: None)
    b = run_training(_cfg(epochs=2), progress=False, log=lambda *_: None)
    assert a["metrics"]["test"] == b["metrics"]["test"]


def test_config_file_and_flags(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "wine"\nparties = 2\nepochs = 1\nhidden = [8]\n')
    assert main(["train", "--config", str(cfg), "--epochs", "2", "--no-progress", "--out", str(tmp_path / "r")]) == 0
    saved = (tmp_path / "r" / "config.toml").read_text()
    assert 'dataset = "wine"' in saved and "epochs = 2" in saved and "hidden = [\n    8," in saved


@pytest.mark.parametrize("argv, message", [
    (["train", "--parties", "50", "--dataset", "wine"], "cannot split 13 feature columns among 50 parties"),
    (["train", "--algo", "nope"], "unknown algorithm 'nope'; valid names:"),
    (["train", "--p-miss-train", "1.2"], "p_miss must be in [0, 1)"),
    (["train", "--dataset", "csv:/nonexistent.csv"], "does not exist"),
    (["train", "--lr", "-1"], "--lr must be positive"),
])
def test_user_mistakes_give_one_clear_line(argv, message, capsys):
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "secvfl.cli.main", "train", "--dataset", "wine", "--epochs", "1",
                          "--parties", "2", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "test: accuracy" in out.stdout
