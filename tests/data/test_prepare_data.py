"""Document sources and titanlite prepare (titanlite.data.prepare): exact round trip through shards, splits, dtype,
determinism across worker counts, restart behaviour and one-line errors."""

import io
import json
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.launch import run_python
from tests.helpers.shared_data import shared_file
from titanlite.data import prepare as prep
from titanlite.data.prepare_folder import JOURNAL, STATE
from titanlite.data.shards import MANIFEST, ShardedTokens, ShardReader
from titanlite.data.sources import iter_documents, list_files
from titanlite.tokenizer import build_tokenizer, tokenizer_fingerprint

REPO = Path(__file__).resolve().parents[2]


def expected_stream(tok, docs, split, val_fraction):
    ids = []
    for d in docs:
        if prep.split_of(d, val_fraction) == split:
            ids += [tok.bos_id] + tok.encode(d) + [tok.eos_id]
    return torch.tensor(ids, dtype=torch.int64)


def shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.suffix in (".bin", ".json")}


# --- sources -----------------------------------------------------------------------------------------


def test_sources_formats_and_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zed\n")
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": ""}\n{"text": "two", "x": 1}\n')
    (tmp_path / "c.json").write_text('[{"text": "three"}, "four"]')
    (tmp_path / "d.md").write_text("para one\nline two\n\n  \npara two\n")
    (tmp_path / "skip.csv").write_text("not read")
    (tmp_path / ".hidden.txt").write_text("not read")
    docs = list(iter_documents(tmp_path))
    assert docs == ["one", "two", "zed\n", "three", "four", "para one\nline two\n\n  \npara two\n"]
    assert list(iter_documents(tmp_path / "d.md", txt_split="paragraphs")) == ["para one\nline two\n", "para two\n"]
    assert [p.name for p in list_files(tmp_path)] == ["a.jsonl", "z.txt", "c.json", "d.md"]
    (tmp_path / "e.json").write_text('{"body": "jsonl with a .json suffix"}\n')
    assert list(iter_documents(tmp_path / "e.json", text_field="body")) == ["jsonl with a .json suffix"]


def test_sources_errors(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=rf"^{p}:2: no 'text' field \(keys: content\)"):
        list(iter_documents(p))
    p.write_text('{"text": "ok"}\n{bad json\n')
    with pytest.raises(ValueError, match=rf"^{p}:2: invalid JSON"):
        list(iter_documents(p))
    p.write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match=rf"^{p}:1: field 'text' is int"):
        list(iter_documents(p))
    with pytest.raises(ValueError, match="input not found"):
        list(iter_documents(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    with pytest.raises(ValueError, match=rf"^{bad}:1: not valid UTF-8 \(byte 4 of the line\)"):
        list(iter_documents(bad))


def test_parquet_needs_pyarrow(tmp_path):
    try:
        import pyarrow  # noqa: F401

        pytest.skip("pyarrow is installed")
    except ImportError:
        pass
    p = tmp_path / "x.parquet"
    p.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="'pyarrow' package"):
        list(iter_documents(p))


# --- prepare: exact round trip, splits, dtype, worker count ---------------------------------------------


@pytest.fixture(scope="module")
def cl100k_inputs():
    return [
        shared_file("text/c4_sample.jsonl"),
        shared_file("text/tinyshakespeare.txt"),
        shared_file("tokenizers/cl100k_base.tiktoken"),
    ]


@pytest.fixture(scope="module")
def cl100k_prepared(tmp_path_factory, cl100k_inputs):
    c4, shakespeare, tok_path = cl100k_inputs
    out = tmp_path_factory.mktemp("cl100k_w1")
    manifest = prep.prepare(
        [c4, shakespeare], out, str(tok_path), val_fraction=0.1, workers=1, shard_tokens=60_000, log=None
    )
    return out, manifest


def test_round_trip_cl100k_exact(cl100k_prepared, cl100k_inputs):
    out, manifest = cl100k_prepared
    c4, shakespeare, tok_path = cl100k_inputs
    tok = build_tokenizer(str(tok_path))
    docs = list(iter_documents([c4, shakespeare]))
    assert len(docs) == 1001
    assert manifest["dtype"] == "uint32"  # > 65536 entries
    assert manifest["tokenizer"]["vocab_size"] == 100512 and manifest["tokenizer"]["eos_id"] == 100257
    assert manifest["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    for e in manifest["shards"]:  # recorded at prepare time; recomputed here from the files themselves
        data = (out / e["name"]).read_bytes()
        assert e["checksum"] == f"crc32:{zlib.crc32(data):08x}"
        assert e["max_id"] == int(ShardReader(out / e["name"]).tokens.max())
    assert json.loads((out / MANIFEST).read_text()) == manifest
    for split in ("train", "val"):
        store = ShardedTokens(out, split)
        ref = expected_stream(tok, docs, split, 0.1)
        assert len(store) == len(ref) == manifest["totals"][split]["tokens"]
        assert torch.equal(store[0 : len(store)], ref)
        assert all(ShardReader(r.path).dtype.itemsize == 4 for r in store.shards)
        assert (store.bos_id, store.eos_id) == (100256, 100257)
    assert manifest["totals"]["train"]["shards"] > 3  # several shards: the stream crosses boundaries
    n_val = manifest["totals"]["val"]["docs"]
    assert 60 <= n_val <= 140 and n_val + manifest["totals"]["train"]["docs"] == 1001


def test_two_workers_bitwise_equal(cl100k_prepared, cl100k_inputs, tmp_path):
    out1, _ = cl100k_prepared
    c4, shakespeare, tok_path = cl100k_inputs
    prep.prepare([c4, shakespeare], tmp_path, str(tok_path), val_fraction=0.1, workers=2, shard_tokens=60_000, log=None)
    a, b = shard_bytes(out1), shard_bytes(tmp_path)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def test_uint16_split_disjoint_and_deterministic(tmp_path):
    text = shared_file("text/tinyshakespeare.txt")
    tok_path = shared_file("tokenizers/test_tiktoken.model")
    src = tmp_path / "small.txt"
    src.write_text(text.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    outs = []
    for i in range(2):
        out = tmp_path / f"out{i}"
        m = prep.prepare(
            src, out, str(tok_path), val_fraction=0.2, shard_tokens=5_000, txt_split="paragraphs", log=None
        )
        outs.append(out)
        assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 2256
    assert shard_bytes(outs[0]) == shard_bytes(outs[1])
    tok = build_tokenizer(str(tok_path))

    def doc_texts(split):
        store = ShardedTokens(outs[0], split)
        assert store.shards[0].dtype.itemsize == 2
        offs = store.doc_offsets()
        return [tok.decode(store[int(a) + 1 : int(b) - 1].tolist()) for a, b in zip(offs[:-1], offs[1:])]

    train, val = doc_texts("train"), doc_texts("val")
    docs = list(iter_documents(src, txt_split="paragraphs"))
    assert sorted(train + val) == sorted(docs)
    assert not set(train) & set(val) and len(val) > 0.1 * len(docs)
    assert val == [d for d in docs if prep.split_of(d, 0.2) == "val"]  # document order kept


# --- restarts --------------------------------------------------------------------------------------------


def test_rerun_skips_finished_shards_and_ignores_tmp(tmp_path):
    c4 = shared_file("text/c4_sample.jsonl")
    tok_path = str(shared_file("tokenizers/test_tiktoken.model"))
    src = tmp_path / "part.jsonl"
    src.write_text("".join(c4.read_text(encoding="utf-8").splitlines(keepends=True)[:150]), encoding="utf-8")
    out = tmp_path / "out"
    kw = dict(val_fraction=0.1, shard_tokens=20_000, log=None)
    prep.prepare(src, out, tok_path, **kw)
    full = shard_bytes(out)
    shards = sorted(p for p in out.glob("train-*.bin"))
    assert len(shards) >= 4
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}

    prep.prepare(src, out, tok_path, **kw)  # complete: everything is kept
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")} == mtimes
    assert shard_bytes(out) == full

    # Simulate a run interrupted while writing train shard 2: no manifest, later shards missing,
    # a half-written .tmp left behind.
    (out / MANIFEST).unlink()
    for p in shards[2:]:
        p.unlink()
    (out / (shards[2].name + ".tmp")).write_bytes(b"TLSHARD\0 half written garbage")
    with open(out / JOURNAL, "ab") as f:
        f.write(b'{"name": "train-000')  # a journal line torn by the crash
    with pytest.raises(ValueError, match="manifest.json: not found"):
        ShardedTokens(out)
    log = io.StringIO()
    prep.prepare(src, out, tok_path, **{**kw, "log": log})
    assert "resuming: keeping" in log.getvalue() and "skipped" in log.getvalue()
    assert shard_bytes(out) == full
    assert not list(out.glob("*.tmp"))
    for p in shards[:2]:
        assert p.stat().st_mtime_ns == mtimes[p.name]

    # Different settings: refused (one line), unless --overwrite.
    with pytest.raises(ValueError, match="different settings.*--overwrite"):
        prep.prepare(src, out, tok_path, **{**kw, "shard_tokens": 30_000})
    m = prep.prepare(src, out, tok_path, **{**kw, "shard_tokens": 30_000, "overwrite": True})
    assert len([s for s in m["shards"] if s["split"] == "train"]) < len(shards)
    assert sorted(p.name for p in out.glob("*.bin")) == sorted(s["name"] for s in m["shards"])


# --- CLI errors -----------------------------------------------------------------------------------------


def test_main_bad_inputs_one_line(tmp_path, capsys):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"text": "a"}\n{"body": "b"}\n')
    cases = [
        (["--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o1")], "input not found"),
        (["--input", str(bad), "--output", str(tmp_path / "o2")], f"{bad}:2: no 'text' field"),
        (["--input", str(bad), "--output", str(tmp_path / "o3"), "--tokenizer", str(bad)], f"{bad}:1: invalid base64"),
        (["--input", str(bad), "--output", str(tmp_path / "o4"), "--val-fraction", "2"], "--val-fraction"),
    ]
    for argv, needle in cases:
        assert prep.main(argv + ["--workers", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("prepare_data: error: ") and needle in err[0], err


def test_cli_subprocess_error_no_traceback(tmp_path):
    r = run_python(
        [
            sys.executable,
            "-m",
            "titanlite",
            "prepare",
            "--input",
            str(tmp_path / "nope"),
            "--output",
            str(tmp_path / "o"),
        ],
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    assert "input not found" in r.stderr


def test_spawn_workers_match_in_process(tmp_path):
    """The "spawn" start method (default off Linux) rebuilds the tokenizer in each worker: same output."""
    from titanlite.data.encode import ParallelEncoder, encode_documents

    tok = build_tokenizer(str(shared_file("tokenizers/test_tiktoken.model")))
    texts = ["hello world", "", "a second document\nwith two lines", "ünïcödé 🙂"] * 3
    ref_flat, ref_len = encode_documents(tok, texts, np.dtype(np.uint16))
    assert ref_len.tolist()[1] == 2 and ref_flat[:1].tolist() == [tok.bos_id]
    with ParallelEncoder(tok, np.uint16, workers=2, start_method="spawn") as enc:
        results = [enc.submit(texts[i : i + 4]) for i in range(0, len(texts), 4)]
        flat = np.concatenate([r.result()[0] for r in results])
        lengths = np.concatenate([r.result()[1] for r in results])
    assert flat.dtype == np.uint16 and np.array_equal(flat, ref_flat) and np.array_equal(lengths, ref_len)


# --- --overwrite deletes only what prepare_data wrote; --verify ----------------------------------------------


@pytest.fixture()
def small_prepared(tmp_path):
    """A prepared folder (test tokenizer, 3+ train shards) and the arguments that made it."""
    c4 = shared_file("text/c4_sample.jsonl")
    src = tmp_path / "part.jsonl"
    src.write_text("".join(c4.read_text(encoding="utf-8").splitlines(keepends=True)[:60]), encoding="utf-8")
    out = tmp_path / "out"
    kw = dict(val_fraction=0.1, shard_tokens=10_000, log=None)
    tok = str(shared_file("tokenizers/test_tiktoken.model"))
    manifest = prep.prepare(src, out, tok, **kw)
    assert 3 <= manifest["totals"]["train"]["shards"] < 7
    return src, out, tok, kw, manifest


def test_overwrite_keeps_files_it_did_not_write(small_prepared):
    src, out, tok, kw, manifest = small_prepared
    stray = out / "train-00007.bin"  # the user's file, named like a shard; not in the manifest
    stray.write_bytes(b"my own data, not a shard")
    notes = out / "notes.txt"
    notes.write_text("keep me")
    before = shard_bytes(out)
    with pytest.raises(ValueError) as e:  # even with --overwrite: refused before anything is deleted
        prep.prepare(src, out, tok, **{**kw, "shard_tokens": 5_000, "overwrite": True})
    msg = str(e.value)
    assert msg.startswith(f"{stray}: named like a shard but listed in neither manifest.json") and "\n" not in msg
    assert shard_bytes(out) == before and stray.read_bytes() == b"my own data, not a shard"
    assert prep.main(["--input", str(src), "--output", str(out), "--tokenizer", tok, "--quiet"]) == 2

    stray.rename(out.parent / stray.name)  # moved away: now --overwrite goes ahead
    m = prep.prepare(src, out, tok, **{**kw, "shard_tokens": 5_000, "overwrite": True})
    assert m["totals"]["train"]["shards"] > manifest["totals"]["train"]["shards"]
    assert sorted(p.name for p in out.glob("*.bin")) == sorted(s["name"] for s in m["shards"])
    assert notes.read_text() == "keep me" and (out.parent / stray.name).read_bytes() == b"my own data, not a shard"


@pytest.mark.parametrize("where", ["journal_parent", "journal_absolute", "manifest_parent", "manifest_mask"])
def test_overwrite_refuses_a_listing_that_names_files_outside_the_shards(small_prepared, where):
    """manifest.json and prepare_journal.jsonl are what --overwrite deletes: an entry naming ``../victim.txt``, an
    absolute path or another mask file used to be deleted with the shards."""
    src, out, tok, kw, _ = small_prepared
    victim = out.parent / "victim.txt"
    victim.write_text("the user's file")
    name = str(victim) if where == "journal_absolute" else "../victim.txt"
    if where.startswith("journal"):
        with open(out / JOURNAL, "a") as f:
            f.write(json.dumps({"name": name, "tokens": 1, "docs": 1}) + "\n")
    else:
        manifest = json.loads((out / MANIFEST).read_text())
        entry = manifest["shards"][0]
        if where == "manifest_mask":
            entry["mask"] = {"name": "../victim.txt", "checksum": entry["checksum"]}
        else:
            entry["name"] = name
        (out / MANIFEST).write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError) as e:
        prep.prepare(src, out, tok, **{**kw, "shard_tokens": 5_000, "overwrite": True})
    msg = str(e.value)
    listing = JOURNAL if where.startswith("journal") else MANIFEST
    assert msg.startswith(f"{out / listing}: entry {name!r} is not a shard file of this folder") and "\n" not in msg
    assert victim.read_text() == "the user's file"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing deleted or written


@pytest.mark.parametrize("kind", ["symlink", "folder"])
def test_overwrite_refuses_a_listed_shard_that_is_no_plain_file(small_prepared, kind):
    src, out, tok, kw, manifest = small_prepared
    victim = out.parent / "victim.txt"
    victim.write_text("the user's file")
    shard = out / manifest["shards"][0]["name"]
    shard.unlink()
    if kind == "symlink":
        shard.symlink_to(victim)
    else:
        shard.mkdir()
        (shard / "inside.txt").write_text("kept")
    with pytest.raises(ValueError) as e:
        prep.prepare(src, out, tok, **{**kw, "shard_tokens": 5_000, "overwrite": True})
    msg = str(e.value)
    assert msg.startswith(f"{shard} is {'a symbolic link' if kind == 'symlink' else 'not a plain file'}"), msg
    assert "\n" not in msg and victim.read_text() == "the user's file"
    assert shard.is_symlink() if kind == "symlink" else (shard / "inside.txt").read_text() == "kept"


def test_overwrite_deletes_shards_of_an_interrupted_run(small_prepared):
    """No manifest yet: the journal says which shards were ours, so none of them is left behind."""
    src, out, tok, kw, manifest = small_prepared
    (out / MANIFEST).unlink()
    m = prep.prepare(src, out, tok, **{**kw, "shard_tokens": 40_000, "overwrite": True})
    assert m["totals"]["train"]["shards"] < manifest["totals"]["train"]["shards"]
    assert sorted(p.name for p in out.glob("*.bin")) == sorted(s["name"] for s in m["shards"])


def test_verify_command(small_prepared, capsys):
    _, out, _, _, manifest = small_prepared
    assert prep.main(["--verify", str(out), "--workers", "2"]) == 0
    assert f"{len(manifest['shards'])} of {len(manifest['shards'])} shards OK" in capsys.readouterr().err
    bad = out / "train-00002.bin"
    data = bytearray(bad.read_bytes())
    data[-2:] = (65535).to_bytes(2, "little")  # the last token
    bad.write_bytes(bytes(data))
    short = out / "val-00000.bin"
    short.write_bytes(short.read_bytes()[:-2])
    assert prep.main(["--verify", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("prepare_data: error: ") for line in err)
    assert f"{bad}: checksum" in err[0] and f"{short}: truncated shard" in err[1]
    assert prep.main(["--verify", str(out.parent / "nope")]) == 2
    assert "shard folder not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        prep.main(["--verify", str(out), "--output", str(out)])
    assert e.value.code == 2


def test_prepared_folder_copy_verifies(small_prepared, tmp_path):
    """A faithful copy (e.g. to another file system) passes; the journal and state need not come along."""
    _, out, _, _, _ = small_prepared
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in out.glob("*.bin"):
        shutil.copyfile(p, copy / p.name)
    shutil.copyfile(out / MANIFEST, copy / MANIFEST)
    assert prep.verify(copy, log=None) == []


def test_folder_of_an_older_version_needs_overwrite(small_prepared):
    src, out, tok, kw, manifest = small_prepared
    state = json.loads((out / STATE).read_text())
    del state["tokenizer"]["fingerprint"]  # what an older titanlite recorded
    (out / STATE).write_text(json.dumps(state))
    (out / JOURNAL).unlink()
    with pytest.raises(ValueError, match=r"prepared by an older titanlite .*; use --overwrite"):
        prep.prepare(src, out, tok, **kw)
    assert prep.prepare(src, out, tok, **{**kw, "overwrite": True}) == manifest


@pytest.mark.parametrize("where", ["equal", "inside", "inside_via_link"])
def test_output_inside_input_refused_before_writing(tmp_path, capsys, where):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "one document"}\n{"text": "another"}\n')
    out = {"equal": src, "inside": src / "shards", "inside_via_link": tmp_path / "link" / "shards"}[where]
    (tmp_path / "link").symlink_to(src)
    before = sorted(p.name for p in src.rglob("*"))
    assert prep.main(["--input", str(src), "--output", str(out), "--workers", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"prepare_data: error: --output {out} "), err
    assert f"--input {src}" in err[0]
    assert sorted(p.name for p in src.rglob("*")) == before  # nothing written, not even the output folder
