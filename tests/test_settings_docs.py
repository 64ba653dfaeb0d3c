"""The README's settings tables list every field of app/config.py's models, with its default.

A table whose header's first cell is one of TABLES holds the settings under that prefix: its rows'
first cells are `name` or `nested.name`. A field whose type is a model (engine, fp4, placement,
router) is walked into, not compared; every other field needs a row whose default cell starts
with its default: a number (`4 MiB` and `1,000,000` read as numbers), `true`/`false`, a word
(`tiny-llama`), `[]`, a tuple `(6, 5, 4.5, 4)`, or `null` / `—` for None (text may follow, e.g.
`null: the model's`). Rows naming no field fail too.
"""

from __future__ import annotations

import re

from pydantic import BaseModel

from app.config import ServerConfig, parse_bytes
from tests.serve_testing import REPO_ROOT

TABLES = {"`args:` setting": "", "`engine` setting": "engine.", "`engine.fp4` setting": "engine.fp4."}


def documented(readme: str) -> dict[str, str]:
    """Setting path -> its default cell, from the README's settings tables."""
    rows, prefix = {}, None
    for line in readme.splitlines():
        if not line.startswith("|"):
            prefix = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if prefix is None:
            prefix = TABLES.get(cells[0], "")  # a header row (unknown tables: "" until the separator)
            known = cells[0] in TABLES
            continue
        if not known or set(cells[0]) <= set("-: "):
            continue
        name = cells[0].strip("`")
        assert prefix + name not in rows, f"{prefix + name} has two rows"
        rows[prefix + name] = cells[1]
    return rows


def fields(model: type[BaseModel], prefix: str = "") -> tuple[dict[str, object], set[str]]:
    """(leaf setting path -> default, paths of nested models), walking the models recursively."""
    leaves, nested = {}, set()
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, str):  # a forward reference ("RouterConfig")
            kind = type(field.get_default(call_default_factory=True))
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            nested.add(prefix + name)
            sub_leaves, sub_nested = fields(kind, f"{prefix}{name}.")
            leaves.update(sub_leaves)
            nested |= sub_nested
        else:
            leaves[prefix + name] = field.get_default(call_default_factory=True)
    return leaves, nested


_NUMBER = re.compile(r"-?[0-9][0-9,]*(\.[0-9]+)?(\s*[KMGT]i?B)?(?![\w.])")


def read_default(cell: str):
    """The value a default cell starts with (see the module docstring)."""
    text = cell.replace("`", "").strip()
    if text.startswith(("null", "—")):
        return None
    if text.startswith("[]"):
        return []
    if m := re.match(r"\(([^)]*)\)", text):
        return tuple(float(x) for x in m.group(1).split(","))
    if m := re.match(r"(true|false)\b", text):
        return m.group(1) == "true"
    if m := _NUMBER.match(text):
        number = m.group(0).replace(",", "")
        return float(parse_bytes(number.replace(" ", "")) if m.group(2) else number)
    return re.match(r"[^\s;,(]+", text).group(0) if text else ""


def agrees(default, cell: str) -> bool:
    value = read_default(cell)
    if isinstance(default, bool) or default is None or isinstance(default, (str, list)):
        return value == default and type(value) is type(default)
    if isinstance(default, tuple):
        return isinstance(value, tuple) and value == tuple(float(x) for x in default)
    return isinstance(value, float) and value == float(default)


def problems(readme: str) -> list[str]:
    rows = documented(readme)
    leaves, nested = fields(ServerConfig)
    out = [f"{path}: no row in the README's settings tables (default {default!r})"
           for path, default in leaves.items() if path not in rows]
    out += [f"{path}: the README says {rows[path]!r}, the default is {default!r}"
            for path, default in leaves.items() if path in rows and not agrees(default, rows[path])]
    out += [f"{path}: a README row for no field of ServerConfig" for path in rows
            if path not in leaves and path not in nested]
    return out


README = (REPO_ROOT / "README.md").read_text()


def test_readme_lists_every_setting_with_its_default():
    assert problems(README) == []


def test_the_check_finds_a_missing_row_a_wrong_default_and_a_stale_row():
    assert "| `router.load_factor` | 1.25 |" in README and "| `block_size` | 16 |" in README
    broken = (README.replace("| `router.load_factor` | 1.25 |", "| `router.load_factr` | 1.25 |")
              .replace("| `block_size` | 16 |", "| `block_size` | 32 |"))
    found = problems(broken)
    assert any(p.startswith("router.load_factor: no row") for p in found), found
    assert any(p.startswith("router.load_factr: a README row for no field") for p in found), found
    assert any(p.startswith("engine.block_size: the README says '32'") for p in found), found
    assert len(found) == 3, found


def test_default_cells_are_read_as_values():
    assert [read_default(c) for c in ("4 MiB", "1,000,000", "0.1", "`tiny-llama`", "true", "`[]`",
                                      "(6, 5, 4.5, 4)", "null: the model's", "—", "1GiB")] == \
        [4 * 2**20, 1e6, 0.1, "tiny-llama", True, [], (6.0, 5.0, 4.5, 4.0), None, None, 2**30]
    assert not agrees(None, "1 on GPU, 0.1 on CPU") and agrees(None, "null: 1 on GPU, 0.1 on CPU")
    assert not agrees(300.0, "30") and agrees(300.0, "300") and not agrees(1, "true")
