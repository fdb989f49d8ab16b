"""TLS as an operator gets it wrong (issue 34 item 7), with real certificate files made by the ``openssl`` CLI:
``fdeplb serve`` refuses a mismatched, swapped or corrupt certificate/key pair (or an encrypted key) with one line
naming the files and exit 2, before it binds; ``fdeplb status --url https://...`` names what failed in the handshake
(a plain-HTTP server, an unknown CA, a --ca-cert of another CA, a certificate for another host, an expired one)
with OpenSSL's whole reason; ``http://`` to a TLS port says the port seems to speak TLS."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.api_helpers import registered_cluster, serve_process
from tests.api_helpers import PASSWORD, USER, free_port, wait_http
from tests.helpers import run_cli, wait_for

pytestmark = pytest.mark.slow

#: `openssl ca` settings of a self-signed certificate with chosen validity dates (`openssl req` has no past dates)
CA_CONFIG = """[ca]
default_ca = d
[d]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = p
copy_extensions = copy
[p]
commonName = supplied
"""


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _pair(folder: Path, name: str, *, san: str = "IP:127.0.0.1", expired: bool = False) -> tuple[str, str]:
    """A self-signed certificate for ``san`` and its unencrypted key, as ``folder/name.crt`` / ``name.key``;
    ``expired``: valid only on 2020-01-01."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subject = ["-subj", "/CN=fdeplb-test", "-addext", f"subjectAltName={san}"]
    if not expired:
        _openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key.name, "-out", cert.name,
                 "-days", "1", *subject)
        return str(cert), str(key)
    (folder / "ca.cnf").write_text(CA_CONFIG)
    (folder / "index.txt").write_text("")
    (folder / "serial").write_text("01\n")
    _openssl(folder, "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key.name, "-out", "req.csr", *subject)
    _openssl(folder, "ca", "-batch", "-config", "ca.cnf", "-selfsign", "-keyfile", key.name, "-in", "req.csr",
             "-out", cert.name, "-startdate", "20200101000000Z", "-enddate", "20200102000000Z", "-notext")
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("certs")
    cert, key = _pair(folder, "a")
    other_cert, other_key = _pair(folder, "b")
    corrupt = folder / "corrupt.pem"
    corrupt.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    encrypted = folder / "encrypted.key"
    _openssl(folder, "pkey", "-in", key, "-out", encrypted.name, "-aes256", "-passout", "pass:secret")
    expired_cert, expired_key = _pair(folder / "expired", "old", expired=True)
    return {"cert": cert, "key": key, "other_cert": other_cert, "other_key": other_key, "corrupt": str(corrupt),
            "encrypted": str(encrypted), "expired_cert": expired_cert, "expired_key": expired_key}


@pytest.mark.parametrize("cert_name, key_name, said", [
    ("cert", "other_key", "is not the private key of the certificate in --ssl-certfile {cert}"),
    ("key", "cert", "--ssl-certfile {key} holds no PEM certificate but --ssl-keyfile {cert} does: the two files "
                    "look swapped"),
    ("corrupt", "key", "--ssl-certfile {corrupt}: holds no PEM certificate"),
    ("cert", "corrupt", "--ssl-keyfile {corrupt}: holds no readable PEM private key for --ssl-certfile {cert}"),
    ("cert", "encrypted", "--ssl-keyfile {encrypted}: the private key is encrypted"),
])
def test_serve_refuses_a_bad_pair_in_one_line_naming_the_files(redis_url, cluster_id, certs, monkeypatch, capsys,
                                                               cert_name, key_name, said):
    monkeypatch.setenv("FDEPLB_API_USER", USER)
    monkeypatch.setenv("FDEPLB_API_PASSWORD", PASSWORD)
    code, out, err = run_cli(capsys, "serve", "--redis-url", redis_url, "--cluster", cluster_id, "--port",
                             str(free_port()), "--ssl-certfile", certs[cert_name], "--ssl-keyfile", certs[key_name])
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert said.format(**certs) in err, err  # names the file at fault (both, when the pair is)


def test_a_real_serve_with_a_mismatched_pair_exits_2_before_it_binds(redis_url, cluster_id, certs):
    store, _ = registered_cluster(redis_url, cluster_id)
    port = free_port()
    try:
        proc = serve_process(redis_url, cluster_id, port, "--ssl-certfile", certs["cert"], "--ssl-keyfile",
                      certs["other_key"])
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert "Traceback" not in err and "serving" not in out + err
        assert err.strip().splitlines()[-1] == (f"error: --ssl-keyfile {certs['other_key']} is not the private key "
                                                f"of the certificate in --ssl-certfile {certs['cert']} (key values "
                                                f"mismatch)")
    finally:
        store.delete_cluster()


def test_status_over_https_names_what_failed_in_the_handshake(redis_url, cluster_id, certs, monkeypatch, capsys):
    store, _ = registered_cluster(redis_url, cluster_id)
    ports = {name: free_port() for name in ("plain", "tls", "expired")}
    procs = [serve_process(redis_url, cluster_id, ports["plain"]),
             serve_process(redis_url, cluster_id, ports["tls"], "--ssl-certfile", certs["cert"], "--ssl-keyfile",
                    certs["key"]),
             serve_process(redis_url, cluster_id, ports["expired"], "--ssl-certfile", certs["expired_cert"],
                    "--ssl-keyfile", certs["expired_key"])]
    monkeypatch.setenv("FDEPLB_API_USER", USER)
    monkeypatch.setenv("FDEPLB_API_PASSWORD", PASSWORD)
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)

    def status(url: str, *extra: str) -> str:
        code, _out, err = run_cli(capsys, "status", "--url", url, *extra)
        assert code == 7 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
        return err

    try:
        wait_http(f"http://127.0.0.1:{ports['plain']}", proc=procs[0])
        for proc, name in zip(procs[1:], ("tls", "expired")):  # up once the handshake fails, not the connection
            wait_for(lambda: "TLS connection" in run_cli(capsys, "status", "--url",
                                                         f"https://127.0.0.1:{ports[name]}")[2]
                     or proc.poll() is not None, 120, None, f"the {name} serve to listen")
            assert proc.poll() is None
        err = status(f"https://127.0.0.1:{ports['plain']}", "--ca-cert", certs["cert"])
        assert "the server does not speak TLS on that port" in err and "[SSL: WRONG_VERSION_NUMBER] wrong version " \
            "number" in err and "certificate was not verified" not in err, err
        err = status(f"https://127.0.0.1:{ports['tls']}")  # the system's CAs do not hold the test's
        assert "the certificate was not verified: self-signed certificate (pass --ca-cert" in err, err
        err = status(f"https://127.0.0.1:{ports['tls']}", "--ca-cert", certs["other_cert"])  # another CA given
        assert (f"the server's certificate is not signed by the CA in --ca-cert {certs['other_cert']} (self-signed "
                f"certificate): pass the CA that issued it") in err and "pass --ca-cert" not in err, err
        err = status(f"http://127.0.0.1:{ports['tls']}")  # plain HTTP to the TLS port
        assert err.rstrip().endswith(f"the port seems to speak TLS (it completed a TLS handshake): use "
                                     f"https://127.0.0.1:{ports['tls']}"), err
        err = status(f"http://127.0.0.1:{free_port()}")  # nothing listens: no TLS hint
        assert "ConnectionError" in err and "TLS" not in err, err
        err = status(f"https://localhost:{ports['tls']}", "--ca-cert", certs["cert"])  # it names 127.0.0.1 only
        assert "does not name this host (Hostname mismatch, certificate is not valid for 'localhost'.)" in err, err
        err = status(f"https://127.0.0.1:{ports['expired']}", "--ca-cert", certs["expired_cert"])
        assert "the server's certificate has expired (certificate has expired)" in err, err
        code, out, err = run_cli(capsys, "status", "--url", f"https://127.0.0.1:{ports['tls']}", "--ca-cert",
                                 certs["cert"])
        assert code == 0 and "rearrange  FREE" in out, err  # the same server, verified
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.communicate(timeout=30)
        store.delete_cluster()
