"""The wheel holds one top-level package, `kvdeck`, with every module of the repository's
folders; profiles/, themes/ and the sample traces ship inside it and are found from it, not
from the checkout."""

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("runtime", "console", "profiles", "themes", "traces")


def test_resources_found_from_editable_install() -> None:
    from kvdeck.runtime.resources import profile_names, profiles_dir, themes_dir

    assert Path(str(profiles_dir())) == REPO / "profiles"
    assert "rtx-pro-6000" in profile_names("hardware")
    assert themes_dir().joinpath("themes.toml").is_file()


@pytest.mark.slow
def test_resources_found_from_built_wheel(tmp_path: Path, tiny_llama: Path) -> None:
    # Built from the tracked files alone: setuptools would also pack whatever a stale
    # build/ folder in the checkout holds.
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO,
                             check=True).stdout.split()
    for name in tracked:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheel_dir), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = wheel_dir.glob("kvdeck-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvdeck"}, tops
    sources = {f"kvdeck/{p.relative_to(REPO)}" for folder in PACKAGE_FOLDERS
               for p in (REPO / folder).rglob("*.py")}
    assert sources <= set(names), sorted(sources - set(names))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site,
                    str(wheel)], check=True, capture_output=True, timeout=300)
    # Dependencies come from the dev venv through a .pth line; .pth files inside that
    # directory (the editable install's finder) are not processed, so `kvdeck.runtime` and
    # `kvdeck.profiles` can only come from the wheel.
    deps = sysconfig.get_paths()["purelib"]
    Path(site, "deps.pth").write_text(deps + "\n")
    code = (
        "from pathlib import Path\n"
        "import kvdeck.runtime as runtime, kvdeck.profiles\n"
        "from kvdeck.runtime.resources import profiles_dir, themes_dir, profile_names\n"
        "print(Path(runtime.__file__).parent)\n"
        "print(profile_names('hardware'), profile_names('models'), profile_names('workloads'))\n"
        "print(themes_dir().joinpath('themes.toml').is_file(),"
        " themes_dir().joinpath('kvdeck.tcss').is_file())\n"
    )
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    where, names, themes = r.stdout.strip().splitlines()
    assert where.startswith(site)
    assert "rtx-pro-6000" in names and "qwen3-8b" in names and "long-context" in names
    assert themes == "True True"
    # Every subpackage made it into the wheel: the CLI runs end to end from it.
    r = subprocess.run([py, "-m", "kvdeck.console.cli", "models", "--json", str(tiny_llama)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert '"num_kv_heads": 2' in r.stdout
    # The sample traces ship too: run-trace names one and reads it from the wheel.
    r = subprocess.run([py, "-m", "kvdeck.console.cli", "run-trace", "azure-conv", "--limit", "5",
                        "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"num_requests": 5' in r.stdout
