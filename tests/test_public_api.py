"""The public Python API: what `dflash2_mlx` exports, and the README's example, run as written."""

import re
from pathlib import Path

import dflash2_mlx

README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_exported_name_resolves():
    for name in dflash2_mlx.__all__:
        assert getattr(dflash2_mlx, name) is not None, name


def test_an_unknown_name_is_an_attribute_error():
    try:
        dflash2_mlx.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_the_readme_python_example_runs_and_decodes(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no Python example"
    example = blocks[0]
    assert len(example.strip().splitlines()) <= 6
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "acceptance" in printed and len(printed) > len("acceptance 1.00") + 10
