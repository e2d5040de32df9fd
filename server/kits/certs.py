"""Key material for a pilot: a CA and a server TLS certificate (the given hosts and the loopback names,
which the SuperLink's own SuperExec dials), and for test pilots SuperNode ECDSA key pairs (a real site makes
its own with ``fedpose site keygen`` and sends only the public key: ``fedpose.shared.flower.node_keys``).
cryptography is imported inside the functions. Every file is written to a new inode (O_EXCL, then renamed),
private keys at 0600.
"""

from __future__ import annotations

from pathlib import Path

from fedpose.shared.flower.node_keys import node_key_pair, write_key_file

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def make_certs(out: Path, *, nodes: int, hosts: list[str], days: int, force: bool = False) -> list[Path]:
    """CA, a server certificate for ``hosts`` and the loopback names (SAN) and ``nodes`` ECDSA node key
    pairs (OpenSSH format).

    Files: ca.crt, ca.key, server.pem, server.key, node-<i> (private key) and node-<i>.pub.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if nodes < 0 or days < 1:
        raise ValueError(f"--nodes ({nodes}) must be >= 0 and --days ({days}) >= 1")
    names = ["ca.crt", "ca.key", "server.pem", "server.key"] + [f"node-{i}{s}" for i in range(1, nodes + 1)
                                                               for s in ("", ".pub")]
    out.mkdir(parents=True, exist_ok=True)
    existing = [n for n in names if (out / n).exists()]
    if existing and not force:
        raise ValueError(f"{out} already holds {existing[:3]}: use --force to overwrite or another --out")

    def write(name: str, data: bytes, private: bool) -> Path:
        return write_key_file(out / name, data, private=private)

    pem = serialization.Encoding.PEM
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpose CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    # The SuperLink's own SuperExec (which starts every ServerApp) dials it on 127.0.0.1: without the
    # loopback names the handshake fails and every run stays "pending". The first host is the one sites dial.
    for host in dict.fromkeys([*hosts, *LOOPBACK_NAMES]):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(server_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    no_pw = serialization.NoEncryption()
    written = [
        write("ca.crt", ca_cert.public_bytes(pem), False),
        write("ca.key", ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_pw), True),
        write("server.pem", server_cert.public_bytes(pem), False),
        write("server.key", server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_pw), True),
    ]
    for i in range(1, nodes + 1):  # test and single-operator pilots only: a real site makes its own (site keygen)
        private, public = node_key_pair(f"fedpose-node-{i}")
        written.append(write(f"node-{i}", private, True))
        written.append(write(f"node-{i}.pub", public, False))
    return written
