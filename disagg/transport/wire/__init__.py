"""The wire protocol: every message between processes (msgspec structs, tagged), their framing into bundles, the
same-host fast lane, error codes and the keys that authenticate sockets. Torch-free."""
