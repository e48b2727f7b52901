"""pyproject.toml lists every package of the repository's folders under the one import name
`kvdeck` (setuptools cannot find packages under a mapped name by itself)."""

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("runtime", "console", "profiles", "themes", "traces")


def test_every_package_folder_is_listed_under_kvdeck() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    setuptools = config["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"kvdeck": "."}
    on_disk = {"kvdeck"} | {
        "kvdeck." + ".".join(init.parent.relative_to(REPO).parts)
        for folder in FOLDERS for init in (REPO / folder).rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == on_disk
    assert config["project"]["scripts"]["kvdeck"].startswith("kvdeck.")
