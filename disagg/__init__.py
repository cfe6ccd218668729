"""disagg: disaggregated serving for diffusion models (encoders, denoisers and decoders as separate N:M:K pools
behind one orchestrator). The one import package; docs/architecture.md describes its folders."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("disagg")
except PackageNotFoundError:  # run from a checkout that was not installed
    __version__ = "0+unknown"
