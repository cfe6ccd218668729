"""`python -m disagg.settings yaml|table`: configs/tiny.yaml or the settings table of docs/guide/settings.md, from the schema."""

import sys

from disagg.settings.render import readme_table, tiny_yaml

if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what not in ("yaml", "table"):
        sys.exit("usage: python -m disagg.settings yaml|table")
    sys.stdout.write(tiny_yaml() if what == "yaml" else readme_table())
