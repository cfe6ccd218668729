"""Every setting, declared once (schema.py), and what is made from it: sources merged by precedence
(sources.py), each process's settings object (process.py), and documents (render.py).

The ground floor, beside transport/: the orchestrator, the gateway and the roles decode their settings from
here and never import disagg/launcher/.
"""

from disagg.settings.schema import ROLE_SECTIONS, HttpSettings, ParallelLayout, RolePool, Settings
from disagg.settings.sources import Resolved, SettingsError, resolve

__all__ = ["ROLE_SECTIONS", "HttpSettings", "ParallelLayout", "Resolved", "RolePool", "Settings", "SettingsError",
           "resolve"]
