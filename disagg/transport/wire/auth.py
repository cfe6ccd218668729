"""CurveZMQ keys: who may talk to the orchestrator (torch-free, shared by every process).

`disagg keys generate DIR` writes a server pair and a client pair, and DIR/clients with the client pair and
the server's public key alone: what clients, roles and join hosts need. The orchestrator's sockets
are Curve servers that accept only peers holding a key pair whose public half lies in DIR;
clients and roles connect with the client pair. Without the keys a process can neither submit
nor register: its connection is refused during the handshake.
"""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class KeyError_(ValueError):
    """A keys directory that lacks a needed key file."""


KEY_NAMES = ("server", "client")


def key_files(directory: Path) -> list[Path]:
    """The four files `generate_keys` writes into `directory`."""
    return [directory / f"{name}{ext}" for name in KEY_NAMES for ext in (".key", ".key_secret")]


#: the sub-folder of a keys directory with what a client, a role or a join host needs, and nothing more: the
#: client pair and the server's public key. Only the orchestrator's host needs the whole directory (it holds
#: the server's secret key)
CLIENTS = "clients"


def generate_keys(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in KEY_NAMES:
        public, secret = zmq.auth.create_certificates(str(directory), name)
        Path(secret).chmod(0o600)
        written += [Path(public), Path(secret)]
    clients = directory / CLIENTS
    clients.mkdir(exist_ok=True)
    for name in ("client.key", "client.key_secret", "server.key"):
        (clients / name).write_bytes((directory / name).read_bytes())
        (clients / name).chmod((directory / name).stat().st_mode & 0o777)
        written.append(clients / name)
    return written


def _load(directory: Path, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    path = directory / (f"{name}.key_secret" if secret else f"{name}.key")
    if not path.is_file():
        raise KeyError_(f"{path} is missing: create keys with `disagg keys generate {directory}`")
    return zmq.auth.load_certificate(str(path))


def client_curve(directory: Path) -> tuple[bytes, bytes, bytes]:
    """(server public, client public, client secret) for a connecting socket."""
    server_public, _ = _load(directory, "server", secret=False)
    public, secret = _load(directory, "client", secret=True)
    return server_public, public, secret


def apply_client_curve(sock: zmq.Socket, curve: tuple[bytes, bytes, bytes] | None) -> None:
    if curve:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve


def secure_server(ctx: zmq.Context, sockets: list[zmq.Socket], directory: Path) -> ThreadAuthenticator:
    """Make `sockets` Curve servers that admit only the public keys found in `directory`."""
    public, secret = _load(directory, "server", secret=True)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(directory))
    for sock in sockets:
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    return auth
