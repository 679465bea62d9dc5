"""The fleet's CA: the certificate authority whose leaves the egress proxy shows a sandbox whose TLS it
terminates (record, replay, cache). Only such sandboxes trust it; everyone else's TLS stays end to end.
Also the leaves (``Leaves``: a context per host, minted on first use) and the server side of that TLS
(``TLSServerStream``)."""

from __future__ import annotations

import asyncio
import collections
import datetime
import ipaddress
import os
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_YEARS = 10
READ_SIZE = 1 << 20


@dataclass(frozen=True)
class FleetCA:
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def load_or_create(cls, directory: Path) -> FleetCA:
        """The CA kept in ``directory`` (``ca.pem``, ``ca.key`` mode 0600), made there the first time."""
        cert, key = directory / "ca.pem", directory / "ca.key"
        if cert.exists() and key.exists():
            return cls(cert.read_bytes(), key.read_bytes())
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = cls.create()
        staged = directory / f".key.{secrets.token_hex(4)}"
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(made.key_pem)
        os.replace(staged, key)
        staged.with_suffix(".pem").write_bytes(made.cert_pem)
        os.replace(staged.with_suffix(".pem"), cert)
        return made

    @classmethod
    def create(cls) -> FleetCA:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fanfold fleet CA {secrets.token_hex(4)}")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cls(cert.public_bytes(serialization.Encoding.PEM), key_pem)


LEAF_DAYS = 30


def leaf_key() -> ec.EllipticCurvePrivateKey:
    """A key for leaves: one per netd serves every host (minting a leaf then only signs a certificate)."""
    return ec.generate_private_key(ec.SECP256R1())


def mint_leaf(ca: FleetCA, host: str, key: ec.EllipticCurvePrivateKey) -> bytes:
    """A leaf certificate (PEM) for ``host`` (a name or an address), signed by ``ca``, for ``key``."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, None)
    return _leaf(ca_cert, ca_key, host, key)  # type: ignore[arg-type]


def _leaf(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, host: str,
          key: ec.EllipticCurvePrivateKey) -> bytes:
    try:
        alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        alt = x509.DNSName(host)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


class Leaves:
    """Server-side TLS contexts that show the fleet CA's leaf for a host, minted on first use and kept
    (least recently used dropped beyond ``size``)."""

    def __init__(self, ca: FleetCA, size: int = 1024) -> None:
        self.ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
        self.ca_key = serialization.load_pem_private_key(ca.key_pem, None)
        self.key = leaf_key()
        self.key_pem = self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption())
        self.size = size
        self._contexts: collections.OrderedDict[str, ssl.SSLContext] = collections.OrderedDict()

    def context(self, host: str) -> ssl.SSLContext:
        """The context for ``host``: its leaf and the CA, ALPN http/1.1 only."""
        context = self._contexts.get(host)
        if context is not None:
            self._contexts.move_to_end(host)
            return context
        context = self._mint(host)
        self._contexts[host] = context
        if len(self._contexts) > self.size:
            self._contexts.popitem(last=False)
        return context

    def _mint(self, host: str) -> ssl.SSLContext:
        chain = _leaf(self.ca_cert, self.ca_key, host, self.key) + self.ca_cert.public_bytes(serialization.Encoding.PEM)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.set_alpn_protocols(["http/1.1"])
        # load_cert_chain reads only files: a memfd keeps the key off every disk (and works as any uid,
        # since a process may always open its own /proc/self/fd).
        fd = os.memfd_create("fanfold-leaf", os.MFD_CLOEXEC)
        try:
            os.write(fd, chain + self.key_pem)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return context


class TLSServerStream:
    """The plaintext side of TLS that the proxy terminates, over a client connection's streams
    (``ssl.MemoryBIO``: the ClientHello, already read by the proxy to check its name, is fed in first).
    It reads and writes as an ``asyncio`` reader and writer would."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: ssl.SSLContext,
                 first: bytes) -> None:
        self.raw_reader, self.raw_writer = reader, writer
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.incoming.write(first)

    @property
    def transport(self) -> asyncio.BaseTransport:
        return self.raw_writer.transport

    async def handshake(self, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    self.tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    self._flush()
                    await self.raw_writer.drain()
                    if not await self._fill():
                        raise ConnectionResetError("the client closed inside the TLS handshake") from None
        self._flush()

    async def _fill(self) -> bool:
        data = await self.raw_reader.read(READ_SIZE)
        if not data:
            self.incoming.write_eof()
            return False
        self.incoming.write(data)
        return True

    def _flush(self) -> None:
        if data := self.outgoing.read():
            self.raw_writer.write(data)

    async def read(self, size: int) -> bytes:
        ended = False
        while True:
            try:
                data = self.tls.read(size)
            except ssl.SSLWantReadError:
                self._flush()
                if ended:
                    return b""
                ended = not await self._fill()  # at the end, the next read says how it ended
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""  # closed, with or without close_notify
            else:
                self._flush()
                return data

    def write(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    async def drain(self) -> None:
        await self.raw_writer.drain()

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        if not self.raw_writer.is_closing():
            try:
                self.tls.unwrap()  # close_notify; the client's is not waited for
            except ssl.SSLError:
                pass
            self._flush()
        self.raw_writer.close()

    async def wait_closed(self) -> None:
        await self.raw_writer.wait_closed()
