"""A checkpoint of one nested dict, saved and read by one process (a framework plug-in)."""

from __future__ import annotations

import collections
import os

import pytest
import torch

import ddpckpt
from conftest import make_mlp
from ddpckpt import CheckpointNotFoundError, CorruptCheckpointError
from ddpckpt._format.manifest import read_manifest
from ddpckpt.errors import CheckpointExistsError, StateMismatchError, UnsupportedValueError
from ddpckpt.storage._location import locate
from dist_worker import lightning_checkpoint, same_tree
from io_helpers import flip_byte
from launch import forked_ranks


def test_a_lightning_shaped_dict_round_trips_with_its_types(ckpt_dir) -> None:
    checkpoint = lightning_checkpoint()
    assert ddpckpt.save_dict(ckpt_dir, checkpoint, step=40, epoch=2) == ckpt_dir
    loaded = ddpckpt.load_dict(ckpt_dir)
    assert same_tree(loaded, checkpoint)
    assert isinstance(loaded["state_dict"], collections.OrderedDict)
    assert loaded["hyper_parameters"]["betas"] == (0.8, 0.9)
    manifest = read_manifest(locate(ckpt_dir))
    assert (manifest.step, manifest.epoch, manifest.format_version) == (40, 2, 4)
    assert ddpckpt.latest(os.path.dirname(ckpt_dir)) == ckpt_dir
    ddpckpt.verify(ckpt_dir)


def test_loaded_tensors_are_private_copies(ckpt_dir) -> None:
    ddpckpt.save_dict(ckpt_dir, {"w": torch.arange(4.0)})
    first = ddpckpt.load_dict(ckpt_dir)["w"]
    first.add_(1)
    assert torch.equal(ddpckpt.load_dict(ckpt_dir)["w"], torch.arange(4.0))


def test_map_location_as_torch_load_takes_it(ckpt_dir) -> None:
    ddpckpt.save_dict(ckpt_dir, {"w": torch.ones(3), "n": [torch.zeros(1)]})
    assert ddpckpt.load_dict(ckpt_dir, map_location=None)["w"].device.type == "cpu"
    assert ddpckpt.load_dict(ckpt_dir, map_location=torch.device("cpu"))["w"].device.type == "cpu"
    assert ddpckpt.load_dict(ckpt_dir, map_location={"cuda:0": "cuda:1"})["w"].device.type == "cpu"
    seen = []

    def keep(tensor: torch.Tensor, saved: str) -> torch.Tensor:
        seen.append(saved)
        return tensor.double()

    assert ddpckpt.load_dict(ckpt_dir, map_location=keep)["n"][0].dtype == torch.float64
    assert seen == ["cpu", "cpu"]
    with pytest.raises(TypeError, match="map_location"):
        ddpckpt.load_dict(ckpt_dir, map_location=3)


def test_numpy_arrays_stay_arrays_wherever_tensors_go(ckpt_dir) -> None:
    # An HF-style RNG state: numpy's state tuple holds an array; torch.load keeps it numpy.
    np = pytest.importorskip("numpy")
    state = np.random.RandomState(3).get_state()
    ddpckpt.save_dict(ckpt_dir, {"numpy": state, "w": torch.ones(2)})
    loaded = ddpckpt.load_dict(ckpt_dir, map_location=lambda tensor, saved: tensor.to("meta"))
    assert loaded["w"].device.type == "meta"
    assert isinstance(loaded["numpy"][1], np.ndarray) and (loaded["numpy"][1] == state[1]).all()


def test_a_map_location_function_returning_none_keeps_the_saved_device(ckpt_dir) -> None:
    ddpckpt.save_dict(ckpt_dir, {"w": torch.arange(3.0)})
    loaded = ddpckpt.load_dict(ckpt_dir, map_location=lambda tensor, saved: None)
    assert torch.equal(loaded["w"], torch.arange(3.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_an_error_naming_map_location(ckpt_dir) -> None:
    ddpckpt.save_dict(ckpt_dir, {"w": torch.ones(2)})
    with pytest.raises(RuntimeError, match=r"'w' would go to cuda:0.*map_location='cpu'"):
        ddpckpt.load_dict(ckpt_dir, map_location={"cpu": "cuda:0"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_remember_their_device(ckpt_dir) -> None:
    ddpckpt.save_dict(ckpt_dir, {"w": torch.ones(3, device="cuda"), "c": torch.ones(1)})
    assert ddpckpt.load_dict(ckpt_dir)["w"].device.type == "cpu"
    restored = ddpckpt.load_dict(ckpt_dir, map_location=None)
    assert restored["w"].device == torch.device("cuda:0") and restored["c"].device.type == "cpu"
    assert torch.equal(restored["w"].cpu(), torch.ones(3))
    mapped = ddpckpt.load_dict(ckpt_dir, map_location={"cuda:0": "cpu"})
    assert mapped["w"].device.type == "cpu"


def test_a_damaged_file_is_found_on_load(ckpt_dir) -> None:
    ddpckpt.save_dict(ckpt_dir, {"w": torch.arange(1000.0)})
    data = [n for n in os.listdir(ckpt_dir) if n.startswith("state-")]
    flip_byte(os.path.join(ckpt_dir, data[0]), os.path.getsize(os.path.join(ckpt_dir, data[0])) - 8)
    with pytest.raises(CorruptCheckpointError, match=data[0]):
        ddpckpt.load_dict(ckpt_dir)


def test_what_pickle_would_need_is_refused_before_writing(ckpt_dir) -> None:
    class Attributes(dict):
        pass

    with pytest.raises(UnsupportedValueError, match="dict/hyper_parameters"):
        ddpckpt.save_dict(ckpt_dir, {"epoch": 1, "hyper_parameters": Attributes(lr=0.1)})
    assert not os.path.exists(ckpt_dir)


def test_an_existing_checkpoint_is_replaced_only_when_asked(ckpt_dir) -> None:
    ddpckpt.save_dict(ckpt_dir, {"v": 1})
    with pytest.raises(CheckpointExistsError):
        ddpckpt.save_dict(ckpt_dir, {"v": 2})
    ddpckpt.save_dict(ckpt_dir, {"v": 2}, overwrite=True)
    assert ddpckpt.load_dict(ckpt_dir) == {"v": 2}


def test_dict_and_training_state_checkpoints_name_their_reader(tmp_path) -> None:
    state_ckpt, dict_ckpt = str(tmp_path / "state"), str(tmp_path / "dict")
    ddpckpt.save(state_ckpt, model=make_mlp())
    ddpckpt.save_dict(dict_ckpt, {"v": 1})
    with pytest.raises(StateMismatchError, match=r"ddpckpt\.load\(path"):
        ddpckpt.load_dict(state_ckpt)
    with pytest.raises(StateMismatchError, match="load_dict"):
        ddpckpt.load(dict_ckpt, model=make_mlp())


def test_remove_deletes_checkpoints_only(tmp_path) -> None:
    path = str(tmp_path / "c")
    ddpckpt.save_dict(path, {"v": 1})
    ddpckpt.remove_checkpoint(path)
    assert not os.path.exists(path)
    (tmp_path / "notes").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="nothing removed"):
        ddpckpt.remove_checkpoint(str(tmp_path / "notes"))
    assert (tmp_path / "notes").exists()


@pytest.mark.processes
def test_rank_0_alone_writes_and_both_ranks_read(tmp_path) -> None:
    """As Lightning calls a CheckpointIO: save on global rank 0 only, load on every rank."""
    ckpt = tmp_path / "epoch=2-step=40"
    launch = forked_ranks("dict_rank0", tmp_path / "out", args=["--ckpt", str(ckpt)]).ok()
    for rank in (0, 1):
        assert launch.result(rank)["same"], rank
    assert read_manifest(locate(str(ckpt))).world_size == 1
