"""Checks a local file passed, kept (``checks_dir``): an unchanged file is not checked again, and
any change a write through the file system makes, or a writer that could make one unseen, means
the next load checks it again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import weightstream as ws
from weightstream import localfs
from weightstream.cache import passed
from weightstream.cli.main import main as cli
from weightstream.engine import verify as verify_module
from weightstream.errors import FormatError
from weightstream.format import checksums
from weightstream.format.manifest import MANIFEST_NAME, FileDigest
from weightstream.sources.file import file_identity

from ..conftest import assert_same, flip, random_tensor, write_sharded
from .test_hub_checksums import local_dir
from .test_verify import PIECE, shards, with_manifest


@pytest.fixture
def tmp_path(tmp_path: Path) -> Iterator[Path]:
    """Checks are kept only where a file's times follow every write to it: where pytest's own
    folder is on tmpfs (``/tmp`` on many systems), these tests keep their files on the
    repository's disk instead."""
    if localfs.times_miss_writes(str(tmp_path)) is None:
        yield tmp_path
        return
    root = Path(__file__).resolve().parents[2] / ".pytest-tmp"
    root.mkdir(exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=root))
    assert localfs.times_miss_writes(str(folder)) is None, f"no folder on a disk for {__name__}"
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files made by the test count as settled at once (the rule has a test of its own)."""
    monkeypatch.setattr(passed, "SETTLE_NS", 0)


@pytest.fixture
def crcs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Bytes the load's CRC32C ran over (the real CRC, counted)."""
    seen: list[int] = []
    real = checksums.ALGORITHMS["crc32c"]

    def counted(data: object, previous: int) -> int:
        seen.append(len(memoryview(data)))  # type: ignore[arg-type]
        return int(real.compute(data, previous))

    algo = checksums.Algorithm(real.name, real.bits, counted, real.combine)
    monkeypatch.setitem(checksums.ALGORITHMS, "crc32c", algo)
    monkeypatch.setattr(verify_module, "algorithm", lambda name: checksums.ALGORITHMS[name])
    yield seen


def sizes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def loaded(folder: Path, **settings: object) -> tuple[dict[str, torch.Tensor], ws.LoadStats]:
    with ws.open_checkpoint(folder, config=ws.StreamConfig(**settings)) as ck:  # type: ignore[arg-type]
        out = ck.load()
        assert ck.last_stats is not None
        return out, ck.last_stats


def records(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "checks").glob("*.json"))


@pytest.mark.usefixtures("settled")
@pytest.mark.parametrize("how", ["load", "stream", "borrowed"])
def test_an_unchanged_file_is_not_checked_again(tmp_path: Path, crcs: list[int], how: str) -> None:
    folder = tmp_path / "model"
    want = write_sharded(folder, shards())
    with_manifest(folder)
    where = str(tmp_path / "checks")
    total = sizes(folder)

    def run() -> ws.LoadStats:
        config = ws.StreamConfig(checks_dir=where)
        if how == "load":
            return loaded(folder, checks_dir=where)[1]
        s = ws.stream(folder, config=config, borrow_cached=how == "borrowed")
        got = {n: t.clone() for n, t in s}
        assert_same(got, want)
        return s.stats

    first = run()
    assert (first.checked_bytes, first.recalled_bytes, first.unchecked_bytes) == (total, 0, 0)
    assert (
        sum(crcs) >= total - 2 * 4096
    )  # every byte went through the CRC (a page of each header is read at open)
    assert len(records(tmp_path)) == 2  # one per shard
    crcs.clear()
    again = run()
    assert (again.checked_bytes, again.recalled_bytes, again.unchecked_bytes) == (total, total, 0)
    assert sum(crcs) == 0, "an unchanged file was checked again"


@pytest.mark.usefixtures("settled")
@pytest.mark.parametrize(
    "change",
    ["in place", "in place, modification time put back", "replaced by a rename", "a new manifest"],
)
def test_a_changed_file_or_manifest_is_checked_again(tmp_path: Path, change: str) -> None:
    folder = tmp_path / "model"
    write_sharded(folder, shards())
    with_manifest(folder)
    where = str(tmp_path / "checks")
    loaded(folder, checks_dir=where)
    victim = folder / "model-00002-of-00002.safetensors"
    size = victim.stat().st_size
    if change == "in place":
        flip(victim, size // 2)
    elif change == "in place, modification time put back":
        st = victim.stat()
        flip(victim, size // 2)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert victim.stat().st_mtime_ns == st.st_mtime_ns
    elif change == "replaced by a rename":
        data = bytearray(victim.read_bytes())
        data[size // 2] ^= 0x40
        (folder / "new").write_bytes(bytes(data))
        st = victim.stat()
        os.utime(folder / "new", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(folder / "new", victim)
    else:  # the same files, checked against other checksums: checked again, and recorded apart
        with_manifest(folder, piece=PIECE * 2)
        _, stats = loaded(folder, checks_dir=where)
        assert stats.recalled_bytes == 0 and stats.checked_bytes == sizes(folder)
        assert len(records(tmp_path)) == 4
        _, stats = loaded(folder, checks_dir=where)
        assert stats.recalled_bytes == sizes(folder)
        return
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        loaded(folder, checks_dir=where)
    assert info.value.uri is not None and victim.name in info.value.uri
    with pytest.raises(FormatError, match="checksum mismatch"):  # and it is not recorded as passed
        loaded(folder, checks_dir=where)


def test_a_file_changed_just_before_its_check_is_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule with the kernel's own figures (35 s by default): a file written through a shared
    mapping, its writer gone, is not recorded while a page could still be dirty from a write that
    changed no time; with a rule of one clock tick (2 s), it is, once the tick is past."""
    import mmap

    folder = tmp_path / "model"
    want = write_sharded(folder, shards()[:1], index=False)
    with_manifest(folder)
    victim = next(folder.glob("*.safetensors"))
    with open(victim, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[-1] = m[-1]  # a write through a shared mapping: the page is dirty, the times change
    where = str(tmp_path / "checks")
    assert passed.settle_ns() > 2_000_000_000
    got, stats = loaded(folder, checks_dir=where)
    assert_same(got, want)
    assert stats.checked_bytes == sizes(folder) and records(tmp_path) == []
    monkeypatch.setattr(passed, "SETTLE_NS", 2_000_000_000)
    time.sleep(2.2)
    _, stats = loaded(folder, checks_dir=where)
    assert stats.recalled_bytes == 0 and len(records(tmp_path)) == 1
    assert loaded(folder, checks_dir=where)[1].recalled_bytes == sizes(folder)


def test_how_long_a_change_is_waited_out_comes_from_the_kernel() -> None:
    centis = [int(Path(f"/proc/sys/vm/dirty_{n}_centisecs").read_text()) for n in ("expire", "writeback")]
    if centis[1] == 0:
        assert passed.settle_ns() >= 1 << 62  # no periodic writeback: never settled
    else:
        assert passed.settle_ns() == 2_000_000_000 + sum(centis) * 10_000_000


@pytest.mark.usefixtures("settled")
@pytest.mark.parametrize("writer", ["another process", "a shared mapping"])
def test_a_file_open_for_writing_is_neither_recorded_nor_taken_as_recorded(
    tmp_path: Path, writer: str
) -> None:
    """A process holding the file open for writing could write through a shared mapping into a
    page already dirty, which changes no time: while one does, no check is recorded and no
    record is used."""
    import mmap

    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        write_sharded(folder, shards()[:1], index=False)
        with_manifest(folder)
        victim = next(folder.glob("*.safetensors"))
        where = str(tmp_path / "checks")
        with contextlib.ExitStack() as held:
            if writer == "another process":
                code = f"import sys; f = open({str(victim)!r}, 'r+b'); print(1, flush=True); sys.stdin.read()"
                proc = subprocess.Popen(
                    [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
                )
                held.callback(proc.communicate, b"")
                assert proc.stdout is not None and proc.stdout.readline().strip() == b"1"
            else:
                f = held.enter_context(open(victim, "r+b"))
                m = held.enter_context(mmap.mmap(f.fileno(), 0))
                m[-1] = m[-1]  # dirty: later writes through it change no time
            _, stats = loaded(folder, checks_dir=where)
            assert stats.checked_bytes == sizes(folder) and records(tmp_path) == []
        _, stats = loaded(folder, checks_dir=where)  # the writer is gone: recorded now
        assert len(records(tmp_path)) == 1
        with contextlib.ExitStack() as held:
            f = held.enter_context(open(victim, "r+b"))  # open for writing again: the record is not used
            _, stats = loaded(folder, checks_dir=where)
            assert stats.recalled_bytes == 0 and stats.checked_bytes == sizes(folder)
        assert loaded(folder, checks_dir=where)[1].recalled_bytes == sizes(folder)
    finally:
        shutil.rmtree(folder)


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Callable[[str, str, str], Path]]:
    """``mounted(type, name, options)``: a file system of that type mounted at ``tmp_path/name``
    (CI runs as root), unmounted at the end."""
    points: list[Path] = []

    def mount(kind: str, name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(["mount", "-t", kind, "-o", options, kind, str(point)], capture_output=True)
        if done.returncode != 0:
            pytest.fail(f"mounting {kind} needs root (as CI runs): {done.stderr.decode().strip()}")
        points.append(point)
        return point

    yield mount
    for point in reversed(points):
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.mark.usefixtures("settled")
@pytest.mark.parametrize("where", ["tmpfs", "an overlay written to tmpfs"])
def test_no_record_where_a_mapped_write_leaves_the_times(
    tmp_path: Path, mounted: Callable[[str, str, str], Path], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """On tmpfs a shared mapping's page is writable from its first fault, a read's included: a
    process that maps the file, reads it, writes it and goes leaves its times as they were. So
    no check is recorded there, and a record made there before this rule (made here by
    switching the rule off) vouches for nothing: the change is found."""
    import mmap

    if where == "tmpfs":
        base = mounted("tmpfs", "fs", "size=64m")
    else:
        upper = mounted("tmpfs", "upper", "size=64m")
        (upper / "data").mkdir()
        (upper / "work").mkdir()
        (tmp_path / "lower").mkdir()
        layers = f"lowerdir={tmp_path / 'lower'},upperdir={upper / 'data'},workdir={upper / 'work'}"
        base = mounted("overlay", "merged", layers)
    folder = base / "model"
    want = write_sharded(folder, shards()[:1], index=False)
    with_manifest(folder)
    where_checks = str(tmp_path / "checks")
    got, stats = loaded(folder, checks_dir=where_checks)
    assert_same(got, want)
    assert stats.checked_bytes == sizes(folder) and records(tmp_path) == []
    with monkeypatch.context() as rule_off:
        rule_off.setattr(passed, "times_miss_writes", lambda path: None)
        loaded(folder, checks_dir=where_checks)
    assert len(records(tmp_path)) == 1

    victim = next(folder.glob("*.safetensors"))
    before = file_identity(victim.stat())
    at = victim.stat().st_size // 2
    with open(victim, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        byte = m[at]  # a read fault first: the page is mapped writable
        m[at] = byte ^ 0x40
    assert file_identity(victim.stat()) == before, "this kernel changed the times: the case is not made"
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        loaded(folder, checks_dir=where_checks)
    assert info.value.uri is not None and victim.name in info.value.uri


@pytest.mark.usefixtures("settled")
def test_a_file_written_while_a_load_takes_it_as_recorded_fails_the_load(tmp_path: Path) -> None:
    """Pieces a record vouches for are not read through the check: a write during the load (it
    changes the file's times) fails it, naming the file, and a stream hands over no tensor of
    a block read after the write (each block's file is looked at again before its tensors go
    out), as the check itself would not."""
    folder = tmp_path / "model"
    want = write_sharded(folder, shards()[:1], index=False)
    with_manifest(folder)
    where = str(tmp_path / "checks")
    loaded(folder, checks_dir=where)
    victim = next(folder.glob("*.safetensors"))
    config = ws.StreamConfig(checks_dir=where, chunk_size=64 << 10, memory_limit=256 << 10, concurrency=1)
    got = {}
    with pytest.raises(FormatError, match="changed while it was read") as info:
        for name, tensor in ws.stream(folder, config=config):
            if not got:
                flip(victim, victim.stat().st_size - 1)
            got[name] = tensor.clone()
    assert info.value.uri is not None and victim.name in info.value.uri
    assert info.value.byte_range == (0, victim.stat().st_size)
    assert got and set(got) < set(want)
    for name, tensor in got.items():  # what was handed over is what was checked
        assert_same({name: tensor}, {name: want[name]})
    with pytest.raises(FormatError, match="checksum mismatch"):  # no record vouches for it now
        loaded(folder, checks_dir=where)


@pytest.mark.usefixtures("settled")
def test_a_partial_load_records_the_pieces_it_checked(tmp_path: Path, crcs: list[int]) -> None:
    folder = tmp_path / "model"
    want = write_sharded(folder, shards())
    with_manifest(folder)
    where = str(tmp_path / "checks")
    with ws.open_checkpoint(folder, config=ws.StreamConfig(checks_dir=where)) as ck:
        assert_same(ck.load(tensors=["s1.t3", "s1.t4"]), {n: want[n] for n in ("s1.t3", "s1.t4")})
        part = ck.last_stats
    assert part is not None and part.checked_bytes > 0 and part.recalled_bytes == 0
    crcs.clear()
    got, stats = loaded(folder, checks_dir=where)
    assert_same(got, want)
    assert stats.recalled_bytes == part.checked_bytes  # those pieces, and only those
    assert stats.checked_bytes == sizes(folder)
    assert sum(crcs) <= sizes(folder) - part.checked_bytes + 2 * 4096


@pytest.mark.usefixtures("settled")
def test_the_hubs_sha256_is_not_computed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "model"
    want = local_dir(folder, shards())
    where = str(tmp_path / "checks")
    got, stats = loaded(folder, verify="on", checks_dir=where)
    assert_same(got, want)
    assert stats.checked_bytes == sizes(folder) and stats.recalled_bytes == 0
    hashed: list[str] = []
    real = verify_module.hashlib.new
    monkeypatch.setattr(verify_module.hashlib, "new", lambda name, *a: hashed.append(name) or real(name, *a))
    got, stats = loaded(folder, verify="on", checks_dir=where)
    assert_same(got, want)
    assert stats.recalled_bytes == sizes(folder) and hashed == []
    flip(next(folder.glob("*.safetensors")), 1000)
    with pytest.raises(FormatError, match="checksum mismatch"):
        loaded(folder, verify="on", checks_dir=where)


@pytest.mark.usefixtures("settled")
def test_off_and_a_folder_that_cannot_be_written(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "model"
    write_sharded(folder, shards())
    with_manifest(folder)
    for _ in range(2):
        _, stats = loaded(folder, checks_dir="off")
        assert stats.recalled_bytes == 0 and stats.checked_bytes == sizes(folder)
    blocker = tmp_path / "a file"
    blocker.write_text("")
    caplog.set_level("INFO", logger="weightstream")
    for _ in range(2):  # the load goes on, checking everything, and says why once
        _, stats = loaded(folder, checks_dir=str(blocker / "checks"))
        assert stats.recalled_bytes == 0 and stats.checked_bytes == sizes(folder)
    assert any("not kept" in r.message for r in caplog.records)


@pytest.mark.usefixtures("settled")
def test_a_folder_others_may_write_in_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A record written by someone else would let a changed file through unchecked."""
    folder = tmp_path / "model"
    write_sharded(folder, shards()[:1], index=False)
    with_manifest(folder)
    where = tmp_path / "checks"
    loaded(folder, checks_dir=str(where))
    assert len(records(tmp_path)) == 1 and where.stat().st_mode & 0o777 == 0o700  # made private
    where.chmod(0o777)
    caplog.set_level("INFO", logger="weightstream")
    _, stats = loaded(folder, checks_dir=str(where))
    assert stats.recalled_bytes == 0 and stats.checked_bytes == sizes(folder)
    assert any("others may write" in r.message for r in caplog.records)
    where.chmod(0o700)
    assert loaded(folder, checks_dir=str(where))[1].recalled_bytes == sizes(folder)


@pytest.mark.usefixtures("settled")
@pytest.mark.parametrize("damage", ["truncated", "not json", "another file's", "pieces out of range"])
def test_a_damaged_record_counts_as_none(tmp_path: Path, damage: str) -> None:
    folder = tmp_path / "model"
    write_sharded(folder, shards()[:1], index=False)
    with_manifest(folder)
    where = str(tmp_path / "checks")
    loaded(folder, checks_dir=where)
    (record,) = records(tmp_path)
    text = record.read_text()
    doc = json.loads(text)
    if damage == "truncated":
        record.write_text(text[: len(text) // 2])
    elif damage == "not json":
        record.write_bytes(b"\xff" * 40)
    elif damage == "another file's":
        record.write_text(json.dumps(doc | {"identity": "1:2:3:4:5"}))
    else:
        record.write_text(json.dumps(doc | {"pieces": [[10_000, 10_002], [-3, -1]]}))
    _, stats = loaded(folder, checks_dir=where)
    assert stats.recalled_bytes == 0 and stats.checked_bytes == sizes(folder)


def test_a_record_is_this_machines_and_boots(tmp_path: Path) -> None:
    """A folder shared by machines (a home on NFS): another machine's record of a file with the
    same device, inode, size and times vouches for nothing here."""
    write_sharded(tmp_path / "m", [{"t": random_tensor((64,), torch.float32)}], index=False)
    f = next((tmp_path / "m").glob("*.safetensors"))
    size = f.stat().st_size
    seen = (file_identity(f.stat()), FileDigest(f.name, size, 0, size, (0,)))
    here = passed.PassedChecks(str(tmp_path / "checks"), settle_ns=0)
    other = passed.PassedChecks(str(tmp_path / "checks"), settle_ns=0, node_id="another machine")
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert here.node == passed.node() == boot_id
    assert other.add(str(f), *seen, [0], began_ns=time.time_ns())
    assert here.known(str(f), *seen) == frozenset() and other.known(str(f), *seen) == {0}
    assert here.add(str(f), *seen, [0], began_ns=time.time_ns())
    assert here.known(str(f), *seen) == {0}
    (record,) = [p for p in records(tmp_path) if json.loads(p.read_text())["node"] == boot_id]
    record.write_text(json.dumps(json.loads(record.read_text()) | {"node": "another machine"}))
    assert here.known(str(f), *seen) == frozenset()  # a record that says another machine's


def test_the_folder_keeps_the_most_recently_used_records(tmp_path: Path) -> None:
    files = []
    for i in range(5):
        write_sharded(tmp_path / f"m{i}", [{"t": random_tensor((64,), torch.float32, seed=i)}], index=False)
        files.append(next((tmp_path / f"m{i}").glob("*.safetensors")))
    keep = passed.PassedChecks(str(tmp_path / "checks"), settle_ns=0, max_records=3)
    now = time.time_ns()
    seen = {}
    for f in files:
        size = f.stat().st_size
        seen[f] = (file_identity(f.stat()), FileDigest(f.name, size, 0, size, (0,)))
        assert keep.add(str(f), *seen[f], [0], began_ns=now)
        time.sleep(0.02)
        assert keep.known(str(files[0]), *seen[files[0]]) == {0}  # used: kept
    assert len(records(tmp_path)) == 3
    assert keep.known(str(files[1]), *seen[files[1]]) == frozenset()
    assert keep.known(str(files[2]), *seen[files[2]]) == frozenset()
    assert keep.known(str(files[4]), *seen[files[4]]) == {0}
    assert not keep.add(str(files[4]), *seen[files[4]], [0], began_ns=now)  # nothing new to say


def test_the_settings_front_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSTREAM_CHECKS_DIR", "off")
    assert ws.StreamConfig.from_env().checks_dir == "off"
    assert passed.checks_folder(ws.StreamConfig(checks_dir="off")) is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert passed.checks_folder(ws.StreamConfig()) == str(tmp_path / "xdg" / "weightstream" / "checks")
    assert passed.checks_folder(ws.StreamConfig(cache_dir=str(tmp_path / "nvme"))) == str(
        tmp_path / "nvme" / "checks"
    )
    with pytest.raises(ws.errors.ConfigError, match="checks_dir"):
        ws.StreamConfig(checks_dir="s3://bucket/checks")
    assert MANIFEST_NAME  # the manifest the checks come from keeps its name


@pytest.mark.usefixtures("settled")
def test_the_command_line_says_what_an_earlier_load_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "model"
    write_sharded(folder, shards())
    with_manifest(folder)
    argv = ["load", str(folder), "--checks-dir", str(tmp_path / "checks"), "--no-progress"]
    assert cli(argv) == 0
    first = capsys.readouterr().out
    assert "checked " in first and "earlier load" not in first
    assert cli(argv) == 0
    assert "of it by an earlier load of the same files" in capsys.readouterr().out
    assert cli([*argv[:2], "--checks-dir", "off", "--no-progress"]) == 0
    assert "earlier load" not in capsys.readouterr().out


_ADDER = r"""
import os, sys, time
sys.path[:0] = sys.argv[1:2]
from weightstream.cache.passed import PassedChecks
from weightstream.format.manifest import FileDigest
path, identity, folder, me, ranks, pieces, go = sys.argv[2], sys.argv[3], sys.argv[4], *map(int, sys.argv[5:8]), sys.argv[8]
digest = FileDigest("f", pieces, 0, 1, tuple(range(pieces)))
checks = PassedChecks(folder, settle_ns=0)
while not os.path.exists(go):
    time.sleep(0.0002)
for i in range(me, pieces, ranks):
    checks.add(path, identity, digest, [i], began_ns=time.time_ns())
"""


def test_ranks_adding_pieces_to_one_record_at_once_lose_none(tmp_path: Path) -> None:
    """Ranks on one node that each check their own part of a file write down their pieces at
    the same time: a record read, merged and renamed by each at once would keep only the last
    writer's. All the pieces passed are in the record at the end."""
    f = tmp_path / "f"
    ranks, pieces = 4, 160
    f.write_bytes(bytes(pieces))
    identity = file_identity(f.stat())
    go = tmp_path / "go"
    src = str(Path(ws.__file__).resolve().parents[1])
    args = [src, str(f), identity, str(tmp_path / "checks")]
    procs = [
        subprocess.Popen([sys.executable, "-c", _ADDER, *args, str(me), str(ranks), str(pieces), str(go)])
        for me in range(ranks)
    ]
    time.sleep(0.5)  # the interpreters are up
    go.touch()
    assert [p.wait(timeout=60) for p in procs] == [0] * ranks
    digest = FileDigest("f", pieces, 0, 1, tuple(range(pieces)))
    got = passed.PassedChecks(str(tmp_path / "checks"), settle_ns=0).known(str(f), identity, digest)
    assert sorted(got) == list(range(pieces)), f"{pieces - len(got)} pieces lost"


def test_a_folder_held_locked_delays_a_record_only_briefly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process stopped while holding the records' lock does not hold up a load's end: the
    record is written without it once the wait is over, and the log says so."""
    f = tmp_path / "f"
    f.write_bytes(bytes(8))
    folder = tmp_path / "checks"
    checks = passed.PassedChecks(str(folder), settle_ns=0)
    digest = FileDigest("f", 8, 0, 1, tuple(range(8)))
    assert checks.trusted()
    monkeypatch.setattr(passed, "LOCK_WAIT_S", 0.2)
    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.lockf(fd, fcntl.LOCK_EX); print(1, flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(folder / ".lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"1"
        caplog.set_level("INFO", logger="weightstream.cache.passed")
        assert checks.add(str(f), file_identity(f.stat()), digest, [1, 2], began_ns=time.time_ns())
    finally:
        holder.communicate(b"")
    assert checks.known(str(f), file_identity(f.stat()), digest) == {1, 2}
    assert "written without a lock" in caplog.text


def test_threads_adding_at_once_lose_none_and_a_fork_inherits_no_lock(tmp_path: Path) -> None:
    """Threads of one process add to one record at once and lose nothing; a process forked
    while a thread holds the lock starts with none held (it would otherwise hold up every
    later record on the node until it exits)."""
    import fcntl
    import threading

    f = tmp_path / "f"
    f.write_bytes(bytes(8))
    identity = file_identity(f.stat())
    pieces = 120
    digest = FileDigest("f", pieces, 0, 1, tuple(range(pieces)))
    checks = passed.PassedChecks(str(tmp_path / "checks"), settle_ns=0)

    def adder(me: int) -> None:
        for i in range(me, pieces, 4):
            checks.add(str(f), identity, digest, [i], began_ns=time.time_ns())

    threads = [threading.Thread(target=adder, args=(me,)) for me in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(checks.known(str(f), identity, digest)) == list(range(pieces))

    released, wait = os.pipe()[::-1]
    with checks._locked():  # as a thread adding would hold it
        pid = os.fork()
        if pid == 0:  # the child: once the parent has let go, both locks are free
            code = 1
            try:
                os.read(wait, 1)
                fd = os.open(tmp_path / "checks" / ".lock", os.O_RDWR)
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                code = 0 if passed._ADDING.acquire(blocking=False) else 2
            finally:
                os._exit(code)
    os.write(released, b"x")
    _, status = os.waitpid(pid, 0)
    os.close(released)
    os.close(wait)
    assert os.waitstatus_to_exitcode(status) == 0
