"""The public surface: what each public module exports, and the deprecated spellings."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddpckpt

PUBLIC = (
    "ddpckpt",
    "ddpckpt.convert",
    "ddpckpt.data",
    "ddpckpt.errors",
    "ddpckpt.events",
    "ddpckpt.policies",
    "ddpckpt.storage",
)
# Public too, but importing them imports a framework (seconds each): read, not imported.
INTEGRATIONS = ("accelerate", "lightning", "ray", "transformers")


@pytest.mark.parametrize("module", PUBLIC)
def test_every_exported_name_exists_and_has_a_docstring(module: str) -> None:
    mod = importlib.import_module(module)
    for name in mod.__all__:
        value = getattr(mod, name)
        if callable(value) or isinstance(value, type):
            assert (value.__doc__ or "").strip(), f"{module}.{name} has no docstring"


@pytest.mark.parametrize("name", INTEGRATIONS)
def test_every_name_an_integration_exports_is_defined_with_a_docstring(name: str) -> None:
    path = Path(ddpckpt.__file__).parent / "integrations" / f"{name}.py"
    tree = ast.parse(path.read_text())

    def definitions(module: ast.Module) -> dict[str, str | None]:
        return {
            node.name: ast.get_docstring(node)
            for node in module.body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef))
        }

    defined = definitions(tree)
    for node in tree.body:  # or defined in a private module beside it, imported from there
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "ddpckpt.integrations._"
        ):
            private = path.with_name(f"{node.module.rpartition('.')[2]}.py")
            found = definitions(ast.parse(private.read_text()))
            defined |= {a.name: found.get(a.name) for a in node.names if a.name in found}
    (exported,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]
    ]
    for item in exported:
        assert (defined.get(item) or "").strip(), (
            f"ddpckpt.integrations.{name}.{item}: no docstring"
        )


def test_internal_modules_are_private_and_export_nothing() -> None:
    root = Path(ddpckpt.__file__).parent
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(("ddpckpt", *parts)).removesuffix(".__init__")
        also_public = {"ddpckpt.storage.s3", "ddpckpt.storage.fsspec", "ddpckpt.integrations"}
        also_public |= {f"ddpckpt.integrations.{name}" for name in INTEGRATIONS}
        if name in PUBLIC or name in also_public:
            continue
        assert any(p.startswith("_") for p in parts) or parts[0] == "examples", name
        assert "__all__" not in path.read_text(), f"{name} is internal but has __all__"


def test_the_public_surface_is_the_one_which_call_md_counts() -> None:
    page = Path(__file__).parents[1] / "docs" / "reference" / "which-call.md"
    section = page.read_text().split("## The public surface", 1)[1].split("\n## ", 1)[0]
    stated = {
        cells[0].strip("` "): int(cells[1])
        for line in section.splitlines()
        if line.startswith("| ")
        and (cells := [c.strip() for c in line.strip("|").split("|")])[1].isdigit()
    }
    counted = {module: len(importlib.import_module(module).__all__) for module in PUBLIC}
    assert stated == {**counted, "all": sum(counted.values())}


def test_the_package_ships_its_type_information() -> None:
    assert (Path(ddpckpt.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize(
    "old", ["ResumableDistributedSampler", "SampleIndex", "SeededDataset", "track_loader"]
)
def test_data_helpers_at_the_top_level_still_work_with_a_warning(old: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"ddpckpt\.data\.{old} .*after 2027-06-01"):
        value = getattr(ddpckpt, old)
    assert value is getattr(ddpckpt.data, old)


def test_resumable_loader_still_works_with_a_warning_naming_the_replacement() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    sampler = ddpckpt.data.ResumableDistributedSampler(data, 1, 0)
    with pytest.warns(DeprecationWarning, match=r"SeededDataset\(dataset, seed\)"):
        make = ddpckpt.resumable_loader
    assert len(list(make(data, sampler=sampler, batch_size=2, num_workers=0))) == 4


@pytest.mark.processes
def test_a_script_using_an_old_name_sees_the_warning_on_stderr() -> None:
    """Python shows DeprecationWarning for code in ``__main__``: a user's script."""
    done = subprocess.run(
        [sys.executable, "-c", "import ddpckpt; ddpckpt.SeededDataset"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "use ddpckpt.data.SeededDataset" in done.stderr


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        ddpckpt.no_such_thing  # noqa: B018


def test_storage_is_the_deprecated_spelling_of_sharing(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.warns(DeprecationWarning, match=r"ddpckpt\.save\(sharing=\.\.\.\)"):
        ddpckpt.save(tmp_path / "a", model=model, storage="shared")
    with pytest.raises(TypeError, match="pass sharing= only"):
        ddpckpt.save(tmp_path / "b", model=model, storage="shared", sharing="shared")
    with pytest.raises(ValueError, match="sharing must be one of"):
        ddpckpt.save(tmp_path / "c", model=model, sharing="everywhere")
    with pytest.warns(DeprecationWarning, match=r"Checkpointer\(sharing=\.\.\.\)"):
        ddpckpt.Checkpointer(tmp_path / "run", model=model, storage="local").close()
