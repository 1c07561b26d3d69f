"""Certificates for a SuperLink served over TLS: a certificate authority (``ca.crt``, the file
every SuperNode and ``flwr`` user is given) and the SuperLink's certificate signed by it
(``server.pem`` and its key ``server.key``, which stay on the SuperLink's machine).

The SuperLink's certificate names ``localhost``, ``127.0.0.1`` and ``::1`` (the SuperLink's own
ServerApp process connects to it there) and every host name or address given on the command
line: each name under which SuperNodes or ``flwr run`` reach the SuperLink must be among them.
The keys are ECDSA P-256, unencrypted, with owner-only permissions. It uses the
``cryptography`` package, which Flower itself depends on, so no ``openssl`` command is needed::

    python make_certs.py                                  # localhost only, into certificates/
    python make_certs.py superlink.example.org 10.0.0.5   # and the names the sites use
    python make_certs.py --out /etc/flower/tls --days 90

A folder that already holds the four files is left as it is (the SuperNodes already trust that
CA) unless ``--force``.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

FILES = ("ca.crt", "ca.key", "server.pem", "server.key")
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def subject_names(hosts: list[str]) -> list[x509.GeneralName]:
    """The certificate's subject alternative names: an IP address entry for each address, a DNS
    entry for each host name (the local names first, each name once)."""
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*LOCAL_NAMES, *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 issuer_key: ec.EllipticCurvePrivateKey, days: int,
                 extensions: list[tuple[x509.ExtensionType, bool]]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   issuer_key.public_key()), False))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical)
    return builder.sign(issuer_key, hashes.SHA256())


def _usage(**granted: bool) -> x509.KeyUsage:
    flags = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
             "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{flag: granted.get(flag, False) for flag in flags})


def make_certificates(out: str | os.PathLike, hosts: list[str], days: int = 365) -> Path:
    """Write ``ca.crt``/``ca.key`` (a new CA) and ``server.pem``/``server.key`` (the SuperLink's
    certificate for ``localhost`` and ``hosts``, signed by that CA) into ``out``.

    >>> import tempfile
    >>> from cryptography import x509
    >>> folder = make_certificates(tempfile.mkdtemp(), ["superlink.example.org"])
    >>> cert = x509.load_pem_x509_certificate((folder / "server.pem").read_bytes())
    >>> names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    >>> names.get_values_for_type(x509.DNSName)
    ['localhost', 'superlink.example.org']
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedppl example CA")])
    ca = _certificate("fedppl example CA", ca_key, ca_name, ca_key, days, [
        (x509.BasicConstraints(ca=True, path_length=0), True),
        (_usage(key_cert_sign=True, crl_sign=True), True)])
    server = _certificate("fedppl SuperLink", server_key, ca.subject, ca_key, days, [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (_usage(digital_signature=True), True),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
        (x509.SubjectAlternativeName(subject_names(hosts)), False)])
    for name, key in (("ca.key", ca_key), ("server.key", server_key)):
        path = folder / name
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "server.pem").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hosts", nargs="*", help="more host names or addresses of the SuperLink")
    parser.add_argument("--out", default="certificates", help="folder (default: certificates)")
    parser.add_argument("--days", type=int, default=365, help="validity (default: 365)")
    parser.add_argument("--force", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    missing = [name for name in FILES if not (Path(args.out) / name).exists()]
    if len(missing) < len(FILES) and not args.force:
        if missing:
            print(f"make_certs: {args.out}/ lacks {', '.join(missing)}; --force writes a new "
                  "set", file=sys.stderr)
            return 1
        print(f"make_certs: keeping the certificates in {args.out}/ (--force makes a new CA, "
              "which every SuperNode must then be given)", file=sys.stderr)
        return 0
    folder = make_certificates(args.out, args.hosts, args.days)
    names = ", ".join(str(n.value) for n in subject_names(args.hosts))
    print(f"make_certs: wrote {', '.join(FILES)} to {folder}/ (server certificate for {names})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
