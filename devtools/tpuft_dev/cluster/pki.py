"""Certificates and kubeconfigs for the local control plane (what kubeadm would make, minus the rest).

One CA signs: the apiserver's serving certificate (127.0.0.1, localhost, kubernetes.default.svc),
an admin client certificate in ``system:masters``, and the JobSet webhook's serving certificate.
A separate RSA key pair signs ServiceAccount tokens.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=365)
_LOOPBACK_NAMES = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"]


@dataclass(frozen=True)
class Pki:
    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def apiserver_cert(self) -> Path:
        return self.directory / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.directory / "apiserver.key"

    @property
    def admin_cert(self) -> Path:
        return self.directory / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.directory / "admin.key"

    @property
    def sa_public(self) -> Path:
        return self.directory / "sa.pub"

    @property
    def sa_private(self) -> Path:
        return self.directory / "sa.key"

    @property
    def webhook_dir(self) -> Path:
        # controller-runtime reads tls.crt / tls.key from a directory.
        return self.directory / "webhook"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # tolerate small clock skew


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    common_name: str,
    organization: str | None = None,
    dns_names: list[str] | None = None,
    server: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attrs))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in (dns_names or [])]
        sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def create(directory: Path) -> Pki:
    """Creates every key and certificate the cluster needs (idempotent: keeps existing ones)."""
    pki = Pki(directory)
    if pki.sa_private.exists():
        return pki
    directory.mkdir(parents=True, exist_ok=True)
    pki.webhook_dir.mkdir(exist_ok=True)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tpuft-local-ca")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.ca_cert, ca_cert)

    cert, key = _issue(ca_cert, ca_key, common_name="kube-apiserver", dns_names=_LOOPBACK_NAMES, server=True)
    _write_cert(pki.apiserver_cert, cert)
    _write_key(pki.apiserver_key, key)
    cert, key = _issue(ca_cert, ca_key, common_name="tpuft-admin", organization="system:masters")
    _write_cert(pki.admin_cert, cert)
    _write_key(pki.admin_key, key)
    cert, key = _issue(ca_cert, ca_key, common_name="jobset-webhook", dns_names=["localhost"], server=True)
    _write_cert(pki.webhook_dir / "tls.crt", cert)
    _write_key(pki.webhook_dir / "tls.key", key)

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.sa_private, sa_key)
    pki.sa_public.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig(server: str, ca_cert: Path, user: dict[str, str], *, context: str = "tpuft-local") -> str:
    """A kubeconfig with everything embedded, so it works from any directory."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": context, "cluster": {"server": server, "certificate-authority-data": _b64(ca_cert)}}
        ],
        "users": [{"name": context, "user": user}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
        "current-context": context,
    }
    return yaml.safe_dump(config, sort_keys=False)


def admin_kubeconfig(server: str, pki: Pki) -> str:
    user = {"client-certificate-data": _b64(pki.admin_cert), "client-key-data": _b64(pki.admin_key)}
    return kubeconfig(server, pki.ca_cert, user)


def token_kubeconfig(server: str, pki: Pki, token: str, *, namespace: str) -> str:
    """A kubeconfig that acts as a ServiceAccount (its token), so RBAC really applies."""
    text = kubeconfig(server, pki.ca_cert, {"token": token})
    config = yaml.safe_load(text)
    config["contexts"][0]["context"]["namespace"] = namespace
    return yaml.safe_dump(config, sort_keys=False)
