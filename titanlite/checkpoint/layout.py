"""On-disk layout of a checkpoint folder, and what counts as a complete checkpoint.

::

    <dump_folder>/<checkpoint.folder>/
        step-100/                  complete: .metadata (DCP's index), __0_0.distcp ... (a data file per rank),
                                   checkpoint.json (step, model family and args, file sizes and CRC-32s),
                                   config.toml (the run's resolved config)
        step-200.partial-1a2b3c/   a save in progress (or killed): never loaded, removed at start

A save writes into ``step-N.partial-<token>``, which rank 0 renames to ``step-N`` once DCP's ``.metadata`` exists
(written after every rank's data): ``rename`` is atomic, so a ``step-N`` folder is absent or complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanlite.checkpoint.safe_load import read_metadata  # allowlisted: a crafted .metadata cannot run code
from titanlite.errors import CheckpointError
from titanlite.utils.fsio import atomic_write, fsync_dir
from titanlite.utils.nesting import loads_json

logger = logging.getLogger(__name__)

METADATA_FILE = ".metadata"
INFO_FILE = "checkpoint.json"
CONFIG_FILE = "config.toml"
FORMAT = "titanlite-dcp"
FORMAT_VERSION = 2
DIGEST_KEY = "sha256"

_STEP_RE = re.compile(r"^step-(\d+)$")
_PARTIAL_RE = re.compile(r"^step-(\d+)\.(partial|replaced)-[0-9a-zA-Z]+$")


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def partial_dir_name(step: int, token: str) -> str:
    return f"step-{step}.partial-{token}"


@dataclass(frozen=True)
class StepFolder:
    step: int
    path: Path


def _subfolders(folder: str | os.PathLike, pattern: re.Pattern) -> list[tuple[re.Match, Path]]:
    """``(match, path)`` of each subfolder whose name matches ``pattern`` (none when there is no folder)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return [(m, p) for p in root.iterdir() if (m := pattern.match(p.name)) and p.is_dir()]


def list_step_folders(folder: str | os.PathLike) -> list[StepFolder]:
    """The ``step-N`` folders (renamed into place, so complete unless damaged later), oldest first."""
    return sorted((StepFolder(int(m.group(1)), p) for m, p in _subfolders(folder, _STEP_RE)), key=lambda s: s.step)


def list_partial_folders(folder: str | os.PathLike) -> list[Path]:
    return sorted(p for _, p in _subfolders(folder, _PARTIAL_RE))


def write_json(file: str | os.PathLike, data: dict[str, Any], sort_keys: bool = False) -> None:
    """Written atomically and fsynced (a step folder is published right after: it must not hold an empty file)."""
    atomic_write(file, json.dumps(data, indent=2, sort_keys=sort_keys) + "\n", hidden_tmp=True)


class InfoIntegrityError(CheckpointError):
    """``checkpoint.json`` is titanlite's but fails its checksum: edited or damaged after the save."""


def info_digest(info: dict[str, Any]) -> str:
    """SHA-256 of a ``checkpoint.json`` content without its own ``sha256`` key, as canonical JSON (sorted keys,
    no spaces), so the digest does not depend on how the file is indented."""
    body = json.loads(json.dumps({k: v for k, v in info.items() if k != DIGEST_KEY}))  # as read back: str keys
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_info(path: str | os.PathLike, info: dict[str, Any]) -> None:
    """``<path>/checkpoint.json``: ``info``, the size and CRC-32 of the folder's DCP files (``info["files"]``,
    computed now unless given: write it after the DCP files) and the SHA-256 of the whole (:func:`info_digest`),
    which :func:`read_info` verifies. Written to a hidden temporary file and renamed into place."""
    data = {**info, "format": FORMAT, "version": FORMAT_VERSION}
    data.pop(DIGEST_KEY, None)
    if "files" not in data:
        data["files"] = file_checksums(path)
    data[DIGEST_KEY] = info_digest(data)
    write_json(Path(path) / INFO_FILE, data, sort_keys=True)


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """``checkpoint.json`` of a step folder, its own checksum verified; ValueError (one line)
    when it is missing, not ours, of another format version, or edited or damaged after the save (the checksum
    differs: its model args and file checksums could no longer be trusted)."""
    file = Path(path) / INFO_FILE
    try:
        info = loads_json(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {INFO_FILE}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is unreadable: not UTF-8 text (byte {e.start})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is unreadable: {e}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a titanlite checkpoint description")
    version = info.get("version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{file} has format version {version!r}; this titanlite reads version {FORMAT_VERSION}")
    if info.get(DIGEST_KEY) != info_digest(info):
        what = "has no" if DIGEST_KEY not in info else "fails its"
        raise InfoIntegrityError(
            f"{file} {what} checksum ({DIGEST_KEY}): it was edited or damaged after the save, so neither the model "
            "args nor the file checksums it records can be trusted"
        )
    return info


def enclosing_step_folder(path: str | os.PathLike) -> Path | None:
    """The checkpoint step folder that ``path`` is or lies in (a folder holding ``checkpoint.json`` or DCP's
    ``.metadata``), or None. Tools refuse to write there: a dump folder would put its ``config.toml`` over the
    step's, an output file named ``checkpoint.json`` would replace its description."""
    p = Path(path).expanduser().resolve()
    for folder in (p, *p.parents):
        if (folder / INFO_FILE).is_file() or (folder / METADATA_FILE).is_file():
            return folder
    return None


def refuse_inside_step_folder(path: str | os.PathLike, what: str) -> None:
    """ValueError (one line) when ``path`` is or lies in a checkpoint step folder (:func:`enclosing_step_folder`);
    ``what`` names the setting (``job.dump_folder=...``, ``--output ...``)."""
    if (step := enclosing_step_folder(path)) is not None:
        where = "is" if step == Path(path).expanduser().resolve() else "lies inside"
        raise CheckpointError(
            f"{what} {where} the checkpoint step folder {step}: writing there would change or replace that "
            "checkpoint's files; choose a path outside it"
        )


def stored_entries(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], Any] | None]:
    """``{key: (global shape, dtype)}`` of every tensor entry in the DCP metadata of ``path``; ``None``
    for a non-tensor (pickled) entry, which titanlite does not load."""
    out: dict[str, tuple[tuple[int, ...], Any] | None] = {}
    for key, md in read_metadata(path).state_dict_metadata.items():
        size, props = getattr(md, "size", None), getattr(md, "properties", None)
        out[key] = None if size is None or props is None else (tuple(size), props.dtype)
    return out


def problem_with(path: str | os.PathLike, require_info: bool = True, verify: bool = False) -> str | None:
    """None when the folder looks complete (every data file at least as long as the metadata reads), else one line
    saying what is wrong. ``require_info=False`` accepts a folder another tool wrote, without ``checkpoint.json``
    (or titanlite's ``config.toml``); ``verify`` also checks every file against the recorded checksums (reads all).
    """
    info: dict[str, Any] = {}
    try:
        if require_info or (Path(path) / INFO_FILE).exists():
            info = read_info(path)
        elif (Path(path) / CONFIG_FILE).exists():
            return f"it has titanlite's {CONFIG_FILE} but no {INFO_FILE} (its description and checksums are lost)"
        if verify and info:  # a folder another tool wrote (no checkpoint.json) has nothing recorded to verify
            try:
                if problem := checksum_problem(path, info.get("files")):
                    return problem
            except (TypeError, KeyError, AttributeError):
                return f"{INFO_FILE} has a malformed list of files"
            except OSError as e:
                return f"cannot read its files ({e.strerror or e})"
        metadata = read_metadata(path)
    except ValueError as e:
        return str(e)
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        if (rel := getattr(item, "relative_path", None)) is not None:
            needed[rel] = max(needed.get(rel, 0), int(item.offset) + int(item.length))
    for rel, end in sorted(needed.items()):
        file = Path(path) / rel
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            return f"data file {rel} is missing"
        if size < end:
            return f"data file {rel} is truncated ({size} bytes, needs {end})"
    return None


def _crc32(file: Path, chunk: int = 8 << 20) -> str:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)  # releases the GIL on large blocks
    return f"{crc:08x}"


def _crc32s(files: list[Path], threads: int) -> list[str]:
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files)))) as pool:
        return list(pool.map(_crc32, files))


def file_checksums(path: str | os.PathLike, threads: int = 4) -> dict[str, dict[str, Any]]:
    """``{file name: {"bytes": size, "crc32": hex}}`` of a step folder's DCP files, hashed in ``threads`` threads.
    CRC-32 catches accidental damage as a cryptographic hash would, several times faster (docs/benchmarks.md,
    "Checksums"); checkpoints are trusted input anyway (docs/checkpoints.md, "Trusting checkpoints")."""
    files = _dcp_files(path)
    return {p.name: {"bytes": p.stat().st_size, "crc32": crc} for p, crc in zip(files, _crc32s(files, threads))}


def _dcp_files(path: str | os.PathLike) -> list[Path]:
    """The files :func:`file_checksums` covers: DCP's ``.metadata`` and the ``.distcp`` data files."""
    return sorted(p for p in Path(path).iterdir() if p.is_file() and (p.suffix == ".distcp" or p.name == METADATA_FILE))


def checksum_problem(path: str | os.PathLike, recorded: dict[str, dict[str, Any]], threads: int = 4) -> str | None:
    """None when every file ``recorded`` (by :func:`file_checksums` at save) is intact and every DCP file of the
    folder is recorded, else one line naming the first damaged or unrecorded file. Nothing recorded is a problem
    too: verification is never skipped for want of data."""
    if not recorded:
        return f"{INFO_FILE} records no checksums of its files, so they cannot be verified"
    if unrecorded := [p.name for p in _dcp_files(path) if p.name not in recorded]:
        return f"{unrecorded[0]} is not covered by the checksums in {INFO_FILE}"
    files = [Path(path) / name for name in sorted(recorded)]
    for file in files:
        if not file.is_file():
            return f"{file.name} is missing"
        if file.stat().st_size != recorded[file.name]["bytes"]:
            return f"{file.name} has {file.stat().st_size} bytes, {recorded[file.name]['bytes']} when saved"
    for file, crc in zip(files, _crc32s(files, threads)):
        if crc != recorded[file.name]["crc32"]:
            return f"{file.name} fails its checksum (crc32 {crc}, {recorded[file.name]['crc32']} when saved)"
    return None


def publish(partial: Path, final: Path, token: str) -> None:
    """Rename a finished ``partial`` folder to ``final`` (atomically replacing an older one)."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.replaced-{token}")
        os.rename(final, old)
    os.rename(partial, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def quiet_single_process():
    """Inside: no DCP warning that it saves or loads in a single process (a supported layout here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


RESUMED = "the run's checkpoint"  # what recorded_checkpoint calls a checkpoint of the run itself


def recorded_checkpoint(
    section: Any, dump_folder: str | os.PathLike, usable: Callable[[dict], bool]
) -> tuple[Path, str, dict] | None:
    """``(folder, what, checkpoint.json)`` of the checkpoint a run will start from, read before anything is built:
    the run's newest (or ``load_step``'s) step folder with a readable, ``usable`` ``checkpoint.json`` (``what`` =
    :data:`RESUMED`), else ``initial_load_path``'s, else None."""
    c = section
    if c.enable:
        folders = list_step_folders(Path(dump_folder) / c.folder)
        for f in reversed([f for f in folders if c.load_step in (-1, f.step)]):
            with contextlib.suppress(ValueError):  # a damaged one is reported (and skipped) by the manager
                if usable(info := read_info(f.path)):
                    return f.path, RESUMED, info
    if not c.initial_load_path:
        return None
    path, info = Path(c.initial_load_path), {}
    with contextlib.suppress(ValueError, OSError):  # the manager reports what is wrong with it
        info = read_info(path) if (path / INFO_FILE).is_file() else {}
    return path, "checkpoint.initial_load_path", info


def model_args_source(section: Any, dump_folder: str | os.PathLike) -> tuple[Path, str] | None:
    """The checkpoint whose recorded model args a run takes (see ``model_args_from_seed``): the newest step
    folder of the run whose ``checkpoint.json`` records them, so a resume computes as the run did; else
    ``initial_load_path``; None for a fresh start."""
    found = recorded_checkpoint(section, dump_folder, lambda info: isinstance(info.get("model", {}).get("args"), dict))
    return None if found is None else (found[0], found[1])
