"""A CA bundle rewritten in place, or replaced, is read again by the next request that needs it.

Whatever is built from a named file and kept (the checksum HEADs' TLS context, the object
store's client with the bundle's certificates) is kept by the file's version as well as by its
name. Before, a process that had once used a bundle kept trusting what the bundle said then: a
rotated certificate was refused, and a removed one still trusted, until the process restarted.
A real TLS server on loopback, with certificates made for the test.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import threading
from pathlib import Path

import pytest

from weightstream.config import ObjectStoreConfig, StreamConfig
from weightstream.location import ObjectLocation, object_location

from ..conftest import accepted


def make_cert(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def rewrite(bundle: Path, source: Path) -> None:
    """Rewrite ``bundle`` in place (same inode) with ``source``'s certificates, its time one
    second on (a rewrite within the file system's clock tick and of the same size is not told
    apart: see ``weightstream.localfs.file_version``)."""
    st = bundle.stat()
    with open(bundle, "r+b") as fh:
        fh.truncate(0)
        fh.write(source.read_bytes())
    os.utime(bundle, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert bundle.stat().st_ino == st.st_ino


@pytest.fixture
def tls_server(tmp_path: Path):  # type: ignore[no-untyped-def]
    """An HTTPS server on loopback answering every HEAD with a CRC32C; yields (port, its cert)."""
    cert, key = make_cert(tmp_path, "server")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for raw in accepted(server):
            try:
                with context.wrap_socket(raw, server_side=True) as conn:
                    buf = b""
                    while b"\r\n\r\n" not in buf and (data := conn.recv(65536)):
                        buf += data
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nx-amz-checksum-crc32c: AAAAAA==\r\n\r\n"
                    )
            except (OSError, ssl.SSLError):
                continue  # a client that refused our certificate

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1], cert
    server.close()


def test_checksum_heads_read_a_rewritten_ca_bundle_again(tls_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from weightstream.sources.object_store import checksum

    port, server_cert = tls_server
    other, _ = make_cert(tmp_path, "other")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(server_cert.read_bytes())
    oc = ObjectStoreConfig(endpoint=f"https://127.0.0.1:{port}", anonymous=True, ca_bundle=str(bundle))
    loc = object_location("s3://b/model.safetensors")
    assert isinstance(loc, ObjectLocation)
    assert checksum._head(loc, oc, None)[0] == 200  # the bundle trusts the server
    rewrite(bundle, other)  # the server's certificate taken out of the bundle
    with pytest.raises(ssl.SSLCertVerificationError):
        checksum._head(loc, oc, None)
    rewrite(bundle, server_cert)  # and put back
    assert checksum._head(loc, oc, None)[0] == 200
    replaced = tmp_path / "new.pem"  # replaced by a rename (a new inode), as package managers do
    replaced.write_bytes(other.read_bytes())
    os.replace(replaced, bundle)
    with pytest.raises(ssl.SSLCertVerificationError):
        checksum._head(loc, oc, None)


def test_the_object_store_client_is_made_again_for_a_rewritten_ca_bundle(tmp_path: Path) -> None:
    pytest.importorskip("obstore", reason="the object store client is the [s3] extra")
    from weightstream.sources.object_store.client import make_store

    first, _ = make_cert(tmp_path, "first")
    second, _ = make_cert(tmp_path, "second")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(first.read_bytes())
    config = StreamConfig(
        object_store=ObjectStoreConfig(endpoint="https://127.0.0.1:9", anonymous=True, ca_bundle=str(bundle))
    )
    loc = object_location("s3://b/model.safetensors")
    assert isinstance(loc, ObjectLocation)
    store = make_store(loc, config)
    assert make_store(loc, config) is store  # one client while the bundle is unchanged
    rewrite(bundle, second)
    again = make_store(loc, config)
    assert again is not store  # built anew, from the certificates the bundle holds now
    assert make_store(loc, config) is again
