"""titanlite.checkpoint.safe_load: DCP folders are read without running code a pickle in them carries.

Each crafted checkpoint is first shown to be dangerous: torch's own reader (``FileSystemReader`` /
``DefaultLoadPlanner``) runs its code, creating a marker file. The safe reader then refuses the
same folder with a one-line error naming the file or item, and the marker is never created. Plain
data (ints, dicts, bytes, byte buffers as torchtitan's older TrainState wrote them, tensors of
every dtype) loads exactly as torch's reader loads it.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from titanlite.checkpoint import safe_load


@pytest.fixture(autouse=True)
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class RunsCode:
    """Unpickling this object calls ``open(marker, "w")``: a file appears when the pickle is executed."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def crafted_checkpoint(folder: Path, marker: Path) -> Path:
    """A DCP folder with a tensor, plain values and one item whose pickle runs code."""
    state = {"w": torch.arange(6.0), "step": 3, "evil": RunsCode(marker)}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    assert not marker.exists()  # saving pickles the call, it does not make it
    return folder


def test_byte_io_item_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "marker"
    ckpt = crafted_checkpoint(tmp_path / "ckpt", marker)
    # torch's default planner runs the code (the hole being closed)
    dcp.load({"evil": 0}, checkpoint_id=str(ckpt), no_dist=True)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(safe_load.UnsafeCheckpointError) as e:
        safe_load.load({"w": torch.zeros(6), "evil": 0}, ckpt, no_dist=True)
    msg = str(e.value)
    assert "\n" not in msg and str(ckpt) in msg and "checkpoint item evil is not plain data" in msg, msg
    assert "weights_only=False" not in msg  # torch's advice to load it unsafely is not passed on
    assert not marker.exists()


def test_crafted_metadata_is_refused(tmp_path):
    marker = tmp_path / "marker"
    ckpt = crafted_checkpoint(tmp_path / "ckpt", marker)
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    FileSystemReader(str(ckpt)).read_metadata()  # torch's reader runs it
    assert marker.exists()
    marker.unlink()

    for read in (lambda: safe_load.read_metadata(ckpt), lambda: safe_load.load({"step": 0}, ckpt, no_dist=True)):
        with pytest.raises(safe_load.UnsafeCheckpointError) as e:
            read()
        msg = str(e.value)
        assert "\n" not in msg and str(ckpt / ".metadata") in msg and "refused to load global" in msg, msg
    assert not marker.exists()


@pytest.mark.parametrize("garbage", ["random", "truncated", "other_pickle"])
def test_garbled_metadata_is_a_one_line_error(garbage, tmp_path):
    ckpt = crafted_checkpoint(tmp_path / "ckpt", tmp_path / "marker")
    meta = ckpt / ".metadata"
    data = {
        "random": os.urandom(256),
        "truncated": meta.read_bytes()[: meta.stat().st_size // 2],
        "other_pickle": pickle.dumps({"a": 1}),
    }[garbage]
    meta.write_bytes(data)
    with pytest.raises(ValueError) as e:
        safe_load.read_metadata(ckpt)
    msg = str(e.value)
    assert "\n" not in msg and str(meta) in msg and ("unreadable" in msg or "not DCP metadata" in msg), msg
    with pytest.raises(ValueError, match="no .metadata"):
        safe_load.read_metadata(tmp_path)


def test_plain_data_loads_as_torch_loads_it(tmp_path):
    history = io.BytesIO()
    torch.save([1.5, 2.5], history)
    tensors = {str(dt): torch.arange(4).to(dt) for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool)}
    state = {"t": tensors, "step": 7, "cfg": {"name": "x", "ids": [1, 2]}, "blob": b"\x00\x01", "hist": history}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)

    def fresh():
        zeros = {k: torch.zeros_like(v) for k, v in tensors.items()}
        return {"t": zeros, "step": 0, "cfg": {"name": "", "ids": None}, "blob": b"", "hist": 0}

    ours, reference = fresh(), fresh()
    safe_load.load(ours, tmp_path, no_dist=True)
    dcp.load(reference, checkpoint_id=str(tmp_path), no_dist=True)
    for k, v in tensors.items():
        assert ours["t"][k].dtype == v.dtype and torch.equal(ours["t"][k], v) and torch.equal(reference["t"][k], v)
    assert (ours["step"], ours["cfg"], ours["blob"]) == (reference["step"], reference["cfg"], reference["blob"])
    assert (ours["step"], ours["cfg"], ours["blob"]) == (7, {"name": "x", "ids": [1, 2]}, b"\x00\x01")
    assert ours["hist"].getvalue() == reference["hist"].getvalue() == history.getvalue()
    assert (
        safe_load.read_metadata(tmp_path).state_dict_metadata.keys()
        == dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata.keys()
    )
