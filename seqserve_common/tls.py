"""TLS material both processes load: the public ports' identity and the mutual TLS
between the scheduler and its workers (docs/security.md).

`public_tls(cfg)` / `worker_tls(cfg)` read and check the PEM files named by the `tls_*` and
`worker_tls_*` options; a half-configured pair or a missing/unreadable file raises
ConfigError naming the keys and the path, so start-up stops with a clear message.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from seqserve_common.config import ConfigError, ServingConfig


@dataclass(frozen=True)
class TlsFiles:
    """PEM contents of one process's TLS identity and, optionally, the CA it trusts."""

    cert_chain: bytes
    private_key: bytes
    ca: bytes | None = None
    cert_path: str = ""
    key_path: str = ""
    ca_path: str = ""

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)],
                                           root_certificates=self.ca,
                                           require_client_auth=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side of mutual TLS: trust `ca`, present our certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca,
                                            private_key=self.private_key,
                                            certificate_chain=self.cert_chain)

    def server_ssl_context(self) -> ssl.SSLContext:
        """For the HTTP front: the same certificate; client certificates when `ca` is set."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_path, self.key_path)
        if self.ca is not None:
            ctx.load_verify_locations(cadata=self.ca.decode("ascii", "replace"))
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def _read_pem(key: str, path: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"option.{key}={path!r}: no such file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"option.{key}={path!r}: cannot read it ({exc.strerror})") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"option.{key}={path!r}: not a PEM file (no -----BEGIN line)")
    return data


def _load(cert_key: str, key_key: str, ca_key: str, cert: str, key: str, ca: str,
          ca_required: bool) -> TlsFiles | None:
    if bool(cert) != bool(key):
        have, missing = (cert_key, key_key) if cert else (key_key, cert_key)
        raise ConfigError(f"option.{have} is set but option.{missing} is not: set both "
                          f"option.{cert_key} (PEM certificate chain) and option.{key_key} "
                          f"(PEM private key), or neither")
    if not cert:
        if ca:
            raise ConfigError(f"option.{ca_key} is set but option.{cert_key} and "
                              f"option.{key_key} are not: set them too, or unset option.{ca_key}")
        return None
    if ca_required and not ca:
        raise ConfigError(f"option.{cert_key} and option.{key_key} are set but option.{ca_key} "
                          f"is not: mutual TLS needs the CA that signs the other side's "
                          f"certificate")
    files = TlsFiles(_read_pem(cert_key, cert), _read_pem(key_key, key),
                     _read_pem(ca_key, ca) if ca else None, cert, key, ca)
    # Parse them now (the ssl module reads the same PEM as gRPC) so a bad file or a key that
    # does not match the certificate stops start-up instead of failing every handshake.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def encrypted() -> bytes:  # instead of OpenSSL prompting on the terminal
        raise ConfigError(f"option.{key_key}={key!r} is an encrypted private key; gRPC needs "
                          f"it unencrypted (openssl pkey -in KEY -out PLAIN_KEY)")

    try:
        ctx.load_cert_chain(cert, key, password=encrypted)
    except ssl.SSLError as exc:
        raise ConfigError(f"option.{cert_key}={cert!r} and option.{key_key}={key!r} do not "
                          f"make a usable certificate and key ({exc.reason or exc}); is the "
                          f"key encrypted, or not the certificate's?") from None
    if ca:
        try:
            ctx.load_verify_locations(cafile=ca)
        except ssl.SSLError as exc:
            raise ConfigError(f"option.{ca_key}={ca!r} is not a usable CA certificate "
                              f"({exc.reason or exc})") from None
    return files


def public_tls(cfg: ServingConfig) -> TlsFiles | None:
    """TLS of the scheduler's public ports (gRPC and HTTP); None: plaintext."""
    return _load("tls_cert_file", "tls_key_file", "tls_client_ca_file", cfg.tls_cert_file,
                 cfg.tls_key_file, cfg.tls_client_ca_file, ca_required=False)


def worker_tls(cfg: ServingConfig) -> TlsFiles | None:
    """Mutual TLS between scheduler and workers; None: plaintext (loopback only)."""
    return _load("worker_tls_cert_file", "worker_tls_key_file", "worker_tls_ca_file",
                 cfg.worker_tls_cert_file, cfg.worker_tls_key_file, cfg.worker_tls_ca_file,
                 ca_required=True)
