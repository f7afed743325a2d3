"""Streams that lend the page cache (``borrow_cached=True``, issue 22: vLLM's hot loads).

The rules tested: blocks the page cache holds are handed out as views of a private mapping of the
file (not read, not copied), the rest is read, and every tensor is bit-exact in any mix of the
two; writing into a view never reaches the file; a file that another process opens for writing,
truncates or cannot be leased is never handed out changed (the writer waits, the stream raises
ReadError naming the file, the process never sees SIGBUS), while a file replaced by a rename is
read whole from the inode the header came from; load(), CUDA and distributed loads keep memory
of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import weightstream as ws

from ..conftest import (
    assert_same,
    drop_from_page_cache,
    random_tensor,
    reference,
    reference_folder,
    write_sharded,
)

MiB = 1 << 20


def make(folder: Path) -> Path:
    shards = [
        {f"a.{i}": random_tensor((257 + i, 1031), torch.float32, seed=i) for i in range(6)},
        {
            "b.big": random_tensor((3 * MiB + 5,), torch.uint8, seed=50),
            "b.half": random_tensor((999, 517), torch.bfloat16, seed=51),
            "b.odd": random_tensor((13,), torch.int16, seed=52),
            "b.empty": torch.empty((0, 3)),
        },
    ]
    write_sharded(folder, shards)
    return folder


def warm(folder: Path) -> None:
    for f in folder.glob("*.safetensors"):
        f.read_bytes()


def cold(folder: Path) -> None:
    for f in folder.glob("*.safetensors"):
        drop_from_page_cache(f)


def every_other_mib_cached(folder: Path) -> None:
    warm(folder)
    for f in folder.glob("*.safetensors"):
        for off in range(MiB, f.stat().st_size, 2 * MiB):
            drop_from_page_cache(f, off, MiB)


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path`` (/proc/self/maps)."""
    out = []
    real = os.path.realpath(path)
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == real:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def leased(path: Path) -> bool:
    """Whether a read lease holds the file (``/proc/locks``; a probe that opened the file for
    writing would break the lease it looks for)."""
    st = os.stat(path)
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "LEASE" in fields and "READ" in fields:
            dev_ino = fields[fields.index("READ") + 2]
            maj, mino, ino = dev_ino.split(":")
            if int(ino) == st.st_ino and os.makedev(int(maj, 16), int(mino, 16)) == st.st_dev:
                return True
    return False


def test_a_hot_checkpoint_is_lent_from_the_page_cache_not_read(tmp_path: Path) -> None:
    folder = make(tmp_path / "ck")
    want = reference_folder(folder)
    warm(folder)
    files = sorted(folder.glob("*.safetensors"))
    file_of = {name: f for f in files for name in reference(f)}
    inside: dict[str, bool] = {}
    released: list[bool] = []
    got = {}
    with ws.stream(folder, borrow_cached=True, config=ws.StreamConfig(chunk_size=MiB)) as s:
        for name, t in s:
            ranges = [r for f in files for r in mapped_ranges(f)]
            assert leased(file_of[name])  # no writer gets in while the view is used
            if file_of[name] == files[1]:  # the first file's views were all taken
                released.append(not leased(files[0]) and not mapped_ranges(files[0]))
            ptr = t.data_ptr()
            inside[name] = t.numel() == 0 or any(lo <= ptr < hi for lo, hi in ranges)
            got[name] = t.clone()
    assert_same(got, want)
    assert all(inside.values()), [n for n, ok in inside.items() if not ok]
    # ... and once none of them was held any more (the loop's `t` holds the last one while the
    # next is asked for), the first file was let go while the load went on
    assert released and released[-1]
    st = s.stats
    assert st.complete and st.bytes_read == 0 and st.mapped_bytes >= st.bytes
    assert not leased(files[0])  # the lease went with the stream


def test_a_cold_checkpoint_is_read_as_before(tmp_path: Path) -> None:
    folder = make(tmp_path / "ck")
    want = reference_folder(folder)
    cold(folder)
    with ws.stream(folder, borrow_cached=True) as s:
        got = {n: t.clone() for n, t in s}
    assert_same(got, want)
    assert s.stats.mapped_bytes == 0 and s.stats.bytes_read >= s.stats.bytes


@pytest.mark.parametrize("part", ["first", "second", "alternate"])
def test_any_mix_of_cached_and_cold_blocks_is_exact(tmp_path: Path, part: str) -> None:
    folder = make(tmp_path / "ck")
    want = reference_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    cold(folder)
    if part == "first":
        files[0].read_bytes()
    elif part == "second":
        files[1].read_bytes()
    else:
        every_other_mib_cached(folder)
    with ws.stream(folder, borrow_cached=True, config=ws.StreamConfig(chunk_size=MiB)) as s:
        got = {n: t.clone() for n, t in s}
    assert_same(got, want)
    st = s.stats
    assert st.complete and st.mapped_bytes > 0 and st.bytes_read > 0
    assert st.mapped_bytes + st.bytes_read >= st.bytes


def test_writing_into_a_lent_tensor_never_reaches_the_file(tmp_path: Path) -> None:
    folder = make(tmp_path / "ck")
    before = {f.name: f.read_bytes() for f in folder.glob("*.safetensors")}
    with ws.stream(folder, borrow_cached=True) as s:
        for _, t in s:
            t.view(torch.uint8).fill_(0xAB) if t.numel() else None
    assert s.stats.mapped_bytes > 0
    assert {f.name: f.read_bytes() for f in folder.glob("*.safetensors")} == before


# A writer tries while the stream is between two blocks: it must wait for the stream, and the
# stream must fail before anything changes. Run in a child process: a SIGBUS (a truncated
# mapping touched) ends it with -7 instead of taking the test runner down.
CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys, time, torch, weightstream as ws
    folder, action = sys.argv[1], sys.argv[2]
    target = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))[1]
    path = os.path.join(folder, target)
    size = os.path.getsize(path)
    writer = {
        "truncate": f"os.truncate({path!r}, 64)",
        "overwrite": f"fd = os.open({path!r}, os.O_WRONLY); os.pwrite(fd, bytes({size}), 0); os.close(fd)",
        "open_trunc": f"open({path!r}, 'wb').close()",
    }[action]
    got, error, started = {}, None, None
    cfg = ws.StreamConfig(chunk_size=1 << 20)
    with ws.stream(folder, borrow_cached=True, config=cfg) as s:
        try:
            for name, t in s:
                got[name] = t.clone().view(torch.uint8).reshape(-1).tolist()[:64] if t.numel() else []
                if started is None:
                    started = subprocess.Popen([sys.executable, "-c", "import os; " + writer])
                    time.sleep(0.5)  # the writer is now waiting in open() / truncate()
                t.sum()  # touch every byte of the view
        except ws.errors.WeightStreamError as exc:
            error = [type(exc).__name__, str(exc)]
    started.wait()
    print(json.dumps({"error": error, "got": got, "mapped": s.stats.mapped_bytes}))
    """
)


@pytest.mark.parametrize("action", ["truncate", "overwrite", "open_trunc"])
def test_a_writer_during_the_stream_waits_and_the_stream_fails_before_any_change(
    tmp_path: Path, action: str
) -> None:
    import json

    folder = make(tmp_path / "ck")
    want = {
        k: v.contiguous().view(torch.uint8).reshape(-1).tolist()[:64]
        for k, v in reference_folder(folder).items()
    }
    warm(folder)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), action], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["mapped"] > 0
    assert res["error"] is not None and res["error"][0] == "ReadError", res["error"]
    assert "opened the file for writing or truncated it" in res["error"][1]
    assert "model-00002-of-00002.safetensors" in res["error"][1]
    # every tensor handed out before the error holds the bytes of the file as it was
    assert res["got"] and all(res["got"][k] == want[k] for k in res["got"])
    assert len(res["got"]) < len(want)  # and the stream stopped: nothing partial as complete


def test_a_file_replaced_by_a_rename_is_read_whole_from_the_first_one(tmp_path: Path) -> None:
    folder = make(tmp_path / "ck")
    want = reference_folder(folder)
    warm(folder)
    target = sorted(folder.glob("*.safetensors"))[1]
    got = {}
    with ws.stream(folder, borrow_cached=True) as s:
        for i, (name, t) in enumerate(s):
            if i == 0:  # a downloader's way: a new file, renamed over the old one
                tmp = target.with_suffix(".tmp")
                tmp.write_bytes(bytes(target.stat().st_size))
                os.replace(tmp, target)
            got[name] = t.clone()
    assert_same(got, want)
    assert s.stats.complete


def test_a_file_that_cannot_be_leased_is_read_not_lent(tmp_path: Path) -> None:
    folder = make(tmp_path / "ck")
    want = reference_folder(folder)
    warm(folder)
    held = [os.open(f, os.O_RDWR) for f in folder.glob("*.safetensors")]  # open for writing here
    try:
        with ws.stream(folder, borrow_cached=True) as s:
            got = {n: t.clone() for n, t in s}
    finally:
        for fd in held:
            os.close(fd)
    assert_same(got, want)
    assert s.stats.mapped_bytes == 0 and s.stats.bytes_read >= s.stats.bytes


def test_load_and_plain_streams_keep_memory_of_their_own(tmp_path: Path) -> None:
    folder = make(tmp_path / "ck")
    warm(folder)
    files = sorted(folder.glob("*.safetensors"))
    got = ws.load(folder)
    ranges = [r for f in files for r in mapped_ranges(f)]
    assert not any(lo <= t.data_ptr() < hi for t in got.values() for lo, hi in ranges)
    with ws.stream(folder) as s:
        for _, t in s:
            ranges = [r for f in files for r in mapped_ranges(f)]
            assert not any(lo <= t.data_ptr() < hi for lo, hi in ranges)
    assert s.stats.mapped_bytes == 0


def test_a_lent_stream_closed_early_lets_writers_in(tmp_path: Path) -> None:
    folder = make(tmp_path / "ck")
    warm(folder)
    s = ws.stream(folder, borrow_cached=True)
    next(iter(s))
    assert all(leased(f) for f in folder.glob("*.safetensors"))
    s.close()
    assert not any(leased(f) for f in folder.glob("*.safetensors"))


def test_a_file_is_said_cached_only_as_far_as_the_page_cache_holds_it(tmp_path: Path) -> None:
    from weightstream.sources.mapping import cached_fraction

    folder = make(tmp_path / "ck")
    files = sorted(folder.glob("*.safetensors"))
    cold(folder)
    assert all(cached_fraction(str(f)) == 0 for f in files)
    files[0].read_bytes()
    assert cached_fraction(str(files[0])) == 1 and cached_fraction(str(files[1])) == 0
    warm(folder)
    drop_from_page_cache(files[1], 0, files[1].stat().st_size // 2 // 4096 * 4096)
    assert 0.3 < cached_fraction(str(files[1])) < 0.7
    assert cached_fraction(str(tmp_path / "missing")) == 0 and cached_fraction("s3://bucket/key") == 0


def with_manifest(folder: Path, piece: int = 64 << 10) -> None:
    """The folder's manifest beside its index, of small pieces (many a file)."""
    from weightstream.format.manifest import MANIFEST_NAME, dump_manifest
    from weightstream.tools.manifest import digests

    with ws.open_checkpoint(folder, config=ws.StreamConfig(verify="off")) as ck:
        found = digests(ck, piece_size=piece)
    (folder / MANIFEST_NAME).write_text(dump_manifest(found, piece_size=piece))


@pytest.mark.parametrize("part", ["hot", "alternate"])
def test_lent_blocks_are_checked_against_the_manifest(tmp_path: Path, part: str) -> None:
    """With a manifest, a stream still lends what the page cache holds (a check used to turn
    lending off: a vLLM-like hot load 2.7x slower than lent), and every byte, lent or read, is checked."""
    folder = make(tmp_path / "ck")
    want = reference_folder(folder)
    with_manifest(folder)
    warm(folder)
    if part == "alternate":
        every_other_mib_cached(folder)
    with ws.stream(folder, borrow_cached=True, config=ws.StreamConfig(chunk_size=MiB)) as s:
        got = {n: t.clone() for n, t in s}
    assert_same(got, want)
    st = s.stats
    assert st.complete and st.mapped_bytes > 0 and (st.bytes_read > 0) == (part == "alternate")
    assert st.checked_bytes == sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert st.unchecked_bytes == 0


def test_a_changed_byte_in_a_lent_block_fails_before_its_piece_is_handed_over(tmp_path: Path) -> None:
    from weightstream.errors import FormatError

    from ..conftest import flip

    folder = make(tmp_path / "ck")
    with_manifest(folder)
    victim = sorted(folder.glob("*.safetensors"))[1]
    with ws.open_checkpoint(folder, config=ws.StreamConfig(verify="off")) as ck:
        big = (ck.tensors["b.big"].start, ck.tensors["b.big"].end)
    bad = big[0] + 2 * MiB + 123
    flip(victim, bad)  # through the page cache: the file stays hot
    warm(folder)
    piece = (bad // (64 << 10) * (64 << 10), bad // (64 << 10) * (64 << 10) + (64 << 10))
    handed: list[str] = []
    with (
        pytest.raises(FormatError, match="checksum mismatch") as info,
        ws.stream(folder, borrow_cached=True) as s,
    ):
        for name, _ in s:
            handed.append(name)
    assert info.value.uri is not None and victim.name in info.value.uri
    assert info.value.byte_range == piece
    assert s.stats.mapped_bytes > 0  # the bad bytes were lent, not read
    assert "b.big" not in handed  # nothing of the bad piece was handed over


# A consumer that keeps lent tensors (views of the mapping): they must stay readable and exact
# for as long as they are held, after the file was let go and after the stream. A mapping closed
# under a view crashed the process on the next touch (SIGSEGV), so this runs in a child process.
KEEPER = textwrap.dedent(
    """
    import gc, json, os, sys, torch, weightstream as ws
    from safetensors.torch import load
    folder, how = sys.argv[1], sys.argv[2]
    sys.path.insert(0, sys.argv[3])
    from tests.functional.test_borrow_cached import leased, mapped_ranges
    files = sorted(os.path.join(folder, p) for p in os.listdir(folder) if p.endswith(".safetensors"))
    want = {k: v for f in files for k, v in load(open(f, "rb").read()).items()}  # no mapping of its own
    cfg = ws.StreamConfig(chunk_size=1 << 20, verify="auto")
    kept, first_leased_later = {}, []
    with ws.stream(folder, borrow_cached=True, config=cfg) as s:
        for name, t in s:
            if how == "all" or name not in want or name == "a.0":
                kept[name] = t  # the view itself, not a copy
            if name.startswith("b."):  # the second file: the first one's view is still held
                first_leased_later.append(leased(files[0]))
    after = {"leased": [leased(f) for f in files], "mapped": [bool(mapped_ranges(f)) for f in files]}
    def raw(t):  # bit for bit (random bits hold NaNs)
        return t.contiguous().reshape(-1).view(torch.uint8)
    exact = {n: bool(torch.equal(raw(t), raw(want[n]))) for n, t in kept.items()}  # touches every byte
    del t, kept
    gc.collect()
    print(json.dumps({
        "exact": exact, "mapped_bytes": s.stats.mapped_bytes, "checked": s.stats.checked_bytes,
        "first_leased_later": first_leased_later, "after": after,
        "mapped_at_the_end": [bool(mapped_ranges(f)) for f in files],
    }))
    """
)


@pytest.mark.parametrize("checked", [False, True], ids=["plain", "checked"])
@pytest.mark.parametrize("how", ["all", "one"])
def test_lent_tensors_kept_by_the_consumer_stay_readable_and_exact(
    tmp_path: Path, checked: bool, how: str
) -> None:
    """Kept views are never unmapped under the consumer: not when their file's views were all
    taken (the file is let go only once none is held), not when blocks are held back until their
    piece is checked (a manifest of pieces larger than a block), not after the stream ends. The
    lease lasts as long as the stream, and the pages go with the last view."""
    import json

    folder = make(tmp_path / "ck")
    if checked:
        with_manifest(folder, piece=4 * MiB)  # pieces span blocks: blocks are held until checked
    warm(folder)
    out = subprocess.run(
        [sys.executable, "-c", KEEPER, str(folder), how, str(Path(__file__).parents[2])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["mapped_bytes"] > 0
    assert res["exact"] and all(res["exact"].values()), res["exact"]
    if how == "all":
        assert len(res["exact"]) == len(reference_folder(folder))
    else:
        assert list(res["exact"]) == ["a.0"]
    if checked:
        assert res["checked"] == sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    # a view of the first file was held while the second streamed: its lease held too
    assert res["first_leased_later"] and all(res["first_leased_later"])
    assert res["after"]["leased"] == [False, False]  # the promise ends with the stream
    assert res["after"]["mapped"][0]  # the pages under the kept views stayed mapped
    assert res["mapped_at_the_end"] == [False, False]  # and went with the last view
