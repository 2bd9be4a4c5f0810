"""One test cluster per checkout: how clusters are named, and which names are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests import conftest
from tpuft_dev.cluster.cli import cluster
from tpuft_dev.cluster.components import Layout
from tpuft_dev.cluster.local import (
    ClusterError,
    ComponentStatus,
    LocalCluster,
    check_name,
    checkout_cluster_name,
    enclosing_checkout,
)

ROOT = Path(__file__).resolve().parents[2]


def fake_checkout(path: Path) -> Path:
    (path / "devtools" / "tpuft_dev").mkdir(parents=True)
    (path / "tests").mkdir()
    (path / "tests" / "conftest.py").write_text("")
    return path


def test_a_checkout_always_gets_the_same_name_and_two_checkouts_two(tmp_path: Path) -> None:
    one, other = tmp_path / "a" / "tpuft", tmp_path / "b" / "tpuft"  # same directory name
    one.mkdir(parents=True)
    other.mkdir(parents=True)
    (tmp_path / "link").symlink_to(one)
    name = checkout_cluster_name(one, environ={})
    assert name == checkout_cluster_name(one, environ={})  # a warm re-run reuses its cluster
    assert name == checkout_cluster_name(tmp_path / "link", environ={})  # the resolved path counts
    assert name != checkout_cluster_name(other, environ={})
    assert name.startswith("pytest-tpuft-") and len(name) == len("pytest-tpuft-") + 8


@pytest.mark.parametrize("directory", ["main", "My Checkout (2)", "x" * 200, "___", "tpuft.git"])
def test_the_derived_name_is_a_valid_one_with_room_for_the_fault_cluster(
    tmp_path: Path, directory: str
) -> None:
    (tmp_path / directory).mkdir()
    name = checkout_cluster_name(tmp_path / directory, environ={})
    assert check_name(name) == name and check_name(f"{name}-faults")
    assert name.startswith("pytest-") and name == name.lower()


def test_tpuft_test_cluster_overrides_the_name_and_is_checked(tmp_path: Path) -> None:
    assert checkout_cluster_name(tmp_path, environ={"TPUFT_TEST_CLUSTER": "h5-reuse"}) == "h5-reuse"
    assert checkout_cluster_name(tmp_path, environ={"TPUFT_TEST_CLUSTER": ""}).startswith("pytest-")
    with pytest.raises(ClusterError, match=r"invalid cluster name '\.\./up'"):
        checkout_cluster_name(tmp_path, environ={"TPUFT_TEST_CLUSTER": "../up"})


def test_the_suite_runs_on_its_checkouts_cluster_not_a_shared_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TPUFT_TEST_CLUSTER"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "operator"), str(ROOT / "devtools"), env.get("PYTHONPATH", "")]
    )
    out = subprocess.run(
        [sys.executable, "-c", "import tests.conftest as c; print(c.TEST_CLUSTER)"],
        cwd=tmp_path,  # not the working directory: the checkout conftest.py is in
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == checkout_cluster_name(ROOT, environ={}) != "pytest"


@pytest.mark.parametrize("name", ["default", "pytest", "demo", "bench-goodput", "h5-reuse", "My_Cluster.2"])
def test_names_in_use_are_valid(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "..", "../cache", "a/b", "-x", ".hidden", "a b", "$(id)", "x" * 64])
def test_names_that_would_leave_the_cache_or_split_in_a_shell_are_refused(name: str) -> None:
    with pytest.raises(ClusterError, match="invalid cluster name"):
        check_name(name)


def test_down_refuses_a_name_outside_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    (cache / "clusters").mkdir(parents=True)
    (tmp_path / "precious").mkdir()
    monkeypatch.setenv("TPUFT_CACHE", str(cache))
    with pytest.raises(ClusterError):
        LocalCluster(name="../../precious", cache=cache)
    result = CliRunner().invoke(cluster, ["down", "--name", "../../precious"])
    assert result.exit_code == 1 and "invalid cluster name" in result.output
    assert (tmp_path / "precious").is_dir()


def test_tpuft_cluster_test_name_names_the_checkout_it_is_run_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TPUFT_TEST_CLUSTER", raising=False)
    checkout = fake_checkout(tmp_path / "work")
    (checkout / "docs").mkdir()
    assert enclosing_checkout(checkout / "docs") == checkout.resolve()
    for where in (checkout, checkout / "docs", checkout / "devtools" / "tpuft_dev"):
        result = CliRunner().invoke(cluster, ["test-name", "--checkout", str(where)])
        assert result.exit_code == 0, result.output
        assert result.output.strip() == checkout_cluster_name(checkout, environ={})
    result = CliRunner().invoke(cluster, ["test-name", "--checkout", str(ROOT / "docs")])
    assert result.output.strip() == checkout_cluster_name(ROOT, environ={})

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert enclosing_checkout(outside) is None
    result = CliRunner().invoke(cluster, ["test-name", "--checkout", str(outside)])
    assert result.exit_code == 1 and "is not in a checkout of tpuft" in result.output

    monkeypatch.setenv("TPUFT_TEST_CLUSTER", "mine")
    result = CliRunner().invoke(cluster, ["test-name", "--checkout", str(checkout)])
    assert result.output.strip() == "mine"


def test_make_and_the_docs_name_the_test_cluster_as_the_suite_does() -> None:
    makefile = (ROOT / "Makefile").read_text()
    clean = makefile.split("\nclean-cluster:", 1)[1]
    assert "cluster test-name" in clean and "--all" not in clean  # not the other checkouts' clusters
    docs = (ROOT / "docs" / "local-cluster.md").read_text()
    assert "pytest-<directory>-<hash>" in docs and "tpuft cluster test-name" in docs
    assert "named `pytest`" not in docs


@pytest.mark.parametrize(("fresh", "keep"), [(False, "0"), (True, "0"), (True, "1")])
def test_a_running_cluster_is_reused_unless_the_suite_wants_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: bool, keep: str
) -> None:
    calls: list[str] = []

    class Running:
        def __init__(self, name: str, log: object) -> None:
            self.layout = Layout(tmp_path / name)

        def status(self) -> list[ComponentStatus]:
            return [ComponentStatus("etcd", 1, running=True, healthy=True)]

        def up(self) -> None:
            calls.append("up")
            self.layout.root.mkdir(exist_ok=True)
            self.layout.state.write_text("{}")

        def down(self) -> None:
            calls.append("down")
            self.layout.state.unlink()
            self.layout.root.rmdir()

    monkeypatch.setattr(conftest, "LocalCluster", Running)
    monkeypatch.setenv("TPUFT_KEEP_CLUSTER", keep)
    Running("kept", None).up()  # left running by an earlier session
    calls.clear()
    for _ in conftest.session_cluster("kept", log=lambda line: None, fresh=fresh):
        assert calls == (["down", "up"] if fresh else ["up"])
    # A cluster it found running stays; one it started goes, unless TPUFT_KEEP_CLUSTER=1.
    assert calls[-1] == ("down" if fresh and keep != "1" else "up")
