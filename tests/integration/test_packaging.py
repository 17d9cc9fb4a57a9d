"""The wheel is honest: built from this tree, it holds what users need (the
migrations, py.typed, the testing package and its pytest plugin, the admin's
templates and static files once they exist), declares the entry points, the
license and the project URLs, and every third-party package our modules import
is a declared dependency (issue 13)."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import flask_solidloop

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(flask_solidloop.__file__).parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                           "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = out.glob("flask_solidloop-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_what_users_need(wheel):
    names = set(wheel.namelist())
    assert "flask_solidloop/py.typed" in names
    migrations = {p.name for p in (PACKAGE / "migrations" / "versions").glob("*.py")}
    assert migrations and all(f"flask_solidloop/migrations/versions/{m}" in names
                              for m in migrations)
    assert {"flask_solidloop/migrations/env.py",
            "flask_solidloop/migrations/script.py.mako"} <= names
    # The test helpers users import, the emulators' subpackages included.
    testing = {str(p.relative_to(PACKAGE.parent)) for p in (PACKAGE / "testing").rglob("*.py")}
    assert {"flask_solidloop/testing/plugin.py", "flask_solidloop/testing/drain.py",
            "flask_solidloop/testing/llm_emulator/server.py",
            "flask_solidloop/testing/mcp_emulator/server.py"} <= testing <= names
    # Whatever templates and static files the package has (the admin's) ship too.
    for folder in ("templates", "static"):
        for path in (PACKAGE).rglob(f"{folder}/**/*"):
            if path.is_file():
                assert str(path.relative_to(PACKAGE.parent)) in names, path
    assert not any(n.startswith(("tests/", "bench/", "example_app/")) for n in names)


def test_the_wheel_metadata_is_complete(wheel):
    dist_info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(wheel.read(f"{dist_info}/METADATA").decode())
    assert meta["Version"] == flask_solidloop.__version__
    assert meta["License-Expression"] == "MIT"
    assert any(n.startswith(f"{dist_info}/licenses/LICENSE") for n in wheel.namelist())
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Changelog", "Issues"} <= set(urls)
    requires = " ".join(meta.get_all("Requires-Dist"))
    assert "pydantic>=2.12" in requires and "sqlalchemy>=2.0.16" in requires.lower()
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "[pytest11]" in entry_points and "flask_solidloop.testing.plugin" in entry_points
    assert "[flask.commands]" in entry_points
    assert "flask_solidloop.cli:solidloop_cli" in entry_points


#: Import name -> distribution, where they differ.
DISTRIBUTIONS = {"psycopg_pool": "psycopg-pool", "mcp_types": "mcp-types",
                 "pydantic_core": "pydantic-core", "flask_sqlalchemy": "flask-sqlalchemy",
                 "yaml": "pyyaml", "opentelemetry": "opentelemetry-api", "jwt": "pyjwt"}


def _imported_top_levels() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"flask_solidloop", "__future__"}


def test_every_package_our_modules_import_is_declared():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"],
                *(dep for deps in project["optional-dependencies"].values() for dep in deps)]
    names = {d.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0]
             .strip().lower() for d in declared}
    # Brought by a declared dependency we build on by contract: Flask ships Werkzeug,
    # Click and Jinja (the emulators and the CLI use them as Flask does).
    implied = {"werkzeug", "click", "jinja2", "markupsafe", "itsdangerous"}
    missing = sorted(
        top for top in _imported_top_levels()
        if DISTRIBUTIONS.get(top, top).replace("_", "-").lower() not in names | implied)
    assert missing == [], f"imported but not declared in pyproject.toml: {missing}"
