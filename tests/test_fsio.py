"""titanlite.utils.fsio: atomic file and folder writes, fsync_dir, one_line.

The references are the file system itself (what a path holds after a write that fails midway) and the
plain ``str.split`` definition of whitespace."""

from __future__ import annotations

import os

import pytest

from titanlite.errors import one_line
from titanlite.utils import fsio


class Boom(Exception):
    pass


def failing_chunks():
    yield b"the first half of the new content"
    raise Boom("disk gone")


def test_atomic_write_replaces_the_whole_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    fsio.atomic_write(path, "new ✓\n")
    assert path.read_bytes() == "new ✓\n".encode()
    fsio.atomic_write(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    fsio.atomic_write(path, [b"a", b"b", b"c"], fsync=False)
    assert path.read_bytes() == b"abc"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


@pytest.mark.parametrize("hidden", [False, True])
def test_a_write_failing_midway_leaves_the_old_file_and_no_tmp(tmp_path, hidden):
    path = tmp_path / "state.json"
    path.write_bytes(b"old content")
    seen = []
    with pytest.raises(Boom):
        fsio.atomic_write(
            path, failing_chunks(), hidden_tmp=hidden, before_rename=lambda: seen.append("renamed too early")
        )
    assert path.read_bytes() == b"old content" and not seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_before_rename_runs_with_the_data_on_disk_and_its_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "s.bin"
    path.write_bytes(b"old")
    on_disk = []

    def check_then_fail():
        on_disk.append((path.read_bytes(), (tmp_path / "s.bin.tmp").read_bytes()))
        raise OSError("journal full")

    with pytest.raises(OSError, match="journal full"):
        fsio.atomic_write(path, b"new", before_rename=check_then_fail)
    assert on_disk == [(b"old", b"new")]
    assert path.read_bytes() == b"old" and not (tmp_path / "s.bin.tmp").exists()


def test_the_temporary_file_is_named_beside_the_target(tmp_path):
    names = []
    for hidden in (False, True):
        fsio.atomic_write(
            tmp_path / "x", b"1", hidden_tmp=hidden, before_rename=lambda: names.append(sorted(os.listdir(tmp_path)))
        )
    assert names == [["x.tmp"], [".x.tmp", "x"]]


def test_fsync_dir_on_a_folder_a_file_and_a_missing_path(tmp_path):
    (tmp_path / "f").write_text("x")
    fsio.fsync_dir(tmp_path)
    fsio.fsync_dir(tmp_path / "f")
    fsio.fsync_dir(tmp_path / "missing")  # best effort: no error


def test_fsync_dir_really_fsyncs_the_folder(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(fsio.os, "fsync", spy)
    fsio.fsync_dir(tmp_path)
    assert synced == [os.path.realpath(tmp_path)]


def test_atomic_dir_publishes_only_a_complete_folder(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with fsio.atomic_dir(out) as partial:
        assert partial.parent == out.parent and partial.name.startswith("out.partial-")
        (partial / "w.bin").write_bytes(b"w")
        assert not out.exists()
    assert [p.name for p in out.iterdir()] == ["w.bin"] and [p.name for p in out.parent.iterdir()] == ["out"]
    (tmp_path / "empty").mkdir()
    with fsio.atomic_dir(tmp_path / "empty") as partial:
        (partial / "x").write_text("x")
    assert (tmp_path / "empty" / "x").read_text() == "x"


def test_atomic_dir_failing_leaves_the_file_system_as_found(tmp_path):
    with pytest.raises(Boom), fsio.atomic_dir(tmp_path / "new" / "deeper" / "out") as partial:
        (partial / "half").write_bytes(b"half")
        raise Boom
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_refuses_a_non_empty_output(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(ValueError, match="already exists and is not empty"), fsio.atomic_dir(tmp_path / "out"):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (tmp_path / "out" / "keep").read_text() == "mine"


def test_atomic_dir_writes_through_a_link_to_an_empty_folder(tmp_path):
    """A link to an empty folder stands for that folder: the partial folder is made beside the target and renamed
    onto it, so the link shows the result (the rename used to fail with ENOTDIR after the whole write, leaving the
    partial folder behind)."""
    (tmp_path / "real").mkdir()
    link = tmp_path / "links" / "out"
    link.parent.mkdir()
    link.symlink_to(tmp_path / "real")
    with fsio.atomic_dir(link) as partial:
        assert partial.parent == tmp_path and partial.name.startswith("real.partial-")
        (partial / "w.bin").write_bytes(b"w")
    assert link.is_symlink() and (link / "w.bin").read_bytes() == b"w"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["links", "real"] and os.listdir(link.parent) == ["out"]


@pytest.mark.parametrize("target", ["missing", "loop"])
def test_atomic_dir_refuses_a_link_to_nothing_and_writes_nothing(target, tmp_path):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / target)
    if target == "loop":
        (tmp_path / "loop").symlink_to(link)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError) as e, fsio.atomic_dir(link):
        pytest.fail("the block must not run")
    assert str(e.value).startswith(f"output {link} is a symbolic link to {tmp_path / target}, which does not exist")
    assert sorted(os.listdir(tmp_path)) == before and link.is_symlink()


def test_atomic_dir_a_failing_rename_removes_the_partial_folder(tmp_path):
    """Something written into the (empty) output folder while the partial one fills: the rename fails, the partial
    folder is removed and the other writer's file is left alone."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OSError), fsio.atomic_dir(out) as partial:
        (partial / "w.bin").write_bytes(b"w")
        (out / "theirs").write_text("theirs")
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["theirs"]


@pytest.mark.parametrize(
    "value, want",
    [
        (ValueError("a\n  b\tc\r\n"), "a b c"),
        (KeyError("k"), "'k'"),  # str() of a KeyError, quotes and all
        ("  spaced   out  ", "spaced out"),
        (Exception(), ""),
        (3.5, "3.5"),
    ],
)
def test_one_line(value, want):
    assert one_line(value) == want


def test_append_line_ends_a_torn_last_line_first(tmp_path):
    log = tmp_path / "log.jsonl"
    fsio.append_line(log, '{"a": 1}')
    with open(log, "ab") as f:
        f.write(b'{"torn')  # a crash in the middle of a line
    fsio.append_line(log, b'{"b": 2}')
    assert log.read_bytes().splitlines() == [b'{"a": 1}', b'{"torn', b'{"b": 2}']
    assert log.read_bytes().endswith(b"\n")
