#!/usr/bin/env python3
"""Object-store benchmark: weightstream against the Run:ai streamer's S3 path and a boto3 pool,
on an emulated remote store built from real parts.

The store: nginx (with its Lua module) serving a bucket folder on path-style URLs, inside a
network namespace joined to the host by a veth pair, with
  1. a time-to-first-byte delay on every request (``access_by_lua_block { ngx.sleep(d) }``),
  2. a per-connection rate cap (``limit_rate``, as object stores cap each connection),
  3. an optional link cap (``tc qdisc ... tbf`` on both veth ends; this kernel has no netem).
ListObjectsV2 for the model prefix is answered from a file written at set-up.

Profiles (first byte, per-connection rate, link cap):
  a: 5 ms, 200 MB/s, none      b: 20 ms, 100 MB/s, 2 Gbit/s
  c: 50 ms, 50 MB/s, 1 Gbit/s   d: 30 ms, 25 MB/s, none
  z: none, none, none (what a client costs per byte)

Methods, side by side, repetitions interleaved, medians:
  weightstream            ws.stream("s3://bucket/model/") with no settings, taken into a dict
  weightstream_load       ws.load("s3://bucket/model/") with no settings (its reads land in the
                          tensors it returns)
  weightstream_capNmbps   weightstream with max_bandwidth=N MB/s (``weightstream_load_capNmbps``:
                          ws.load), for the bandwidth cap: held, and free below it
  runai_default           the Run:ai streamer's S3 path (runai-model-streamer-s3), defaults
  runai_concurrency32     the same with RUNAI_STREAMER_CONCURRENCY=32 (the common profile)
  boto3_pool              32 threads of 8 MiB ranged GETs with boto3 (bytes read, then dropped)

Raw clients, for the client evaluation (``--methods``; each reads every byte in 8 MiB ranges,
64 in flight, and drops it: the most a loader built on it could do):
  obstore_raw             obstore (the client weightstream uses): get_range_async, asyncio
  awscrt_raw              the AWS CRT S3 client (awscrt): one GET per object, split into 8 MiB
                          ranged parts by the client, bytes counted in its body callback
  pyarrow_raw             PyArrow's S3 file system (the AWS C++ SDK): read_at from 32 threads
  socket_raw              plain sockets, each body received by the kernel straight into fresh
                          tensor memory (recv_into with MSG_WAITALL), 64 threads: one copy a byte

Every worker also reports its CPU time over the timed region (``cpu_s``: every thread) and the
busiest thread's (``thread_cpu_s`` and its name, sampled from /proc/self/task every 250 ms): the
one-process ceiling of a method is about 1 / (the busiest thread's CPU-seconds per GB) GB/s.

Needs root (netns, tc), nginx and libnginx-mod-http-lua (Debian). The namespace and nginx are
removed when the script ends, also on failure or Ctrl-C.

    python bench/bench_objstore.py --size-gib 2 --reps 3 --fast-reps 9 --profiles a,b,c,d
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_local import backed_memory, preload_weightstream, rep_order, run_worker  # noqa: E402  (shared with the local benchmark)

NS = f"wsb{os.getpid() % 100000}"
HOST_IF, NS_IF = f"{NS}h", f"{NS}n"
HOST_IP, NS_IP = "10.231.7.1", "10.231.7.2"
BUCKET = "bench"
PREFIX = "model"


@dataclass(frozen=True)
class Profile:
    name: str
    first_byte_s: float
    conn_rate: int  # bytes/s per connection
    link_bits: int | None  # bits/s, None = no cap

    def describe(self) -> str:
        link = f"{self.link_bits / 1e9:g} Gbit/s link" if self.link_bits else "no link cap"
        rate = f"{self.conn_rate / 1e6:g} MB/s per connection" if self.conn_rate else "no connection cap"
        return f"({self.name}) {self.first_byte_s * 1e3:g} ms first byte, {rate}, {link}"


PROFILES = {
    "a": Profile("a", 0.005, 200_000_000, None),
    "b": Profile("b", 0.020, 100_000_000, 2_000_000_000),
    "c": Profile("c", 0.050, 50_000_000, 1_000_000_000),
    "d": Profile("d", 0.030, 25_000_000, None),
    # no delay, no per-connection or link cap: what a client costs per byte (nginx's limit_rate 0
    # is no limit)
    "z": Profile("z", 0.0, 0, None),
}
METHODS = ["weightstream", "runai_default", "runai_concurrency32", "boto3_pool"]
RAW = ["obstore_raw", "awscrt_raw", "pyarrow_raw", "socket_raw"]
RAW_STEP = 8 << 20
RAW_DEPTH = 64
CACHE_DIRS = {"fill": ROOT / "bench" / "out" / "cache-fill", "whole": ROOT / "bench" / "out" / "cache-whole"}
"""The node cache's folders: emptied before each ``*_cachefill`` load (a first load); filled once,
untimed, before the ``*_cached`` loads (a second load)."""
COLD = ("weightstream_load_cached", "weightstream_load_cached_ttl", "weightstream_load_local")
"""Loads from this machine's disk: their files are dropped from the page cache before the clock
starts (``posix_fadvise``), so each reads the disk (the store's own files stay cached)."""
BEFORE = "weightstream_before"
"""With ``--before SRC``: weightstream from another source tree, interleaved: an A/B of a change."""
_before_src = ""


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


# ---------------------------------------------------------------------------------------------
# the emulated store


class Store:
    def __init__(self, data_dir: Path, work: Path, mtu: int = 1500) -> None:
        self.mtu = mtu
        self.data_dir = data_dir
        self.work = work
        self.conf = work / "nginx.conf"
        self.started = False
        self.checksums: dict[str, str] = {}
        """By request path: a full-object CRC64/NVME (base64) that HEADs asking for it are
        answered (``--store-checksums``, as S3 keeps one for every object since 2024-12)."""
        self.parts: dict[str, tuple[str, str, list[tuple[int, int, str]]]] = {}
        """By request path, for objects emulated as multipart uploads (``--store-checksums
        composite:...``): their ETag, composite CRC32C and each part's range and CRC32C."""

    def keep_checksums(self, kind: str = "full") -> None:
        """``full``: a full-object CRC64/NVME per object. ``composite:A+B+...``: each object a
        multipart upload of parts of A, B, ... MiB (repeated), with a composite CRC32C."""
        import base64
        import itertools

        from awscrt.checksums import crc32c, crc64nvme

        def b64(value: int, width: int) -> str:
            return base64.b64encode(value.to_bytes(width, "big")).decode()

        sizes = [int(x) << 20 for x in kind.partition(":")[2].split("+")] if kind != "full" else []
        for f in sorted((self.data_dir / PREFIX).iterdir()):
            path = f"/{BUCKET}/{PREFIX}/{f.name}"
            with open(f, "rb") as fh:
                if not sizes:
                    crc = 0
                    while chunk := fh.read(64 << 20):
                        crc = crc64nvme(chunk, crc)
                    self.checksums[path] = b64(crc, 8)
                    continue
                parts, start, total = [], 0, f.stat().st_size
                for size in itertools.cycle(sizes):
                    chunk = fh.read(size)
                    if not chunk:
                        break
                    parts.append((start, start + len(chunk) - 1, crc32c(chunk)))
                    start += len(chunk)
            composite = crc32c(b"".join(c.to_bytes(4, "big") for _, _, c in parts))
            etag = f'"{total:x}-{len(parts)}"'
            self.parts[path] = (
                etag,
                f"{b64(composite, 4)}-{len(parts)}",
                [(a, b, b64(c, 4)) for a, b, c in parts],
            )

    def etag(self, f: Path) -> str:
        """The ETag the listing gives ``f`` (a multipart upload's ends in ``-N``)."""
        found = self.parts.get(f"/{BUCKET}/{PREFIX}/{f.name}")
        return found[0] if found else f'"{f.stat().st_size:x}"'

    def _checksum_lua(self) -> str:
        if self.parts:
            return self._parts_lua()
        if not self.checksums:
            return ""
        table = ", ".join(f'["{k}"] = "{v}"' for k, v in self.checksums.items())
        # S3 answers a HEAD's If-Match by the object's ETag; nginx's own ETag is not the listing's
        return f"""
      rewrite_by_lua_block {{ if ngx.req.get_method() == "HEAD" then ngx.req.clear_header("If-Match") end }}
      header_filter_by_lua_block {{
        if ngx.var.http_x_amz_checksum_mode == "ENABLED" then
          local sums = {{ {table} }}
          local v = sums[ngx.var.uri]
          if v then ngx.header["x-amz-checksum-crc64nvme"] = v; ngx.header["x-amz-checksum-type"] = "FULL_OBJECT" end
        end
      }}"""

    def _parts_lua(self) -> str:
        """Multipart objects as S3 answers them: the listing's ETag on every answer (If-Match
        is checked against it), the composite CRC32C to a HEAD asking for checksums, and a
        ``HEAD ?partNumber=N`` answered 206 with the part's range and CRC32C."""
        return """
      header_filter_by_lua_block {
        local o = objects[ngx.var.uri]
        if o and not ngx.var.arg_partNumber then
          ngx.header["ETag"] = o.etag
          if ngx.var.http_x_amz_checksum_mode == "ENABLED" then
            ngx.header["x-amz-checksum-crc32c"] = o.crc; ngx.header["x-amz-checksum-type"] = "COMPOSITE"
          end
        end
      }"""

    @property
    def init_lua(self) -> str:
        """The multipart objects' table, built once as nginx starts (see :meth:`_parts_lua`)."""
        if not self.parts:
            return ""
        rows = []
        for path, (etag, composite, parts) in self.parts.items():
            ps = ", ".join(f'{{{a}, {b}, "{c}"}}' for a, b, c in parts)
            total = parts[-1][1] + 1
            rows.append(
                f'["{path}"] = {{etag = \'{etag}\', crc = "{composite}", total = {total}, parts = {{{ps}}}}}'
            )
        return "init_by_lua_block { objects = { " + ", ".join(rows) + " } }"

    def access_lua(self) -> str:
        """Lua run after the first byte's delay: what a multipart object's requests are
        answered (see :meth:`_parts_lua`)."""
        if not self.parts:
            return ""
        return """
        local o = objects[ngx.var.uri]
        local want = ngx.var.http_if_match
        ngx.req.clear_header("If-Match")
        if o and want and want ~= o.etag then return ngx.exit(412) end
        local n = tonumber(ngx.var.arg_partNumber)
        if o and n and ngx.req.get_method() == "HEAD" then
          local p = o.parts[n]
          if not p then return ngx.exit(400) end
          ngx.status = 206
          ngx.header["ETag"] = o.etag
          ngx.header["Content-Range"] = "bytes " .. p[1] .. "-" .. p[2] .. "/" .. o.total
          ngx.header["Content-Length"] = p[2] - p[1] + 1
          ngx.header["x-amz-mp-parts-count"] = #o.parts
          if ngx.var.http_x_amz_checksum_mode == "ENABLED" then
            ngx.header["x-amz-checksum-crc32c"] = p[3]; ngx.header["x-amz-checksum-type"] = "COMPOSITE"
          end
          ngx.send_headers()
          return ngx.exit(ngx.HTTP_OK)
        end"""

    def setup_network(self) -> None:
        sh("ip", "netns", "add", NS)
        sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        sh("ip", "link", "set", NS_IF, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        sh("ip", "link", "set", HOST_IF, "mtu", str(self.mtu), "up")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "mtu", str(self.mtu), "up")
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")

    def write_listing(self) -> None:
        items = []
        for f in sorted((self.data_dir / PREFIX).iterdir()):
            items.append(
                f"<Contents><Key>{PREFIX}/{f.name}</Key><LastModified>2026-11-30T00:00:00.000Z</LastModified>"
                f"<ETag>{self.etag(f)}</ETag><Size>{f.stat().st_size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
            )
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{BUCKET}</Name><Prefix>{PREFIX}/</Prefix><KeyCount>{len(items)}</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<Delimiter>/</Delimiter><IsTruncated>false</IsTruncated>{''.join(items)}</ListBucketResult>"
        )
        (self.work / "list.xml").write_text(xml)

    def apply(self, p: Profile) -> None:
        (self.work / "tmp").mkdir(exist_ok=True)
        self.conf.write_text(
            f"""
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
worker_processes 2;
pid {self.work}/nginx.pid;
error_log {self.work}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  {self.init_lua}
  access_log off;
  sendfile on;
  tcp_nopush on;
  keepalive_requests 1000000;
  keepalive_timeout 300s;
  client_body_temp_path {self.work}/tmp;
  proxy_temp_path {self.work}/tmp;
  fastcgi_temp_path {self.work}/tmp;
  uwsgi_temp_path {self.work}/tmp;
  scgi_temp_path {self.work}/tmp;
  server {{
    listen {NS_IP}:80 backlog=4096;
    location /{BUCKET}/ {{
      if ($args ~ "list-type=2") {{ rewrite ^ /__list.xml last; }}
      access_by_lua_block {{ ngx.sleep({p.first_byte_s}){self.access_lua()} }}
      limit_rate {p.conn_rate};
      alias {self.data_dir}/;{self._checksum_lua()}
    }}
    location = /{BUCKET} {{
      if ($args ~ "list-type=2") {{ rewrite ^ /__list.xml last; }}
      return 404;
    }}
    location = /__list.xml {{ internal; default_type application/xml; alias {self.work}/list.xml; }}
  }}
}}
"""
        )
        if self.started:
            sh("ip", "netns", "exec", NS, "nginx", "-c", str(self.conf), "-s", "reload")
            time.sleep(1.0)
        else:
            sh("ip", "netns", "exec", NS, "nginx", "-c", str(self.conf))
            self.started = True
        for dev, prefix in ((HOST_IF, []), (NS_IF, ["ip", "netns", "exec", NS])):
            sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if p.link_bits:
                # burst >= rate/HZ and a 2 MB bucket so the shaper is smooth at Gbit rates
                sh(
                    *prefix,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{p.link_bits}bit",
                    "burst",
                    "2mb",
                    "latency",
                    "100ms",
                )

    def teardown(self) -> None:
        if self.started:
            pid = self.work / "nginx.pid"
            with contextlib.suppress(Exception):
                sh("ip", "netns", "exec", NS, "nginx", "-c", str(self.conf), "-s", "stop", check=False)
                for _ in range(50):
                    if not pid.exists():
                        break
                    time.sleep(0.1)
        sh("ip", "netns", "del", NS, check=False)  # removes the veth pair too
        sh("ip", "link", "del", HOST_IF, check=False)


@contextlib.contextmanager
def emulated_store(data_dir: Path, *, mtu: int = 1500) -> Iterator[Store]:
    for tool in ("nginx", "ip", "tc"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} not found: apt-get install nginx libnginx-mod-http-lua iproute2")
    if not Path("/usr/lib/nginx/modules/ngx_http_lua_module.so").exists():
        raise SystemExit("nginx's Lua module is missing: apt-get install libnginx-mod-http-lua")
    work = Path(tempfile.mkdtemp(prefix="wsbench-"))
    work.chmod(0o755)  # nginx's workers run unprivileged and read list.xml from here
    store = Store(data_dir, work, mtu)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        store.setup_network()
        store.write_listing()
        yield store
    finally:
        store.teardown()
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------
# workers (each a fresh process)


def _env_for(method: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTSTREAM_", "RUNAI_STREAMER_", "AWS_"))
    }
    env.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{NS_IP}",
        AWS_EC2_METADATA_DISABLED="true",
        RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
        PYTHONPATH=(_before_src if method.endswith("_before") else str(ROOT / "src"))
        + os.pathsep
        + os.environ.get("PYTHONPATH", ""),
    )
    method = method.removesuffix("_before")
    if method == "weightstream_static":  # the tuner off: the static defaults, 64 x 16 MiB
        env["WEIGHTSTREAM_AUTOTUNE"] = "0"
    size = re.fullmatch(r"weightstream(?:_load)?_(\d+)mib", method)
    if size:  # the Python per request over more bytes: weightstream_32mib, weightstream_load_48mib, ...
        env["WEIGHTSTREAM_S3_CHUNK_SIZE"] = f"{size.group(1)}MiB"
    cap = re.fullmatch(r"weightstream(?:_load)?_cap(\d+)mbps", method)
    if cap:  # a bandwidth cap (max_bandwidth), in MB/s: weightstream_cap1000mbps, ...
        env["WEIGHTSTREAM_MAX_BANDWIDTH"] = f"{cap.group(1)}MB"
    if method.endswith("_ttl"):  # the cached load asks the store nothing (cache_ttl)
        env["WEIGHTSTREAM_CACHE_TTL"] = "3600"
    if method.endswith("_noverify"):  # the check off (the bucket has a manifest, --verify, or the
        # store answers checksums, --store-checksums)
        env["WEIGHTSTREAM_VERIFY"] = "off"
    if "_cache" in method:  # the node cache: filled from empty (cachefill) or read when whole (cached)
        env["WEIGHTSTREAM_CACHE_DIR"] = str(CACHE_DIRS["fill" if method.endswith("cachefill") else "whole"])
    if method == "weightstream_obstore":  # obstore's transport, as on https:// stores (AWS, GCS, Azure)
        env["WEIGHTSTREAM_S3_TRANSPORT"] = "obstore"
    if method == "runai_concurrency32":
        env["RUNAI_STREAMER_CONCURRENCY"] = "32"
    return env


class ThreadCPU:
    """CPU time of each thread of this process, sampled every 250 ms from /proc/self/task (a
    thread that ends between samples keeps its last sample): the busiest thread over a region.
    Sampling reads one file per thread, and a load may run hundreds: at 20 ms it took a core on
    this machine; its own CPU time (``cpu``) is taken out of the load's."""

    def __init__(self) -> None:
        import threading

        self.tick = os.sysconf("SC_CLK_TCK")
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._me = 0
        self._started = False
        self.cpu = 0.0
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _sample(self) -> None:
        import threading

        names = {t.native_id: t.name for t in threading.enumerate()}  # Python's names, not comm's
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    st = f.read()
            except OSError:
                continue
            t = int(tid)
            name = names.get(t) or st[st.index("(") + 1 : st.rindex(")")]
            if t in self.last and not names.get(t):
                name = self.last[t][0]  # a Python thread keeps the name it was seen with
            fields = st[st.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / self.tick
            self.first.setdefault(t, cpu if self._started else 0.0)
            self.last[t] = (name, cpu)

    def _run(self) -> None:
        import threading

        self._me = threading.get_native_id()
        while not self._stop.wait(0.25):
            self._sample()
        self.cpu = time.thread_time()

    def __enter__(self) -> ThreadCPU:
        self._started = True
        self._sample()  # threads alive now count from here; later ones from their start
        self._started = False
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def by_name(self) -> dict[str, float]:
        """CPU-seconds of the region by thread name (numbered names, e.g. weightstream-io-7, as
        one group)."""
        out: dict[str, float] = {}
        for t, (name, cpu) in self.last.items():
            if t != self._me:
                group = name.rstrip("0123456789").rstrip("-_") or name
                out[group] = round(out.get(group, 0.0) + cpu - self.first.get(t, 0.0), 3)
        return out

    def busiest(self) -> tuple[str, float]:
        best = ("", 0.0)
        for t, (name, cpu) in self.last.items():
            if t == self._me:
                continue
            used = cpu - self.first.get(t, 0.0)
            if used > best[1]:
                best = (name, used)
        return best


def _raw_ranges(keys: list[str]) -> list[tuple[str, int, int]]:
    """(key, start, end) in RAW_STEP ranges, from the bucket folder's sizes (no HEAD needed)."""
    data = Path(os.environ["WSBENCH_BUCKET_DIR"])
    out = []
    for k in keys:
        size = (data / k).stat().st_size
        out += [(k, o, min(o + RAW_STEP, size)) for o in range(0, size, RAW_STEP)]
    return out


def _obstore_raw(keys: list[str]) -> int:
    import asyncio

    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=f"http://{NS_IP}",
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    ranges = _raw_ranges(keys)

    async def main() -> int:
        gate = asyncio.Semaphore(RAW_DEPTH)

        async def one(k: str, a: int, b: int) -> int:
            async with gate:
                return len(await obstore.get_range_async(store, k, start=a, end=b))

        return sum(await asyncio.gather(*(one(*r) for r in ranges)))

    return asyncio.run(main())


def _awscrt_raw(keys: list[str]) -> int:
    from awscrt import auth, http, io, s3

    loop = io.EventLoopGroup()
    bootstrap = io.ClientBootstrap(loop, io.DefaultHostResolver(loop))
    creds = auth.AwsCredentialsProvider.new_static("bench", "bench")
    client = s3.S3Client(
        bootstrap=bootstrap,
        region="us-east-1",
        signing_config=s3.create_default_s3_signing_config(region="us-east-1", credential_provider=creds),
        part_size=RAW_STEP,
        throughput_target_gbps=RAW_DEPTH * RAW_STEP * 8 / 1e9 / 0.1,
        tls_mode=s3.S3RequestTlsMode.DISABLED,
    )
    got = [0]

    def on_body(chunk: bytes, offset: int, **kw: object) -> None:
        got[0] += len(chunk)

    requests = []
    for k in keys:
        headers = http.HttpHeaders([("Host", NS_IP)])
        req = http.HttpRequest("GET", f"/{BUCKET}/{k}", headers)
        requests.append(client.make_request(type=s3.S3RequestType.GET_OBJECT, request=req, on_body=on_body))
    for r in requests:
        r.finished_future.result()
    return got[0]


def _socket_raw(keys: list[str]) -> int:
    """Plain sockets, one persistent HTTP/1.1 connection a thread, each body received straight
    into fresh tensor memory with ``recv_into(MSG_WAITALL)``: one copy per byte (the kernel's),
    Python per request. Unsigned (the emulated store does not check signatures)."""
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch

    ranges = _raw_ranges(keys)
    sizes = {k: max(b for kk, _, b in ranges if kk == k) for k in keys}
    dest = {k: torch.empty(n, dtype=torch.uint8).numpy() for k, n in sizes.items()}
    local = threading.local()

    def conn() -> socket.socket:
        s = getattr(local, "s", None)
        if s is None:
            s = local.s = socket.create_connection((NS_IP, 80))
        return s

    def one(r: tuple[str, int, int]) -> int:
        k, a, b = r
        s = conn()
        s.sendall(f"GET /{BUCKET}/{k} HTTP/1.1\r\nHost: {NS_IP}\r\nRange: bytes={a}-{b - 1}\r\n\r\n".encode())
        head = s.recv(8192, socket.MSG_PEEK)
        while b"\r\n\r\n" not in head:
            head = s.recv(len(head) + 8192, socket.MSG_PEEK)
        end = head.index(b"\r\n\r\n") + 4
        s.recv(end)
        n = int(re.search(rb"(?i)content-length: *(\d+)", head[:end]).group(1))
        view = memoryview(dest[k])[a : a + n]
        got = 0
        while got < n:
            got += s.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        return n

    with ThreadPoolExecutor(RAW_DEPTH) as pool:
        return sum(pool.map(one, ranges))


def _pyarrow_raw(keys: list[str]) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from pyarrow import fs

    s3fs = fs.S3FileSystem(
        access_key="bench", secret_key="bench", region="us-east-1", endpoint_override=NS_IP, scheme="http"
    )
    files = {k: s3fs.open_input_file(f"{BUCKET}/{k}") for k in keys}

    def one(r: tuple[str, int, int]) -> int:
        return len(files[r[0]].read_at(r[2] - r[1], r[1]))

    with ThreadPoolExecutor(32) as pool:
        return sum(pool.map(one, _raw_ranges(keys)))


def worker(method: str, keys: list[str]) -> dict:
    """One load; the clock and the CPU counters start after every import (``_timed``)."""
    threads = ThreadCPU()
    out = _worker(method, keys, threads)
    if "failed" not in out:
        name, busiest = threads.busiest()
        out.update(thread=name, thread_cpu_s=busiest, threads=threads.by_name())
    return out


def _worker(method: str, keys: list[str], threads: ThreadCPU) -> dict:
    uris = [f"s3://{BUCKET}/{k}" for k in keys]
    base = 0
    # Libraries are imported before the clock starts, as in a serving process that has them
    # loaded already (importing torch alone takes 0.8 s here, 9 % of a load on profile (b)).
    if method.startswith("weightstream"):
        ws = preload_weightstream(remote=True)
        from weightstream.errors import WeightStreamError
    elif method.startswith("runai"):
        from runai_model_streamer import SafetensorsStreamer
    elif method == "boto3_pool":
        import boto3
        from botocore.config import Config
    elif method == "obstore_raw":
        import obstore  # noqa: F401
    elif method == "awscrt_raw":
        import awscrt.s3  # noqa: F401
    elif method == "pyarrow_raw":
        import pyarrow.fs  # noqa: F401
    elif method == "socket_raw":
        import torch  # noqa: F401
    if method in COLD:
        folder = (
            CACHE_DIRS["whole"] if "_cached" in method else Path(os.environ["WSBENCH_BUCKET_DIR"]) / PREFIX
        )
        for f in folder.glob("*.safetensors"):
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    profile = os.environ.get("BENCH_YAPPI")  # a folder: the timed region's CPU profile, by function
    if profile:
        import yappi

        yappi.set_clock_type("cpu")
        yappi.start()
    gil = GilSampler(os.environ["BENCH_GIL"], method) if os.environ.get("BENCH_GIL") else None
    if gil is not None:
        gil.start()  # before the clock: attaching takes a moment
    cpu0, user0 = time.process_time(), os.times().user
    threads.__enter__()
    t0 = time.perf_counter()
    extra: dict = {}
    if method.startswith("weightstream"):
        loads = method.removesuffix("_before").startswith("weightstream_load")
        uri = f"s3://{BUCKET}/{PREFIX}/"
        if method == "weightstream_load_local":  # the same files, from this machine's disk
            uri = str(Path(os.environ["WSBENCH_BUCKET_DIR"]) / PREFIX)
        s = ws.open_checkpoint(uri) if loads else ws.stream(uri)
        extra["open_s"] = time.perf_counter() - t0  # the listing, the index and the headers
        try:
            tensors = s.load() if loads else dict(s)
        except WeightStreamError as e:  # counted, not fatal: --reps N is also a reliability run
            threads.__exit__()
            attempts = getattr(e.__cause__, "attempts", None) or getattr(e, "attempts", None)
            return {"method": method, "failed": str(e)[:2000], "attempts": attempts, "seconds": 0, "bytes": 0}
        n = sum(t.numel() * t.element_size() for t in tensors.values())
        stats = s.last_stats if loads else s.stats
        extra = {
            **extra,
            "checked_bytes": stats.checked_bytes,
            "requests": stats.requests,
            "settings": {"concurrency": s.config.concurrency, "chunk": s.config.chunk_size},
            "tuning": stats.tuning,
            "stats": stats.requests,
        }
    elif method.startswith("runai"):
        tensors = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(uris)
            for name, t in streamer.get_tensors():
                tensors[name] = t
        n = sum(t.numel() * t.element_size() for t in tensors.values())
    elif method == "boto3_pool":
        from concurrent.futures import ThreadPoolExecutor

        client = boto3.client(
            "s3",
            endpoint_url=f"http://{NS_IP}",
            config=Config(max_pool_connections=32, s3={"addressing_style": "path"}),
        )
        step = 8 << 20
        ranges = []
        for k in keys:
            size = client.head_object(Bucket=BUCKET, Key=k)["ContentLength"]
            ranges += [(k, o, min(o + step, size) - 1) for o in range(0, size, step)]

        def get(r: tuple[str, int, int]) -> int:
            body = client.get_object(Bucket=BUCKET, Key=r[0], Range=f"bytes={r[1]}-{r[2]}")["Body"].read()
            return len(body)

        with ThreadPoolExecutor(32) as pool:
            n = sum(pool.map(get, ranges))
    elif method in RAW:
        n = {
            "obstore_raw": _obstore_raw,
            "awscrt_raw": _awscrt_raw,
            "pyarrow_raw": _pyarrow_raw,
            "socket_raw": _socket_raw,
        }[method](keys)
    else:
        raise SystemExit(f"unknown method {method}")
    dt = time.perf_counter() - t0
    threads.__exit__()
    if gil is not None:
        extra["gil_s"] = gil.stop(dt)
    if profile:
        yappi.stop()
        yappi.get_func_stats().save(os.path.join(profile, f"{method}-{os.getpid()}.pstat"), type="pstat")
    cpu = time.process_time() - cpu0 - threads.cpu
    if "_cache" in method:  # the entries made whole (fsync, rename): after the clock, as at exit
        from weightstream import cache

        t1 = time.perf_counter()
        cache.drain()
        extra["publish_s"] = time.perf_counter() - t1
    user = os.times().user - user0  # user mode: Python (and the GIL) lives here, a socket's copy does not
    return {
        "method": method,
        "seconds": dt,
        "bytes": n,
        "base_rss": base,
        "cpu_s": cpu,
        "user_s": user,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **extra,
    }


class GilSampler:
    """What holds a process to one core's worth of Python: py-spy samples the worker at
    ``RATE`` Hz over the timed region, keeping only threads that hold the GIL (``--gil``) and
    never stopping the process (``--nonblocking``). The samples over ``RATE`` are the seconds
    the GIL was held, ``gil_s``: 1 / (``gil_s`` per GB) GB/s is the most one process can
    deliver, whatever its cores. User-mode CPU bounds it from above (it also counts C code run
    with the GIL released); this measures it. The raw stacks are kept (``BENCH_GIL=DIR``)."""

    RATE = 1000

    def __init__(self, folder: str, method: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"{method}-{os.getpid()}.txt")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
        if spy is None:
            raise SystemExit("BENCH_GIL needs py-spy (pip install py-spy)")
        self.proc = subprocess.Popen(
            [
                spy,
                "record",
                "--gil",
                "--nonblocking",
                "--threads",
                "--rate",
                str(self.RATE),
                "--format",
                "raw",
                "-o",
                self.path,
                "--pid",
                str(os.getpid()),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.5)  # attached and sampling before the clock starts

    def stop(self, seconds: float) -> float:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=30)
        samples = 0
        with open(self.path) as fh:
            for line in fh:
                stack, _, count = line.rstrip().rpartition(" ")
                frames = stack.split(";")
                # Counted: a thread of the load in Python code. Left out: this benchmark's own
                # sampler thread, and samples with no Python frame at all (py-spy's
                # non-blocking reads attribute the GIL to a thread caught between frames, and
                # to the main thread while it sleeps before the clock: a fifth to a half of
                # all samples, for every method alike).
                if count.isdigit() and len(frames) > 1 and "bench-sampler" not in frames[0]:
                    samples += int(count)
        return min(samples / self.RATE, seconds)


def run_one(method: str, keys: list[str], timeout: float) -> dict:
    if method.removesuffix("_before").endswith("cachefill"):
        shutil.rmtree(CACHE_DIRS["fill"], ignore_errors=True)
    return run_worker(__file__, [method, *keys], env=_env_for(method), timeout=timeout)


# ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument(
        "--dir",
        default=str(ROOT / "bench" / "out" / "bucket"),
        help="bucket folder (checkpoint made under model/ if missing)",
    )
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3, help="repetitions on link-capped profiles (default 3)")
    ap.add_argument(
        "--fast-reps",
        type=int,
        default=9,
        help="repetitions on profiles with no link cap (default 9: their loads take about 2 s, and on a "
        "small machine that also runs the store they swing by +-12 %% from load to load)",
    )
    ap.add_argument("--profiles", default="a,b,c,d")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--before",
        metavar="SRC",
        help=f"also run weightstream from this source tree as the method {BEFORE} (an A/B of a change)",
    )
    ap.add_argument(
        "--before-methods",
        default="weightstream",
        help="the methods run from the --before tree, each as METHOD_before (default: weightstream)",
    )
    ap.add_argument(
        "--mtu",
        type=int,
        default=1500,
        help="MTU of the veth pair (1500: internet-style framing; 9001: AWS VPC jumbo frames)",
    )
    ap.add_argument(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help="run N busy processes beside the loads (a node whose CPU is shared: the loader's timers "
        "fire late, as when a congested-link load failed in issue 21)",
    )
    ap.add_argument(
        "--verify",
        action="store_true",
        help="put the checkpoint's manifest in the bucket for the run, so weightstream's loads check "
        "every byte (compare with a *_noverify method: the check off)",
    )
    ap.add_argument(
        "--store-checksums",
        nargs="?",
        const="full",
        metavar="full|composite:A+B+...",
        help="the store answers a HEAD with each object's full-object CRC64/NVME, as S3 does, so "
        "weightstream's loads check every byte against it (compare with a *_noverify method); "
        "composite:8 (or 5+7, ...): each object a multipart upload of parts of 8 MiB (or 5, 7, 5, "
        "... MiB) with a composite CRC32C, each part's CRC answered to HEAD ?partNumber=N",
    )
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], args.worker[1:])), flush=True)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespace, tc)")

    data = Path(args.dir).resolve()  # nginx takes a relative root as relative to its own prefix
    model = data / PREFIX
    if not (model / "model.safetensors.index.json").exists():
        from weightstream.tools.sample import write_checkpoint

        print(f"writing a {args.size_gib} GiB checkpoint to {model} ...", file=sys.stderr)
        write_checkpoint(str(model), total_bytes=int(args.size_gib * (1 << 30)), shard_bytes=512 << 20)
    keys = sorted(f"{PREFIX}/{p.name}" for p in model.glob("*.safetensors"))
    os.environ["WSBENCH_BUCKET_DIR"] = str(data)  # the raw clients' range lists
    size = sum((data / k).stat().st_size for k in keys)
    methods = args.methods.split(",")
    if args.before:
        global _before_src
        _before_src = str(Path(args.before).resolve())
        methods += [f"{m}_before" for m in args.before_methods.split(",")]
    results: list[dict] = []
    manifest = model / "weightstream.manifest.json"
    if args.verify:
        subprocess.run(
            [sys.executable, "-m", "weightstream", "manifest", str(model), "-o", str(manifest)],
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        )
    try:
        _run_profiles(args, data, keys, size, methods, results)
    finally:
        manifest.unlink(missing_ok=True)
    print(summarize(results, size, methods, args.profiles.split(",")))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"size": size, "results": results}, indent=1))
    return 0


def _run_profiles(
    args: argparse.Namespace, data: Path, keys: list[str], size: int, methods: list[str], results: list[dict]
) -> None:
    with (
        backed_memory(int(size * 2.5)) as memory_state,
        emulated_store(data, mtu=args.mtu) as store,
        busy_processes(args.contend),
    ):
        print(f"memory: {memory_state}; {args.contend} busy processes beside the loads", file=sys.stderr)
        if args.store_checksums:
            store.keep_checksums(args.store_checksums)
            store.write_listing()  # a multipart object's ETag ends in -N
        for pname in args.profiles.split(","):
            p = PROFILES[pname]
            store.apply(p)
            print(p.describe(), file=sys.stderr)
            for k in keys:  # the store's files in the page cache, so no method pays the disk
                with open(data / k, "rb") as f:
                    while f.read(64 << 20):
                        pass
            # One untimed load first, which builds tensors: the first run after nginx (re)starts was
            # 30-50 % slow, and the first that allocates the checkpoint's memory after the memory
            # state is set up up to 2x slower (whichever method ran first: ours, in the first
            # repetition's order). A boto3 warm-up, which drops its bytes, had cured only the first.
            run_one("weightstream", keys, timeout=1800)
            if any("_cached" in m for m in methods):  # the second loads' cache, filled once
                shutil.rmtree(CACHE_DIRS["whole"], ignore_errors=True)
                run_one("weightstream_load_cachewarm", keys, timeout=1800)
            for rep in range(args.reps if p.link_bits else args.fast_reps):
                for m in rep_order(methods, rep):
                    r = run_one(
                        m, keys, timeout=max(300, 20 * size / (p.link_bits / 8 if p.link_bits else 5e8))
                    )
                    if "failed" in r:
                        r.update(profile=pname, rep=rep, gbps=None)
                        print(f"  rep {rep} {m:22} FAILED: {r['failed'][:300]}", file=sys.stderr)
                    else:
                        r.update(profile=pname, rep=rep, gbps=r["bytes"] / r["seconds"] / 1e9)
                        print(f"  rep {rep} {m:22} {r['gbps']:6.3f} GB/s", file=sys.stderr)
                    results.append(r)


def summarize(results: list[dict], size: int, methods: list[str], profiles: list[str]) -> str:
    lines = [
        f"checkpoint {size / 1e9:.2f} GB; medians, GB/s; repetitions: "
        + ", ".join(f"({p}) {len({r['rep'] for r in results if r['profile'] == p})}" for p in profiles),
        "",
    ]
    lines.append(
        "| profile | "
        + " | ".join(methods)
        + " | link cap | weightstream / Run:ai default | weightstream / link |"
    )
    lines.append("|---|" + "---:|" * (len(methods) + 3))
    for pname in profiles:
        p = PROFILES[pname]
        med = {}
        for m in methods:
            rs = [r["gbps"] for r in results if r["profile"] == pname and r["method"] == m and r["gbps"]]
            med[m] = statistics.median(rs) if rs else None
        link = p.link_bits / 8e9 if p.link_bits else None
        ours, runai = med.get("weightstream"), med.get("runai_default")
        cells = " | ".join(f"{med[m]:.3f}" if med[m] else "–" for m in methods)
        r1 = f"{ours / runai:.2f}" if ours and runai else "–"
        r2 = f"{ours / link:.2f}" if ours and link else "–"
        lines.append(f"| {p.describe()} | {cells} | {link if link else '–'} | {r1} | {r2} |")
    lines.append("")
    for pname in profiles:
        for m in methods:
            rs = [r for r in results if r["profile"] == pname and r["method"] == m]
            failed = [r for r in rs if "failed" in r]
            lines.append(f"({pname}) {m}: {len(rs) - len(failed)} of {len(rs)} loads complete")
            lines += [f"    failed: {r['failed'][:300]}" for r in failed]
    lines += ["", "CPU per GB delivered (medians): the process, and its busiest thread", ""]
    lines.append(
        "| profile | method | GB/s | CPU-s / GB | user-mode CPU-s / GB | busiest thread CPU-s / GB | (thread) "
        "| 1 / that, GB/s |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---|---:|")
    gil_rows = []
    for pname in profiles:
        for m in methods:
            rs = [r for r in results if r["profile"] == pname and r["method"] == m and r.get("gbps")]
            if not rs or "cpu_s" not in rs[0]:
                continue
            per = statistics.median(r["cpu_s"] / (r["bytes"] / 1e9) for r in rs)
            user = statistics.median(r.get("user_s", float("nan")) / (r["bytes"] / 1e9) for r in rs)
            th = statistics.median(r["thread_cpu_s"] / (r["bytes"] / 1e9) for r in rs)
            name = statistics.mode(r["thread"] for r in rs)
            gbps = statistics.median(r["gbps"] for r in rs)
            ceiling = f"{1 / th:.1f}" if th > 0 else "–"
            lines.append(
                f"| {pname} | {m} | {gbps:.3f} | {per:.3f} | {user:.3f} | {th:.3f} | {name} | {ceiling} |"
            )
            if "gil_s" in rs[0]:
                held = statistics.median(r["gil_s"] / (r["bytes"] / 1e9) for r in rs)
                share = statistics.median(r["gil_s"] / r["seconds"] for r in rs)
                per_request = [r["gil_s"] / r["requests"]["requests"] * 1e3 for r in rs if r.get("requests")]
                gil_rows.append(
                    f"| {pname} | {m} | {gbps:.3f} | {share:.0%} | {held:.4f} | "
                    + (f"{statistics.median(per_request):.3f} | " if per_request else "– | ")
                    + (f"{1 / held:.0f} |" if held > 0 else "– |")
                )
    if gil_rows:
        lines += ["", "The GIL held (py-spy --gil, BENCH_GIL; medians)", ""]
        lines.append(
            "| profile | method | GB/s | share of the load's time | GIL-s / GB | ms a request | one process at most, GB/s |"
        )
        lines.append("|---|---|---:|---:|---:|---:|---:|")
        lines += gil_rows
    return "\n".join(lines)


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    raise SystemExit(main())
