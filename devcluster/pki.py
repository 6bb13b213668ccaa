"""Certificates and keys for a throw-away local control plane.

Everything is ECDSA P-256: generating a key takes microseconds, so a cluster start does not
pay for RSA key generation, and Go's TLS stack and the apiserver's service-account signer
accept it. The CA lives only as long as the cluster directory.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=30)
# The apiserver's in-cluster service IP is the first address of --service-cluster-ip-range.
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
_KUBERNETES_SERVICE_IP = "10.0.0.1"
FRONT_PROXY_CN = "front-proxy-client"


@dataclass(frozen=True)
class CertificateFiles:
    """PEM files of one certificate and its private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPki:
    """Paths of every credential the control plane components are started with."""

    ca: CertificateFiles
    apiserver: CertificateFiles
    admin: CertificateFiles
    scheduler: CertificateFiles
    controller_manager: CertificateFiles
    front_proxy_client: CertificateFiles
    service_account_key: Path
    service_account_pub: Path


class CertificateAuthority:
    """A CA that can issue further client certificates after the cluster is up."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self._cert = cert
        self._key = key

    @classmethod
    def create(cls, common_name: str = "carve-devcluster-ca") -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
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
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, files: CertificateFiles) -> CertificateAuthority:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{files.key}: expected an ECDSA key, found {type(key).__name__}")
        return cls(cert, key)

    def write(self, directory: Path, stem: str) -> CertificateFiles:
        return _write_pair(directory, stem, self._cert, self._key)

    def issue(
        self,
        directory: Path,
        stem: str,
        *,
        common_name: str,
        organizations: Sequence[str] = (),
        dns_names: Sequence[str] = (),
        ip_addresses: Sequence[str] = (),
        server: bool = False,
    ) -> CertificateFiles:
        """Sign a client (and, with ``server``, serving) certificate; the apiserver maps
        CN to the user name and O to groups, which is how RBAC sees each component."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        now = _now()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans.extend(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return _write_pair(directory, stem, cert, key)


def create_cluster_pki(directory: Path) -> ClusterPki:
    """Write the CA, the serving certificate, one client certificate per component and the
    service-account signing key pair into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = CertificateAuthority.create()
    sa_key = ec.generate_private_key(ec.SECP256R1())
    sa_key_path = directory / "sa.key"
    sa_pub_path = directory / "sa.pub"
    _write_private(sa_key_path, sa_key)
    sa_pub_path.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return ClusterPki(
        ca=ca.write(directory, "ca"),
        apiserver=ca.issue(
            directory,
            "apiserver",
            common_name="kube-apiserver",
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ip_addresses=("127.0.0.1", _KUBERNETES_SERVICE_IP),
            server=True,
        ),
        admin=ca.issue(
            directory, "admin", common_name="carve-admin", organizations=("system:masters",)
        ),
        scheduler=ca.issue(directory, "scheduler", common_name="system:kube-scheduler"),
        controller_manager=ca.issue(
            directory, "controller-manager", common_name="system:kube-controller-manager"
        ),
        # The aggregation layer's identity; configuring it also gives the components the
        # requestheader CA they look up in kube-system/extension-apiserver-authentication.
        front_proxy_client=ca.issue(directory, "front-proxy-client", common_name=FRONT_PROXY_CN),
        service_account_key=sa_key_path,
        service_account_pub=sa_pub_path,
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_private(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_pair(
    directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> CertificateFiles:
    files = CertificateFiles(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.key, key)
    return files
