import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.checkpoint import load_checkpoint
from secvfl.cli.main import main
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.rundir import dataset_label, default_run_dir
from secvfl.runner import build_run, run_training


def _cfg(**kw):
    base = dict(dataset="breast_cancer", parties=3, epochs=4, batch_size=32, embedding_dim=8, device="cpu")
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
    cfg.write_text('dataset = "wine"\nparties = 2\nepochs = 1\nhidden = [8]\ndevice = "cpu"\n')
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


@pytest.mark.auto_device  # the README's main job, on whatever device --device auto picks
def test_console_script_runs_and_saves_into_a_fresh_run_directory(tmp_path):
    # without --out, the main job saves into runs/<algo>-<dataset>-<date>-<time> and says where
    out = subprocess.run([sys.executable, "-m", "secvfl.cli.main", "train", "--dataset", "wine", "--epochs", "1",
                          "--parties", "2", "--no-progress"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "SECVFL_RUNS_DIR"})
    assert out.returncode == 0, out.stderr
    assert "test: accuracy" in out.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"splitnn-wine-\d{8}-\d{6}", run_dir.name)
    assert f"results in {Path('runs') / run_dir.name}" in out.stdout
    assert {"config.toml", "summary.json", "metrics.jsonl", "curves.png", "checkpoints"} <= {
        p.name for p in run_dir.iterdir()}


# -- run directories, resume, training guards (issue 13) ----------------------------------------------------------
SMALL = ["--dataset", "wine", "--parties", "2", "--hidden", "8", "--head-hidden", "8", "--embedding-dim", "4",
         "--batch-size", "32", "--seed", "1", "--device", "cpu"]


def _train(*argv: str | Path) -> int:
    return main(["train", *SMALL, *map(str, argv)] if "--resume" not in argv else ["train", *map(str, argv)])


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _epochs_of(run_dir: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_more_epochs_extends_a_finished_run_like_a_longer_run(tmp_path, capsys):
    assert _train("--epochs", "2", "--out", tmp_path / "short", "--no-progress") == 0
    assert _train("--epochs", "4", "--out", tmp_path / "long", "--no-progress") == 0
    assert _train("--resume", tmp_path / "short", "--epochs", "4", "--no-progress") == 0
    extended, long = _summary(tmp_path / "short"), _summary(tmp_path / "long")
    assert extended["epochs"] == 4 and _epochs_of(tmp_path / "short") == [1, 2, 3, 4]
    assert "epochs = 4" in (tmp_path / "short/config.toml").read_text()
    # each epoch's randomness depends on (seed, epoch) only, so 2 + 2 epochs are the same computation as 4
    assert extended["metrics"]["test"] == long["metrics"]["test"]
    assert extended["comm"] == long["comm"]


def test_resume_refuses_every_changed_setting_in_one_line(tmp_path, capsys):
    assert _train("--epochs", "1", "--out", tmp_path / "r", "--no-progress") == 0
    capsys.readouterr()
    assert _train("--resume", tmp_path / "r", "--dataset", "digits", "--lr", "0.5", "--epochs", "3") == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert "--dataset 'digits' (the run has 'wine')" in line and "--lr 0.5 (the run has 0.001)" in line
    assert "--epochs" not in line.split("changes")[1].split(";")[0]  # a longer run is allowed, not listed
    assert _epochs_of(tmp_path / "r") == [1]  # nothing was trained
    # flags repeating the run's own values, and run-local ones, are no change
    assert _train("--resume", tmp_path / "r", "--dataset", "wine", "--threads", "1", "--epochs", "2",
                  "--no-progress") == 0
    assert _epochs_of(tmp_path / "r") == [1, 2]


def _damage_party_file(ck: Path) -> Path:
    path = ck / "epoch-0002" / "party-party0.pt"
    path.write_bytes(os.urandom(100))
    return path


def _truncate_network_file(ck: Path) -> Path:
    path = ck / "epoch-0002" / "network.pt"
    path.write_bytes(path.read_bytes()[:200])
    return path


def _garble_latest(ck: Path) -> Path:
    (ck / "latest.json").write_text("{not json")
    return ck / "latest.json"


@pytest.mark.parametrize("damage", [_damage_party_file, _truncate_network_file, _garble_latest])
def test_damaged_checkpoint_names_the_file_and_the_intact_one_to_resume_from(tmp_path, capsys, damage):
    run_dir = tmp_path / "r"
    assert _train("--epochs", "3", "--out", tmp_path / "full", "--no-progress") == 0
    assert _train("--epochs", "2", "--out", run_dir, "--no-progress") == 0  # to be trained longer below
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("epoch-*")) == ["epoch-0001", "epoch-0002"]
    damaged = damage(run_dir / "checkpoints")
    capsys.readouterr()
    assert _train("--resume", run_dir, "--epochs", "3", "--no-progress") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert str(damaged) in line and "damaged" in line
    good = 1 if damage is not _garble_latest else 2
    assert f"--resume {run_dir} --from-epoch {good}" in line
    assert _train("--resume", run_dir, "--epochs", "3", "--from-epoch", str(good), "--no-progress") == 0
    assert _summary(run_dir)["metrics"]["test"] == _summary(tmp_path / "full")["metrics"]["test"]
    assert _summary(run_dir)["comm"] == _summary(tmp_path / "full")["comm"]
    assert _epochs_of(run_dir) == [1, 2, 3]


def test_the_previous_checkpoint_is_kept_and_a_crash_before_the_commit_leaves_it_in_force(tmp_path, monkeypatch):
    import secvfl.checkpoint as checkpoint

    run_training(_cfg(epochs=2), out=tmp_path / "r", progress=False, log=lambda *_: None)
    ck = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in ck.glob("epoch-*")) == ["epoch-0001", "epoch-0002"]

    real = checkpoint.write_json_atomic

    def crash_at_commit(path, obj):
        if Path(path).name == "latest.json" and obj["epoch"] == 3:
            raise KeyboardInterrupt  # the process dies between writing epoch 3's files and committing them
        return real(path, obj)

    monkeypatch.setattr(checkpoint, "write_json_atomic", crash_at_commit)
    with pytest.raises(KeyboardInterrupt):
        run_training(_cfg(epochs=4), resume=tmp_path / "r", changes={"epochs": 4}, progress=False,
                     log=lambda *_: None)
    monkeypatch.undo()
    assert json.loads((ck / "latest.json").read_text()) == {"epoch": 2, "dir": "epoch-0002"}
    resumed = run_training(_cfg(), resume=tmp_path / "r", changes={"epochs": 4}, progress=False, log=lambda *_: None)
    full = run_training(_cfg(epochs=4), progress=False, log=lambda *_: None)
    assert resumed["metrics"]["test"] == full["metrics"]["test"] and resumed["comm"] == full["comm"]
    assert sorted(p.name for p in ck.glob("epoch-*")) == ["epoch-0003", "epoch-0004"]
    assert not list(ck.glob(".*"))  # no staging directory or temporary file left behind


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory):
    cfg = TrainConfig(dataset="wine", parties=2, epochs=2, hidden=(8,), head_hidden=(8,), embedding_dim=4,
                      device="cpu")
    run_dir = tmp_path_factory.mktemp("checkpointed") / "r"
    run_training(cfg, out=run_dir, progress=False, log=lambda *_: None)
    return run_dir, build_run(cfg)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_damaged_byte_anywhere_in_the_latest_checkpoint_is_refused_or_harmless(two_epoch_run, data):
    run_dir, run = two_epoch_run
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "r"
        shutil.copytree(run_dir / "checkpoints", copy / "checkpoints")
        files = sorted([copy / "checkpoints/latest.json", *(copy / "checkpoints/epoch-0002").iterdir()])
        victim = data.draw(st.sampled_from(files), label="file")
        raw = bytearray(victim.read_bytes())
        pos = data.draw(st.integers(0, len(raw) - 1), label="position")
        raw[pos] ^= data.draw(st.integers(1, 255), label="xor")
        victim.write_bytes(bytes(raw))
        try:
            load_checkpoint(copy, run)
        except ConfigError as exc:
            message = str(exc)
            assert str(copy / "checkpoints") in message and "damaged" in message
            assert f"--resume {copy} --from-epoch" in message  # the other checkpoint is offered
        else:  # accepted only if the flip changed no meaning (JSON whitespace, say)
            original = (run_dir / victim.relative_to(copy)).read_text()
            assert victim.suffix == ".json" and json.loads(victim.read_text()) == json.loads(original)


def test_a_damaged_byte_in_the_checksum_field_name_is_refused(two_epoch_run):
    """One flipped byte turning run.json's "checksum" key into "bhecksum" left a checkpoint without a checksum, which
    was accepted as an older one (found by the property test above)."""
    run_dir, run = two_epoch_run
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "r"
        shutil.copytree(run_dir / "checkpoints", copy / "checkpoints")
        meta_path = copy / "checkpoints/epoch-0002/run.json"
        meta_path.write_text(meta_path.read_text().replace('"checksum"', '"bhecksum"'))
        with pytest.raises(ConfigError, match="damaged"):
            load_checkpoint(copy, run)


def test_resume_without_a_checkpoint_starts_the_run_again_from_its_beginning(tmp_path, capsys):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text('dataset = "wine"\nparties = 2\nepochs = 2\ndevice = "cpu"\n')  # killed in its first epoch
    assert _train("--resume", run_dir) == 0
    assert "from its beginning" in capsys.readouterr().out
    fresh = run_training(TrainConfig(dataset="wine", parties=2, epochs=2, device="cpu"), out=tmp_path / "fresh", progress=False,
                         log=lambda *_: None)
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["metrics"]["test"] == fresh["metrics"]["test"] and resumed["comm"] == fresh["comm"]


def test_redirected_output_gets_one_line_per_epoch_and_no_bar(tmp_path, capsys):
    assert _train("--epochs", "2", "--out", tmp_path / "r") == 0  # progress left on; stderr is not a terminal
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    assert [line.split(" loss")[0] for line in out.splitlines() if line.startswith("epoch ")] == ["epoch 1/2",
                                                                                                  "epoch 2/2"]


def test_curves_png_shows_each_epoch(tmp_path):
    run_training(_cfg(epochs=3), out=tmp_path / "r", progress=False, log=lambda *_: None)
    png = (tmp_path / "r" / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > height > 100  # two panels side by side: loss and validation metric


def test_non_finite_loss_stops_at_once_and_keeps_the_last_good_checkpoint(tmp_path):
    from secvfl.algorithms import get_algorithm

    cls = get_algorithm("splitnn")
    original = cls.train_epoch
    batches = []

    def diverge_in_second_epoch(self, epoch, progress=None):
        def spy(loss):
            batches.append(epoch)
            progress(float("nan") if epoch == 1 and batches.count(1) == 3 else loss)

        return original(self, epoch, spy)

    cls.train_epoch = diverge_in_second_epoch
    try:
        with pytest.raises(ConfigError, match=r"loss became nan at epoch 2, batch 3\. The step size is probably "
                                              r"too large \(--lr 0\.001\)") as info:
            run_training(_cfg(epochs=4), out=tmp_path / "r", progress=False, log=lambda *_: None)
    finally:
        cls.train_epoch = original
    assert "keeps the metrics and checkpoint of epoch 1" in str(info.value)
    assert batches.count(1) == 3 and 2 not in batches  # stopped at once, mid-epoch
    assert json.loads((tmp_path / "r/checkpoints/latest.json").read_text())["epoch"] == 1
    assert _epochs_of(tmp_path / "r") == [1] and not (tmp_path / "r/summary.json").exists()


@pytest.mark.parametrize("name, label", [
    ("digits", "digits"),
    ("csv:/data/my file.csv.gz:default", "csv-my_file"),
    ("csv:/data/credit.csv", "csv-credit"),
    ("svmlight:/d/a9a.txt,/d/a9a.t", "svmlight-a9a"),
    ("idx:/data/mnist/", "idx-mnist"),
])
def test_dataset_label_is_short_and_safe(name, label):
    assert dataset_label(name) == label


@given(st.text(min_size=1, max_size=300))
def test_dataset_label_is_always_a_plain_file_name(name):
    label = dataset_label(name)
    assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,39}", label), label


def test_default_run_directories_never_collide(tmp_path):
    first = default_run_dir(_cfg(), root=tmp_path)
    first.mkdir()
    second = default_run_dir(_cfg(), root=tmp_path)
    assert second != first and second.name.startswith(first.name[:len("splitnn-breast_cancer-")])


@pytest.mark.parametrize("algo, flag", [("splitnn", "--lr"), ("vimadmm", "--vim-lr"), ("dlr", "--online-lr"),
                                        ("eg", "--saddle-step-mult"), ("gd", "--saddle-step-mult"),
                                        ("nesterov", "--saddle-step-mult"), ("eg-mlp", "--lr")])
def test_a_diverged_run_names_the_step_size_flag_its_algorithm_uses(algo: str, flag: str) -> None:
    from secvfl.runner import _diverged, build_run

    run = build_run(TrainConfig(algo=algo, dataset="wine", epochs=1, device="cpu"))
    name, value = run.algorithm.step_size()
    assert name == flag and value > 0
    text = str(_diverged(run.algorithm.step_size(), None, 0, 3, float("nan")))
    assert f"({flag} {value:g})" in text and f"smaller {flag} (e.g. {value / 10:g})" in text


def test_a_diverged_run_blames_no_step_size_when_the_data_are_not_finite_or_no_flag_sets_it() -> None:
    from secvfl.runner import _diverged, _non_finite_inputs, build_run

    run = build_run(TrainConfig(algo="splitnn", dataset="wine", epochs=1, device="cpu"))
    assert _non_finite_inputs(run) == 0
    run.ctx.data.X_train[3, 1] = float("inf")  # what a column of +-1e308 becomes once standardised
    run.ctx.data.X_train[5, 2] = float("nan")
    cells = _non_finite_inputs(run)
    assert cells == 2
    text = str(_diverged(run.algorithm.step_size(), None, 0, 3, float("nan"), cells))
    assert "2 non-finite value(s)" in text and "--lr" not in text
    admm = build_run(TrainConfig(algo="admm", dataset="wine", epochs=1, device="cpu"))
    assert admm.algorithm.step_size() is None
    text = str(_diverged(admm.algorithm.step_size(), None, 0, None, float("inf")))
    assert "--lr" not in text and "step sizes follow from the problem" in text
    eg = build_run(TrainConfig(algo="eg", dataset="wine", epochs=1, device="cpu"))
    assert eg.algorithm.step_size() == ("--saddle-step-mult", 1.0)


def test_an_online_run_names_its_block_score_prequential(tmp_path, capsys) -> None:
    assert main(["train", "--algo", "dlr", "--dataset", "wine", "--parties", "2", "--epochs", "1", "--no-progress",
                 "--device", "cpu", "--out", str(tmp_path / "r")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 1/1")]
    assert len(lines) == 1 and " prequential accuracy " in lines[0] and " val " not in lines[0]
