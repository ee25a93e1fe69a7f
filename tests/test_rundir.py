"""The run directory check of parties that start at the same moment (CPU only): a launch's parties check sibling
directories under one parent that none of them has created yet."""
import threading
from pathlib import Path

import pytest

from secvfl.errors import ConfigError
from secvfl.rundir import check_out_dir


def test_the_check_creates_nothing(tmp_path: Path) -> None:
    check_out_dir(tmp_path / "a" / "b" / "run")
    check_out_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_path_under_a_file_is_refused_with_the_file_named(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"f is a file, so no directory can be created under it"):
        check_out_dir(tmp_path / "f" / "run")


def test_parties_checking_sibling_directories_at_once_all_pass_and_leave_nothing(tmp_path: Path) -> None:
    """Four threads check ``fedI/runs/<party>`` for 200 new federations each, as a launch's parties do (a check that
    created the parents and removed them again stopped a party with ``Directory not empty``)."""
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def check(name: str) -> None:
        try:
            start.wait(timeout=10)
            for i in range(200):
                check_out_dir(tmp_path / f"fed{i}" / "runs" / name)
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)

    threads = [threading.Thread(target=check, args=(name,)) for name in ("label", "party0", "party1", "party2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert list(tmp_path.iterdir()) == []
