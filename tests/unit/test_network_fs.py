"""Which paths lie on a network file system (the mount table's rule), and what a load there
starts with: a deeper queue and more memory in flight, unless they were chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightstream.config import (
    DEFAULT_MEMORY_LIMIT,
    NETWORK_FS_CONCURRENCY,
    NETWORK_FS_MEMORY_LIMIT,
    StreamConfig,
    network_fs_memory_limit,
)
from weightstream.localfs import mount_table, network_file_system, times_miss_writes

TABLE = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / /mnt/models rw,relatime shared:2 - nfs4 server:/export rw,vers=4.2,rsize=1048576
31 30 8:2 / /mnt/models/scratch rw shared:3 - xfs /dev/sdb1 rw
32 22 0:41 / /mnt/with\\040space rw - lustre 10.0.0.1@tcp:/fs rw
33 22 0:42 / /mnt/bucket rw - fuse.s3fs s3fs rw,user_id=0
34 22 0:43 / /mnt/plain-fuse rw - fuse nfsemu rw
35 22 0:44 / /mnt/cg rw - cgroup2 cgroup2 rw
36 22 0:45 / /mnt/cgv1 rw - cgroup cgroup rw,memory
"""


@pytest.fixture
def table(tmp_path: Path) -> str:
    path = tmp_path / "mountinfo"
    path.write_text(TABLE)
    return str(path)


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/mnt/models/llama/model.safetensors", "nfs4"),
        ("/mnt/models", "nfs4"),
        ("/mnt/models/scratch/x.safetensors", None),  # a local disk mounted inside the share
        ("/mnt/modelsX/a", None),  # a prefix of the name is not the folder
        ("/mnt/with space/m", "lustre"),  # the table writes the space as \040
        ("/mnt/bucket/m.safetensors", "fuse.s3fs"),
        ("/mnt/plain-fuse/m", "fuse"),
        ("/home/user/m.safetensors", None),
    ],
)
def test_the_innermost_mount_decides(table: str, path: str, kind: str | None) -> None:
    assert network_file_system(path, table=table) == kind


def test_a_table_that_cannot_be_read_means_local(tmp_path: Path) -> None:
    assert network_file_system("/mnt/models/x", table=str(tmp_path / "missing")) is None
    assert mount_table(str(tmp_path / "missing")) == []


def test_the_table_gives_mount_points_types_and_options(table: str) -> None:
    rows = mount_table(table)
    assert ("/mnt/with space", "lustre", "rw") in rows
    assert ("/mnt/cgv1", "cgroup", "rw,memory") in rows
    assert len(rows) == 8


def test_a_network_file_system_starts_deeper_unless_the_depth_was_chosen() -> None:
    assert StreamConfig().for_network_fs().concurrency == NETWORK_FS_CONCURRENCY
    assert StreamConfig(concurrency=32).for_network_fs().concurrency == 32
    assert StreamConfig(concurrency=16).for_network_fs().concurrency == 16  # chosen, even if 16
    assert StreamConfig(autotune=False).for_network_fs().concurrency == 16  # fixed on purpose
    cfg = StreamConfig(chunk_size=8 << 20, memory_limit=1 << 30)
    assert cfg.for_network_fs().replace(concurrency=None) == cfg  # nothing else changes


GiB = 1 << 30
DEFAULT = DEFAULT_MEMORY_LIMIT


def test_more_memory_in_flight_where_the_host_has_it() -> None:
    # the seed's node: 2 TiB, 8 ranks: 8 GiB each (the simulation's 1.10x of the link)
    assert StreamConfig().for_network_fs(available=2048 * GiB, processes=8).memory_limit == 8 * GiB
    # this machine: 24 GiB, one process: a sixteenth is less than the default, which stays
    assert StreamConfig().for_network_fs(available=24 * GiB).memory_limit == DEFAULT
    assert StreamConfig().for_network_fs(available=64 * GiB).memory_limit == 4 * GiB
    assert StreamConfig().for_network_fs().memory_limit == DEFAULT  # not known: kept
    # chosen, or fixed on purpose: kept
    assert StreamConfig(memory_limit=GiB).for_network_fs(available=2048 * GiB).memory_limit == GiB
    assert StreamConfig(memory_limit=DEFAULT).for_network_fs(available=2048 * GiB).memory_limit == DEFAULT
    fixed = StreamConfig(autotune=False)
    assert fixed.for_network_fs(available=2048 * GiB) == fixed.resolved()


@given(available=st.integers(0, 1 << 50), processes=st.integers(1, 1024), more=st.integers(0, 1 << 45))
def test_the_memory_rule_is_bounded_and_moves_with_the_host(
    available: int, processes: int, more: int
) -> None:
    limit = network_fs_memory_limit(available, processes)
    assert DEFAULT <= limit <= NETWORK_FS_MEMORY_LIMIT and limit % (1 << 20) == 0
    # every loading process on the machine together: a sixteenth of what it has, or the default
    assert limit == DEFAULT or processes * limit <= available // 16
    assert network_fs_memory_limit(available + more, processes) >= limit
    assert network_fs_memory_limit(available, processes + 1) <= limit


def test_an_object_store_load_into_host_memory_takes_the_same_share() -> None:
    """The store's own settings first (depth, read size), then the host's share of memory, by
    the same rule: kept where the host is not known, where a limit is given, and with autotune
    off; the store's depth is never replaced by the file system one."""
    store = StreamConfig().for_remote()
    node = StreamConfig().for_remote(available=2048 * GiB, processes=8)
    assert node.memory_limit == 8 * GiB and node.concurrency == store.concurrency
    assert node.chunk_size == store.chunk_size
    assert store.memory_limit == DEFAULT
    assert StreamConfig(memory_limit=GiB).for_remote(available=2048 * GiB).memory_limit == GiB
    fixed = StreamConfig(autotune=False)
    assert fixed.for_remote(available=2048 * GiB) == fixed.for_remote()


def test_which_file_systems_keep_times_that_follow_every_write(tmp_path: Path) -> None:
    """Where a write can change a file's bytes and not its times (the rule kept checks rest on):
    tmpfs and hugetlbfs (a mapping's pages writable from the first fault), FUSE (the daemon
    gives the times), an overlay whose upper layer is one of those, where it can be seen."""
    up = tmp_path / "up"
    (up / "data").mkdir(parents=True)
    disk = tmp_path / "disk"
    (disk / "data").mkdir(parents=True)
    table = tmp_path / "mountinfo"
    table.write_text(
        TABLE
        + f"""\
40 22 0:50 / /dev/shm rw - tmpfs tmpfs rw,size=1g
41 22 0:51 / /dev rw - devtmpfs udev rw
42 22 0:52 / /mnt/huge rw - hugetlbfs hugetlbfs rw,pagesize=2M
43 22 0:53 / /mnt/ntfs rw - fuseblk /dev/sdc1 rw
44 22 0:54 / {up} rw - tmpfs tmpfs rw
45 22 0:55 / /mnt/ov-tmpfs rw - overlay overlay rw,lowerdir=/l,upperdir={up}/data,workdir={up}/w
46 22 0:56 / /mnt/ov-disk rw - overlay overlay rw,lowerdir=/l,upperdir={disk}/data,workdir={disk}/w
47 22 0:57 / /mnt/ov-unseen rw - overlay overlay rw,lowerdir=/l,upperdir=/var/lib/docker/x/diff,workdir=/w
48 22 0:58 / /mnt/ov-readonly ro - overlay overlay ro,lowerdir=/l1:/l2
49 22 0:59 / /mnt/ram rw - ramfs ramfs rw
50 22 0:60 / /mnt/tmp-over-disk rw - tmpfs tmpfs rw
51 50 8:3 / /mnt/tmp-over-disk/disk rw - ext4 /dev/sdd rw
"""
    )
    where = str(table)

    def why(path: str) -> str | None:
        return times_miss_writes(path, table=where)

    for path in ("/dev/shm/m.safetensors", "/dev/x", "/mnt/huge/m", f"{up}/m", "/mnt/tmp-over-disk/m"):
        assert why(path) is not None and "mapping" in str(why(path)), path
    for path in ("/mnt/bucket/m", "/mnt/plain-fuse/m", "/mnt/ntfs/m"):
        assert "FUSE" in str(why(path)), path
    assert "overlay written to tmpfs" in str(why("/mnt/ov-tmpfs/model/m.safetensors"))
    for path in (
        "/home/user/m",  # ext4
        "/mnt/models/m",  # NFS: the server keeps the times
        "/mnt/models/scratch/m",  # xfs inside it
        "/mnt/ov-disk/m",  # an overlay written to a disk
        "/mnt/ov-unseen/m",  # an overlay whose upper layer cannot be seen (inside a container)
        "/mnt/ov-readonly/m",  # nothing in it can be written
        "/mnt/ram/m",  # ramfs: its mapped pages fault at the first write
        "/mnt/tmp-over-disk/disk/m",  # a disk mounted inside a tmpfs
    ):
        assert why(path) is None, path
    assert times_miss_writes("/dev/shm/m", table=str(tmp_path / "missing")) is None
