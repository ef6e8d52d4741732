"""`splitspec serve` start-up checks that must fail before the model loads (QA ops findings 4, 6, 7):
bad TLS files (unreadable PEM, a key of another certificate, an expired or not-yet-valid
certificate; a warning when expiry is near), a busy or clashing --metrics-port, and --grace /
--min-ping-interval values the service cannot honour.

The in-process tests replace the model load with `ModelWouldLoad`: a check that is late (or
missing) makes them fail at once instead of loading a model and serving forever."""
from __future__ import annotations

import datetime
import socket
import subprocess
import sys

import pytest

from splitspec.cli.main import main
from splitspec.shared.config import CLIENT_KEEPALIVE_TIME_S, ServerSecurity

NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


class ModelWouldLoad(Exception):
    """Raised instead of loading the target: every start-up check has passed."""


@pytest.fixture
def no_model(monkeypatch):
    import splitspec.server.cli as server_cli

    def refuse(*args, **kwargs):
        raise ModelWouldLoad()
    monkeypatch.setattr(server_cli, "loaded_on_compute_thread", refuse)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key, password: bytes | None = None) -> bytes:
    from cryptography.hazmat.primitives import serialization

    encryption = (serialization.BestAvailableEncryption(password) if password
                  else serialization.NoEncryption())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _cert(key, not_before, not_after, cn="localhost") -> bytes:
    """A self-signed PEM certificate of `key` for `cn`, valid from `not_before` to `not_after`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture
def tls_files(tmp_path):
    """name -> path of PEM files: a valid certificate and key (one year), another key, garbage,
    an expired, a not-yet-valid and a soon-expiring certificate of the same key, an encrypted key."""
    key, other = _key(), _key()
    files = {
        "cert": _cert(key, NOW - DAY, NOW + 365 * DAY), "key": _pem_key(key), "other_key": _pem_key(other),
        "garbage": b"not a pem\n", "expired": _cert(key, NOW - 40 * DAY, NOW - 10 * DAY),
        "future": _cert(key, NOW + 10 * DAY, NOW + 400 * DAY), "soon": _cert(key, NOW - DAY, NOW + 3 * DAY),
        "encrypted_key": _pem_key(key, b"secret"), "ca": _cert(other, NOW - DAY, NOW + 365 * DAY, cn="test CA"),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_bytes(data)
    return paths


def _serve(*flags) -> list[str]:
    return ["serve", "--port", "0", *map(str, flags)]


def _refused(capsys, *flags) -> str:
    """The one error line of `splitspec serve FLAGS`, which must exit 2 before the model loads."""
    assert main(_serve(*flags)) == 2
    captured = capsys.readouterr()
    assert "listening" not in captured.out
    lines = [line for line in captured.err.splitlines() if line.startswith("splitspec: error:")]
    assert len(lines) == 1, captured.err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# F4: TLS files are parsed at start-up


@pytest.mark.parametrize("cert, key, ca, flag, why", [
    ("garbage", "key", None, "cert", "no PEM certificate"),
    ("cert", "garbage", None, "key", "no PEM private key"),
    ("cert", "other_key", None, "key", "does not match"),
    ("cert", "key", "garbage", "client_ca", "no PEM certificate"),
    ("cert", "encrypted_key", None, "key", "encrypted"),
])
def test_unreadable_or_mismatched_tls_files_are_refused_naming_the_file(no_model, tls_files, capsys,
                                                                        cert, key, ca, flag, why):
    flags = ["--tls-cert", tls_files[cert], "--tls-key", tls_files[key]]
    if ca:
        flags += ["--tls-client-ca", tls_files[ca]]
    line = _refused(capsys, *flags)
    named = {"cert": tls_files[cert], "key": tls_files[key], "client_ca": tls_files[ca] if ca else None}[flag]
    assert why in line and f"--tls-{flag.replace('_', '-')} {named}" in line, line
    assert "Failed to bind" not in line


def test_an_expired_or_not_yet_valid_certificate_is_refused_with_its_dates(no_model, tls_files, capsys):
    line = _refused(capsys, "--tls-cert", tls_files["expired"], "--tls-key", tls_files["key"])
    assert f"--tls-cert {tls_files['expired']}" in line and "expired on" in line
    assert (NOW - 10 * DAY).strftime("%Y-%m-%d") in line and (NOW - 40 * DAY).strftime("%Y-%m-%d") in line
    line = _refused(capsys, "--tls-cert", tls_files["future"], "--tls-key", tls_files["key"])
    assert "not valid yet" in line and (NOW + 10 * DAY).strftime("%Y-%m-%d") in line


def test_a_valid_certificate_passes_and_a_near_expiry_only_warns(no_model, tls_files, capsys, caplog):
    with pytest.raises(ModelWouldLoad):
        main(_serve("--tls-cert", tls_files["cert"], "--tls-key", tls_files["key"],
                    "--tls-client-ca", tls_files["ca"]))
    assert "expires" not in caplog.text + capsys.readouterr().err
    with pytest.raises(ModelWouldLoad):
        main(_serve("--tls-cert", tls_files["soon"], "--tls-key", tls_files["key"]))
    warned = caplog.text + capsys.readouterr().err
    assert f"--tls-cert {tls_files['soon']}" in warned and "expires on" in warned
    assert (NOW + 3 * DAY).strftime("%Y-%m-%d") in warned


def test_server_credentials_checks_the_pem_too(tls_files):
    from splitspec.server.auth import server_credentials

    read = lambda name: tls_files[name].read_bytes()  # noqa: E731
    assert server_credentials(ServerSecurity(tls_cert=read("cert"), tls_key=read("key"), tls_client_ca=read("ca")))
    with pytest.raises(ValueError, match="does not match"):
        server_credentials(ServerSecurity(tls_cert=read("cert"), tls_key=read("other_key")))
    with pytest.raises(ValueError, match="expired"):
        server_credentials(ServerSecurity(tls_cert=read("expired"), tls_key=read("key")))


def test_the_near_expiry_warning_reaches_stderr_before_the_model_loads(tls_files):
    """A real `splitspec serve` process: the warning is on stderr, and a later flag mistake (the
    metrics port equal to the service's) still ends it with status 2 before any model loads."""
    port = _free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "splitspec.cli", "serve", "--target", "no-such-model-anywhere", "--port", str(port),
         "--metrics-port", str(port), "--tls-cert", str(tls_files["soon"]), "--tls-key", str(tls_files["key"])],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "expires on" in proc.stderr and str(tls_files["soon"]) in proc.stderr
    assert f"--metrics-port {port}" in proc.stderr.splitlines()[-1]
    assert "listening" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# F6: a busy --metrics-port fails before the service starts


def test_a_busy_metrics_port_fails_before_the_service_starts_naming_it(no_model, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _refused(capsys, "--metrics-port", port)
    assert f"metrics port 127.0.0.1:{port}: address already in use" in line


def test_a_busy_service_port_fails_before_the_model_loads(no_model, capsys):
    """The verify service's own --port: in use, it was found after the model load, as gRPC's
    "Failed to bind to address"."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _refused(capsys, "--port", port)
    assert f"port 127.0.0.1:{port}: address already in use" in line and "--port" in line


def test_the_metrics_port_may_not_be_the_service_port(no_model, capsys):
    port = _free_port()
    line = _refused(capsys, "--port", port, "--metrics-port", port)
    assert f"--metrics-port {port}" in line and "--port" in line


def test_the_metrics_port_is_held_while_the_model_loads_and_freed_for_serve(monkeypatch, capsys):
    import splitspec.server.cli as server_cli
    import splitspec.server.service as service

    port, seen = _free_port(), {}

    def load(name, build):
        with socket.socket() as rival, pytest.raises(OSError):  # another process cannot take it meanwhile
            rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            rival.bind(("127.0.0.1", port))
        return None, None

    async def serve(runner, host, port_, limits, **kw):
        from prometheus_client import CollectorRegistry, start_http_server

        http, _ = start_http_server(kw["metrics_port"], addr=kw["metrics_host"], registry=CollectorRegistry())
        seen["bound"] = http.server_port
        http.shutdown()
        http.server_close()

    monkeypatch.setattr(server_cli, "loaded_on_compute_thread", load)
    monkeypatch.setattr(service, "serve", serve)
    assert main(_serve("--metrics-port", port)) == 0, capsys.readouterr().err
    assert seen["bound"] == port


def test_reserve_metrics_port_without_metrics_or_with_port_0():
    from splitspec.server.cli import reserve_metrics_port

    assert reserve_metrics_port("127.0.0.1", None, "127.0.0.1", 50051) is None
    assert reserve_metrics_port("127.0.0.1", 0, "127.0.0.1", 0) is None
    port = _free_port()
    held = reserve_metrics_port("127.0.0.1", port, "0.0.0.0", 0)  # service on any free port: no clash
    held.close()
    with pytest.raises(ValueError, match="--port"):
        reserve_metrics_port("127.0.0.1", port, "0.0.0.0", port)


# ---------------------------------------------------------------------------------------------
# F7: --grace and --min-ping-interval


def _usage_error(capsys, *flags) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(_serve(*flags))
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf"])
def test_grace_must_be_finite_and_not_negative(no_model, capsys, value):
    err = _usage_error(capsys, f"--grace={value}")
    assert "argument --grace" in err and "finite number >= 0" in err


@pytest.mark.parametrize("value", ["100", "30.5", "0", "-5", "nan", "inf"])
def test_min_ping_interval_above_the_client_keepalive_is_refused(no_model, capsys, value):
    err = _usage_error(capsys, f"--min-ping-interval={value}")
    assert "argument --min-ping-interval" in err
    if CLIENT_KEEPALIVE_TIME_S < float(value) < float("inf"):
        assert "too_many_pings" in err and f"<= {CLIENT_KEEPALIVE_TIME_S:g}" in err


@pytest.mark.parametrize("flags", [("--grace", "0"), ("--grace", "2.5"), ("--min-ping-interval", "0.5"),
                                   ("--min-ping-interval", str(CLIENT_KEEPALIVE_TIME_S))])
def test_sensible_grace_and_ping_values_pass(no_model, flags):
    with pytest.raises(ModelWouldLoad):
        main(_serve(*flags))


def test_the_shared_keepalive_constant_is_the_clients():
    """The server's bound on --min-ping-interval is the client's own ping interval."""
    from splitspec.client.transport import CHANNEL_OPTIONS

    assert dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"] == round(CLIENT_KEEPALIVE_TIME_S * 1e3)
