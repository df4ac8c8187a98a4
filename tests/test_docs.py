"""The documentation: the site builds with warnings as errors, and every Python snippet in
the README and on the site runs, copied literally, the way the page says to run it (how a
block is marked: tests/support/snippets.py). A block without a marker fails here, so a
snippet cannot silently escape.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from snippets import HOW, ROOT, RUNNABLE, SNIPPETS, Snippet, first_traceback, run_as_written


def test_the_pages_have_snippets_and_every_one_says_how_it_runs() -> None:
    assert len(SNIPPETS) >= 4
    unmarked = [s.id for s in SNIPPETS if not s.how]
    assert not unmarked, f"add a <!-- readme-test: ... --> marker above {unmarked}"
    for snippet in SNIPPETS:
        if not snippet.how.startswith("skip:"):
            assert HOW.match(snippet.how), f"{snippet.id}: unknown marker {snippet.how!r}"


def _params(snippets: list[Snippet]) -> list[object]:
    """Each snippet; one that starts a Ray cluster runs on the worker that runs the other
    Ray tests, one cluster at a time (tests/integrations/test_ray.py)."""
    ray = pytest.mark.xdist_group("ray")
    return [pytest.param(s, marks=[ray] if "import ray" in s.code else []) for s in snippets]


def test_a_traceback_counts_unless_rays_own_processes_printed_it() -> None:
    ours = "Traceback (most recent call last):\n  File snippet.py\nValueError: x\n"
    assert first_traceback("starting\n" + ours) == len("starting\n")
    worker = "\x1b[36m(RayTrainWorker pid=30703)\x1b[0m Traceback (most recent call last):\n"
    assert first_traceback(worker) >= 0
    rays = (
        "\x1b[36m(TrainController pid=30432)\x1b[0m Traceback (most recent call last):\n"
        "(PlacementGroupCleaner pid=30636) Traceback (most recent call last):\n"
        "(raylet) Traceback (most recent call last):\n"
        "(RayTrainWorker pid=30731, ip=192.0.2.2) saved checkpoint\n"
    )
    assert first_traceback(rays) == -1
    assert first_traceback(rays + ours) == len(rays)


@pytest.mark.processes
@pytest.mark.long
@pytest.mark.parametrize("snippet", _params(RUNNABLE), ids=lambda s: s.id)
def test_readme_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    run_as_written(snippet, tmp_path)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for the tests of this module that read it."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(ROOT / "docs"), str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return out


@pytest.mark.long
def test_the_site_builds_with_warnings_as_errors(site: Path) -> None:
    """``sphinx-build -W``: a broken reference, a page missing from the navigation, a
    docstring that does not parse or an unknown directive fails the build."""
    assert (site / "reference" / "cli.html").is_file()


def _documented(site: Path) -> set[str]:
    """The Python objects the site documents: the names in its ``objects.inv``."""
    header, _, body = site.joinpath("objects.inv").read_bytes().partition(b"zlib.\n")
    assert header.startswith(b"# Sphinx inventory version 2"), header[:40]
    lines = zlib.decompress(body).decode().splitlines()
    return {line.split(" ", 2)[0] for line in lines if line.split(" ", 2)[1].startswith("py:")}


def _public_names() -> dict[str, object]:
    """Every name a public module exports, with its value (the integration modules are
    read, not imported: each imports a framework)."""
    names: dict[str, object] = {}
    for module in ("ddpckpt", "ddpckpt.data", "ddpckpt.errors", "ddpckpt.events",
                   "ddpckpt.policies", "ddpckpt.storage", "ddpckpt.storage.s3",
                   "ddpckpt.storage.fsspec"):  # fmt: skip
        mod = importlib.import_module(module)
        names.update({f"{module}.{name}": getattr(mod, name) for name in mod.__all__})
    for name in ("lightning", "accelerate", "transformers", "ray"):
        path = ROOT / "src" / "ddpckpt" / "integrations" / f"{name}.py"
        exported = re.search(r"^__all__ = (\[.*?\])", path.read_text(), re.M | re.S)
        assert exported is not None, path
        for item in ast.literal_eval(exported[1]):
            names[f"ddpckpt.integrations.{name}.{item}"] = None
    return names


@pytest.mark.long
def test_the_api_reference_documents_every_public_name(site: Path) -> None:
    """A name in a public ``__all__`` is documented under that name, or is the same object
    as one documented elsewhere (``ddpckpt.CheckpointError`` is ``ddpckpt.errors``'s)."""
    public = _public_names()  # imports the modules whose names are looked up below
    documented = _documented(site)
    documented_objects = set()
    for name in documented:
        module, _, attr = name.rpartition(".")
        if module in sys.modules and hasattr(sys.modules[module], attr):
            documented_objects.add(id(getattr(sys.modules[module], attr)))
    missing = [
        name
        for name, value in public.items()
        if name not in documented and (value is None or id(value) not in documented_objects)
    ]
    assert not missing, f"add these to docs/reference/api/: {missing}"
