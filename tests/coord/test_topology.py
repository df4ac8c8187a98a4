"""Which ranks share storage: node identity, explicit modes, colliding host names."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ddpckpt._coord.topology as topology
from ddpckpt._coord.comm import Comm
from ddpckpt._coord.store import StoreGroup
from ddpckpt._coord.topology import colliding_nodes, node_id, storage_domains
from ddpckpt.errors import CheckpointError
from ddpckpt.storage._location import locate
from thread_ranks import ranks


class RankView:
    """One rank's side of a collective, with the other ranks' answers given up front."""

    def __init__(self, nodes: list[str], local_sizes: list[str | None]) -> None:
        self.rank, self.world_size, self.token = 0, len(nodes), "t"
        self.nodes = nodes
        self.answers = {"local-world": local_sizes}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        return fn()

    def run_reduce(
        self, name: str, fn: Callable[[], Any], reduce: Callable[[list[Any]], Any]
    ) -> Any:
        return reduce(self.answers.get(name) or [fn()] * self.world_size)


def machine(monkeypatch, tmp_path, host: str, boot_id: str | None) -> str:
    monkeypatch.setattr(topology.platform, "node", lambda: host)
    files = []
    if boot_id is not None:
        (tmp_path / "boot_id").write_text(boot_id + "\n")
        files.append(str(tmp_path / "boot_id"))
    monkeypatch.setattr(topology, "_MACHINE_FILES", (*files, str(tmp_path / "absent")))
    return node_id()


def test_machines_whose_host_names_collide_are_told_apart(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("GROUP_RANK", raising=False)
    one = machine(monkeypatch, tmp_path, "localhost", "e9ab0b37-396d-43e3-8672-126a230cf701")
    other = machine(monkeypatch, tmp_path, "localhost", "0c4f8a21-5e55-4b1e-9a0e-3f1d2c7b9e44")
    assert one != other and one.startswith("localhost/")
    assert machine(monkeypatch, tmp_path, "localhost", "0c4f8a21-5e55-4b1e-9a0e-3f1d2c7b9e44") == (
        other
    )  # stable on one machine
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's node rank: simulated nodes on one host
    assert node_id() == f"{other}/1"


def test_node_identity_without_any_machine_file_is_the_host_name(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("GROUP_RANK", raising=False)
    assert machine(monkeypatch, tmp_path, "node7", None) == "node7/?"


def test_explicit_local_storage_makes_one_domain_per_node(tmp_path) -> None:
    view = RankView(["a", "a", "b", "b"], ["2"] * 4)
    assert storage_domains(view, locate(str(tmp_path / "d")), "local") == [[0, 1], [2, 3]]
    assert storage_domains(view, locate(str(tmp_path / "d")), "shared") == [[0, 1, 2, 3]]


def test_a_probe_removed_by_another_nodes_cleanup_is_no_failure(tmp_path) -> None:
    """Two nodes on one shared file system: node a's leader, already in resume()'s cleaning
    of temporaries, removed node b's probe before node b did: resume() failed on node b with
    'No such file or directory: .../.probe-2.tmp-...'."""
    directory = str(tmp_path / "d")

    class NodeB(RankView):
        def run_reduce(self, name: str, fn: Callable[[], Any], reduce: Callable) -> Any:
            if name != "look":
                return super().run_reduce(name, fn, reduce)
            seen = fn()  # both nodes see both probes: one shared domain
            for probe in (tmp_path / "d").glob(".probe-*"):
                probe.unlink()  # node a's leader cleans the temporaries meanwhile
            return reduce([seen, None, seen, None])

    view = NodeB(["a", "a", "b", "b"], ["2"] * 4)
    view.rank = 2
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".probe-0.tmp-t").write_bytes(b"")  # node a's probe
    assert storage_domains(view, locate(directory)) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("mode", ["local", "auto"])
def test_colliding_node_identities_are_refused_not_merged(tmp_path, mode) -> None:
    """Four ranks claim one machine that runs two: an explicit "local" used to become one
    domain, so half the files went to each machine's disk."""
    view = RankView(["localhost/?"] * 4, ["2"] * 4)
    with pytest.raises(CheckpointError, match=r"ranks \[0, 1, 2, 3\] report the same machine"):
        storage_domains(view, locate(str(tmp_path / "d")), mode)
    assert storage_domains(view, locate(str(tmp_path / "d")), "shared") == [
        [0, 1, 2, 3]
    ]  # as given


def test_collisions_are_found_from_each_machines_rank_count() -> None:
    assert colliding_nodes([[0, 1, 2, 3]], ["2"] * 4) == [[0, 1, 2, 3]]
    assert colliding_nodes([[0, 1], [2, 3]], ["2"] * 4) == []
    assert colliding_nodes([[0, 1, 2, 3]], ["4"] * 4) == []
    assert colliding_nodes([[0, 1, 2, 3]], [None] * 4) == []  # unknown: nothing to compare
    assert colliding_nodes([[0, 1, 2], [3]], ["2", "2", "2", "1"]) == [[0, 1, 2]]


def test_the_layout_is_probed_once_per_directory_until_the_directory_changes(
    tmp_path, monkeypatch
) -> None:
    """Every save used to probe where its directory is shared (three exchanges, files
    written and looked for); now the second save only checks that each rank still sees
    it on the same file system. Moved to another one, it is probed anew."""
    elsewhere = Path("/dev/shm")
    if not elsewhere.is_dir() or elsewhere.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    probed: list[int] = []
    real_probe = topology._probe
    monkeypatch.setattr(
        topology, "_probe", lambda comm, *a: probed.append(comm.rank) or real_probe(comm, *a)
    )
    directory = tmp_path / "run"
    between = threading.Barrier(3)

    def body(group: StoreGroup) -> list[list[list[int]]]:
        found = []
        for call in range(3):
            if call == 2:  # rank 0 moves the directory between the second and third save
                between.wait()
                if group.rank == 0:
                    directory.rmdir()
                    directory.symlink_to(moved)
                between.wait()
            with Comm.open("ddpckpt.save", timeout=30, group=group) as comm:
                found.append(storage_domains(comm, locate(str(directory))))
        return found

    with tempfile.TemporaryDirectory(dir=elsewhere) as moved:
        results, _ = ranks(3, body)
    assert results == [[[[0, 1, 2]]] * 3] * 3
    assert sorted(probed) == [0, 0, 1, 1, 2, 2]  # the first save and the third, not the second
