"""Start, watch and stop Flower deployment processes (SuperLink, SuperNodes, the CLI) on 127.0.0.1.

Every process starts in its own session (so its own process group) and is stopped by the
PID recorded at start: SIGTERM to the group, then SIGKILL to whatever is left after a grace
period. Nothing is ever looked up or killed by name.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

LOOPBACK = "127.0.0.1"
VENV_BIN = Path(sys.executable).parent
"""The Flower CLIs are taken from the interpreter's own environment, never from $PATH."""


def flower_bin(name: str) -> str:
    return str(VENV_BIN / name)


def skip_without_flower_clis() -> None:
    """Skip the calling test module when the Flower CLIs are not next to this interpreter."""
    if not all(Path(flower_bin(name)).exists() for name in ("flower-superlink", "flwr")):
        pytest.skip(
            "the Flower CLIs are not installed next to this interpreter", allow_module_level=True
        )


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (each socket is held until all are bound)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def flower_env(
    home: Path, *, net_audit: Path | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of one Flower process: its own FLWR_HOME, no telemetry, no update
    check, no `uv sync`; with ``net_audit``, every Python process records its socket calls."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    env.pop("LENSEMBLE_RUN_DIR", None)
    if net_audit is not None:
        install_net_audit(net_audit)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(net_audit), env.get("PYTHONPATH")]))
        env["LENSEMBLE_NET_AUDIT_DIR"] = str(net_audit / "events")
    env.update(
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        # Every Flower 1.42 CLI (flwr, flower-superlink, -supernode, -superexec) otherwise
        # POSTs its version, Python version and OS to https://api.flower.ai once a day per
        # FLWR_HOME, whatever FLWR_TELEMETRY_ENABLED says (flwr/supercore/update_check.py).
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        # SuperExec finds flwr-serverapp / flwr-clientapp on PATH: the venv's bin first.
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    env.update(extra or {})
    return env


# -- network audit -----------------------------------------------------------------------
_NET_AUDIT_HOOK = """\
# Written by tests/helpers/deployment_helpers.py: record the socket calls of this Python process.
import os as _os
import sys as _sys

_DIR = _os.environ.get("LENSEMBLE_NET_AUDIT_DIR")
_ADDRESS_EVENTS = ("socket.connect", "socket.sendto", "socket.bind")


def _lensemble_net_audit(event, args):
    if not _DIR or not event.startswith("socket."):
        return
    try:
        if event in _ADDRESS_EVENTS:
            address = args[1]
            if not isinstance(address, tuple):
                return  # AF_UNIX and the like: no network
            host, port = address[0], address[1]
        elif event == "socket.getaddrinfo":
            host, port = args[0], args[1]
        elif event in ("socket.gethostbyname", "socket.gethostbyaddr"):
            host, port = args[0], None
        else:
            return
        if isinstance(host, bytes):
            host = host.decode(errors="replace")
        _os.makedirs(_DIR, exist_ok=True)
        argv = " ".join(_sys.argv[:2])[:100]
        with open(_os.path.join(_DIR, f"{_os.getpid()}.log"), "a") as f:
            f.write(f"{event}\\t{host}\\t{port}\\t{argv}\\n")
    except Exception:
        pass


_sys.addaudithook(_lensemble_net_audit)
"""


@dataclass(frozen=True)
class NetEvent:
    pid: int
    event: str
    host: str
    port: str
    argv: str


def install_net_audit(folder: Path) -> None:
    """A ``sitecustomize`` in ``folder`` (put it on PYTHONPATH) that logs socket calls."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_NET_AUDIT_HOOK)


def read_net_audit(folder: Path) -> list[NetEvent]:
    events = []
    for log in sorted((folder / "events").glob("*.log")):
        for line in log.read_text().splitlines():
            event, host, port, argv = [*line.split("\t"), "", "", ""][:4]
            events.append(NetEvent(int(log.stem), event, host, port, argv))
    return events


def off_loopback(events: Iterable[NetEvent]) -> list[NetEvent]:
    """Name look-ups, connections and datagrams to anything but 127.0.0.1, and binds to
    anything but loopback (urllib3 probes for IPv6 by binding ``::1`` port 0)."""
    bad = []
    for e in events:
        if e.event == "socket.bind":
            ok = e.host == LOOPBACK or (e.host == "::1" and e.port == "0")
        else:
            ok = e.host == LOOPBACK
        if not ok:
            bad.append(e)
    return bad


# -- processes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    state: str
    started: int  # clock ticks after boot: tells a reused PID apart
    cmdline: str

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.started


def _read_proc(pid: int) -> ProcInfo | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) is in parentheses and may itself contain spaces or ')'
    rest = stat[stat.rindex(")") + 2 :].split()
    return ProcInfo(
        pid=pid,
        ppid=int(rest[1]),
        pgid=int(rest[2]),
        state=rest[0],
        started=int(rest[19]),
        cmdline=raw.replace(b"\0", b" ").decode(errors="replace").strip(),
    )


def all_processes() -> list[ProcInfo]:
    procs = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (info := _read_proc(int(entry.name))) is not None:
            procs.append(info)
    return procs


def processes_in_groups(pgids: Iterable[int]) -> list[ProcInfo]:
    """Every process (zombies included, state ``Z``) whose process group is one of ``pgids``."""
    wanted = set(pgids)
    return [p for p in all_processes() if p.pgid in wanted]


def live(procs: Iterable[ProcInfo]) -> list[ProcInfo]:
    return [p for p in procs if p.state != "Z"]


def still_running(known: Iterable[ProcInfo]) -> list[ProcInfo]:
    """Those of ``known`` that still exist (same PID *and* start time) and are not zombies."""
    out = []
    for p in known:
        now = _read_proc(p.pid)
        if now is not None and now.started == p.started and now.state != "Z":
            out.append(now)
    return out


@dataclass
class ManagedProcess:
    """A process started in its own session; ``pid`` is also its process group id."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    _log_file: object = field(repr=False, default=None)
    _copier: threading.Thread | None = field(repr=False, default=None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until everything the process wrote is in the log (its pipe has closed)."""
        if self._copier is not None:
            self._copier.join(timeout=timeout)

    def close_log(self) -> None:
        self.drain(timeout=2)  # the pipe closes once every writer has exited
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]


def start(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    cwd: Path | None = None,
) -> ManagedProcess:
    """Start ``argv`` in a new session; stdout and stderr go to ``log_path``, each line
    prefixed with the wall-clock time it was read (so logs of different processes line up).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "wb")  # noqa: SIM115  (closed in ManagedProcess.close_log)
    popen = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
    )
    copier = threading.Thread(
        target=_copy_lines, args=(popen.stdout, log_file), name=f"log-{name}", daemon=True
    )
    copier.start()
    return ManagedProcess(name, popen, log_path, _log_file=log_file, _copier=copier)


_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def _set_child_subreaper(on: bool) -> bool | None:
    """Linux ``prctl(PR_SET_CHILD_SUBREAPER)``; returns the previous setting (None: not set)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        previous = ctypes.c_int(0)
        if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0) != 0:
            return None
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            return None
        return bool(previous.value)
    except (OSError, AttributeError):
        return None


# Registries may run at once (test_deployment_auth.py's in a thread beside
# test_deployment.py's): this process stays a subreaper until the last of them stops.
_subreaper_lock = threading.Lock()
_subreaper_holders = 0
_subreaper_before: bool | None = None


def _hold_subreaper() -> bool:
    """Make this process a child subreaper for one more registry; False where it cannot."""
    global _subreaper_holders, _subreaper_before
    with _subreaper_lock:
        if _subreaper_holders == 0:
            _subreaper_before = _set_child_subreaper(True)
            if _subreaper_before is None:
                return False
        _subreaper_holders += 1
        return True


def _release_subreaper() -> None:
    """One registry less; the last one restores the setting from before the first."""
    global _subreaper_holders, _subreaper_before
    with _subreaper_lock:
        _subreaper_holders -= 1
        if _subreaper_holders == 0 and _subreaper_before is not None:
            _set_child_subreaper(_subreaper_before)
            _subreaper_before = None


def _copy_lines(src, dst) -> None:  # type: ignore[no-untyped-def]
    with contextlib.suppress(ValueError, OSError):  # dst closed: nothing left to copy
        for line in iter(src.readline, b""):
            stamp = datetime.now().strftime("%H:%M:%S.%f")[:-3]
            dst.write(f"{stamp} ".encode() + line)
            dst.flush()


class ProcessRegistry:
    """Every process started here, and every process they start, stopped by PID.

    Flower detaches some of its children into sessions of their own (the SuperLink starts
    its SuperExec with ``start_new_session=True``), so a ``killpg`` on the SuperLink's group
    does not reach them. ``refresh`` therefore follows the parent links from the processes
    started here and remembers every descendant (PID and start time) and its group;
    ``stop_all`` signals those groups first, then the groups of the processes started here.
    """

    def __init__(self, *, adopt_orphans: bool = True) -> None:
        self.procs: list[ManagedProcess] = []
        self.known: dict[tuple[int, int], ProcInfo] = {}
        self._lock = threading.Lock()
        # Flower never waits for some of its children (a SuperNode's SuperExec), so when
        # their parent dies first they are re-parented to PID 1, and a PID 1 that does not
        # reap promptly (a bare container, this sandbox) keeps them as <defunct> zombies.
        # As a child subreaper, this process adopts them instead and reaps them by PID.
        self._holds_subreaper = _hold_subreaper() if adopt_orphans else False

    def start(self, name: str, argv: Sequence[str], **kwargs: object) -> ManagedProcess:
        proc = start(name, argv, **kwargs)  # type: ignore[arg-type]
        self.procs.append(proc)
        if (info := _read_proc(proc.pid)) is not None:
            with self._lock:
                self.known[info.key] = info
        return proc

    @property
    def pgids(self) -> list[int]:
        """The process groups of everything started, leaders' groups last."""
        with self._lock:
            leaders = [p.pid for p in self.procs]
            others = sorted({p.pgid for p in self.known.values()} - set(leaders))
        return others + leaders

    def refresh(self) -> list[ProcInfo]:
        """Remember every new descendant of a live known process (and every newcomer to a
        group that has a live known member); return the known processes still running."""
        snapshot = all_processes()
        with self._lock:
            alive = [p for p in snapshot if p.key in self.known]
            pids = {p.pid for p in alive}
            groups = {p.pgid for p in alive}
            changed = True
            while changed:
                changed = False
                for p in snapshot:
                    if p.key not in self.known and (p.ppid in pids or p.pgid in groups):
                        self.known[p.key] = p
                        pids.add(p.pid)
                        groups.add(p.pgid)
                        changed = True
            known = list(self.known.values())
        return still_running(known)

    def _signal_groups(self, sig: int) -> None:
        """Signal each group that still holds a known process (so never a group whose id
        was recycled by someone else), descendants' groups before the leaders'."""
        snapshot = {p.key: p for p in all_processes()}
        with self._lock:
            ours = {snapshot[k].pgid for k in self.known if k in snapshot}
        for pgid in self.pgids:
            if pgid in ours:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, sig)

    def stop_all(self, grace: float = 10.0) -> list[ProcInfo]:
        """SIGTERM every group (descendants' groups first), SIGKILL what is left after
        ``grace`` s. Returns the processes that survived even that (should be none)."""
        self.refresh()
        self._signal_groups(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for proc in self.procs:
                proc.popen.poll()  # reap our direct children as soon as they exit
            if not self.refresh():
                break
            time.sleep(0.1)
        else:
            self._signal_groups(signal.SIGKILL)
            for p in self.refresh():  # a straggler that left its group: by its own PID
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=5)
            proc.close_log()
        left = self.refresh()
        for _ in range(30):
            self._reap_adopted()
            if not (left := self.refresh()):
                break
            time.sleep(0.1)
        self._reap_adopted()
        if self._holds_subreaper:
            _release_subreaper()
            self._holds_subreaper = False
        return left

    def _reap_adopted(self) -> None:
        """``waitpid`` each known process that is now a zombie child of this process."""
        with self._lock:
            known = list(self.known.values())
        for p in known:
            now = _read_proc(p.pid)
            if now is not None and now.started == p.started and now.state == "Z":
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(p.pid, os.WNOHANG)

    def zombies(self) -> list[ProcInfo]:
        """Known processes that exited but were never reaped (still listed as <defunct>)."""
        with self._lock:
            known = list(self.known.values())
        return [
            n
            for p in known
            if (n := _read_proc(p.pid)) is not None and n.started == p.started and n.state == "Z"
        ]

    def dump_logs(self, out=sys.stdout) -> None:  # type: ignore[no-untyped-def]
        for proc in self.procs:
            print(f"\n===== {proc.name} (pid {proc.pid}) log: {proc.log_path} =====", file=out)
            print(proc.log()[-20000:], file=out)


# -- waiting ------------------------------------------------------------------------------
class StartupError(RuntimeError):
    pass


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    *,
    proc: ManagedProcess | None = None,
    interval: float = 0.1,
) -> float:
    """Poll ``predicate`` until true; return the seconds waited. Fails fast if ``proc`` dies."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        if proc is not None and not proc.running():
            raise StartupError(f"{proc.name} exited (rc={proc.popen.returncode}) before {what}")
        time.sleep(interval)
    raise StartupError(f"timed out after {timeout:.0f} s waiting for {what}")


def http_ok(url: str, *, cafile: Path | None = None) -> bool:
    """A 2xx answer from ``url``; an ``https`` URL is checked against ``cafile`` only."""
    context = ssl.create_default_context(cafile=str(cafile)) if cafile is not None else None
    try:
        with urllib.request.urlopen(url, timeout=0.5, context=context) as resp:
            return 200 <= resp.status < 300
    except OSError:
        return False


def write_cli_config(
    home: Path, connection: str, port: int, *, root_certificates: Path | None = None
) -> Path:
    """``$FLWR_HOME/config.toml`` naming one SuperLink connection (the default): insecure,
    or TLS checked against ``root_certificates`` (an absolute path)."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    security = (
        "insecure = true"
        if root_certificates is None
        else f'root-certificates = "{root_certificates.resolve()}"'
    )
    path.write_text(
        f'[superlink]\ndefault = "{connection}"\n\n'
        f'[superlink.{connection}]\naddress = "{LOOPBACK}:{port}"\n{security}\n'
    )
    return path


def flwr_json(argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> dict:  # type: ignore[type-arg]
    """Run ``flwr <argv> --format json`` and parse what it prints."""
    out = subprocess.run(
        [flower_bin("flwr"), *argv, "--format", "json"],
        env=dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        start_new_session=True,
    )
    try:
        return json.loads(out.stdout)
    except json.JSONDecodeError as exc:
        command = " ".join(argv)
        raise AssertionError(
            f"flwr {command} gave no JSON (rc={out.returncode}):\n{out.stdout}\n{out.stderr}"
        ) from exc


def flwr_ls(connection: str, env: Mapping[str, str], cwd: Path) -> dict:  # type: ignore[type-arg]
    return flwr_json(["ls", connection], env, cwd)


# -- TLS certificates and SuperNode keys -------------------------------------------------------
@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the CA certificate everyone trusts (PEM)
    cert: Path  # the SuperLink's certificate, signed by the CA (PEM)
    key: Path  # the SuperLink's private key (PEM)


def make_tls_files(folder: Path, *, hosts: Sequence[str] = ("localhost", LOOPBACK)) -> TlsFiles:
    """A fresh CA (EC P-256) and a server certificate it signs, valid for ``hosts`` (DNS
    names and IP addresses as subject alternative names) for one day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lensemble test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    server_key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.pem", folder / "superlink.pem", folder / "superlink.key")
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files.key.chmod(0o600)
    return files


@dataclass(frozen=True)
class NodeKey:
    private: Path  # OpenSSH private key, for --auth-supernode-private-key
    public: Path  # OpenSSH public key, for `flwr supernode register`


def make_node_key(folder: Path, name: str, *, bits: int = 384) -> NodeKey:
    """A SuperNode authentication key: ECDSA over NIST P-256 or P-384 in OpenSSH format
    (what ``ssh-keygen -t ecdsa -b <bits> -N ""`` writes)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    curve = {256: ec.SECP256R1, 384: ec.SECP384R1}[bits]()
    key = ec.generate_private_key(curve)
    folder.mkdir(parents=True, exist_ok=True)
    pair = NodeKey(folder / name, folder / f"{name}.pub")
    pair.private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    pair.private.chmod(0o600)
    pair.public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + f" {name}\n".encode()
    )
    return pair


# -- sockets ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SocketUse:
    pid: int
    cmdline: str
    proto: str
    local: str
    remote: str
    state: str


def _decode_addr(hex_addr: str) -> str:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    # /proc/net lists the address as 32-bit words in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return f"{socket.inet_ntop(family, raw)}:{int(port_hex, 16)}"


def _socket_table() -> dict[int, tuple[str, str, str, str]]:
    table = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            parts = line.split()
            table[int(parts[9])] = (proto, _decode_addr(parts[1]), _decode_addr(parts[2]), parts[3])
    return table


def sockets_of(procs: Iterable[ProcInfo]) -> set[SocketUse]:
    """The IP sockets held right now by the given processes."""
    table = _socket_table()
    uses = set()
    for proc in procs:
        try:
            fds = list(Path(f"/proc/{proc.pid}/fd").iterdir())
        except (FileNotFoundError, PermissionError):
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and (inode := int(target[8:-1])) in table:
                proto, local, remote, state = table[inode]
                uses.add(SocketUse(proc.pid, proc.cmdline[:120], proto, local, remote, state))
    return uses


def non_loopback(uses: Iterable[SocketUse]) -> list[SocketUse]:
    """Sockets bound to, or talking to, anything other than 127.0.0.1."""
    ok_local = {LOOPBACK}
    ok_remote = {LOOPBACK, "0.0.0.0"}  # 0.0.0.0:0 is the remote of a listening socket
    bad = []
    for u in uses:
        local_ip, remote_ip = u.local.rsplit(":", 1)[0], u.remote.rsplit(":", 1)[0]
        if local_ip not in ok_local or remote_ip not in ok_remote:
            bad.append(u)
    return bad


class SocketSampler:
    """Samples the registry's processes (descendants included) and their sockets in a thread."""

    def __init__(self, registry: ProcessRegistry, interval: float = 0.5) -> None:
        self.registry = registry
        self.interval = interval
        self.seen: set[SocketUse] = set()
        self.processes: dict[int, ProcInfo] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        running = self.registry.refresh()
        self.processes.update((p.pid, p) for p in running)
        self.seen |= sockets_of(running)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> SocketSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def programs(self) -> dict[str, int]:
        """How many distinct processes ran each program (by the basename of argv[0] or [1])."""
        counts: dict[str, int] = {}
        for proc in self.processes.values():
            words = proc.cmdline.split()
            prog = next(
                (Path(w).name for w in words[:2] if "flwr" in w or "flower" in w),
                Path(words[0]).name if words else "?",
            )
            counts[prog] = counts.get(prog, 0) + 1
        return counts
