"""docs/development.md draws the house as it is: its floors are pyproject.toml's layers, its arrows the imports between
the rooms, its tree the package's files. Each check compares the page with the code, so a module added, moved or
importing a new room fails here until the page says so."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_superpipe"
PAGE = ROOT / "docs" / "development.md"
#: Entries of the tree start before this column; wrapped descriptions continue from it.
DESCRIPTION_COLUMN = 28


def _block_after(text: str, heading: str) -> list[str]:
    """The lines of the first ```text block after ``heading``."""
    start = text.index("```text", text.index(heading)) + len("```text\n")
    return text[start : text.index("```", start)].splitlines()


def page_floors(text: str) -> list[set[str]]:
    """The floors the page draws, top to bottom, each a set of rooms."""
    return [{room.strip() for room in line.split("|")} for line in _block_after(text, "### The floors") if line.strip()]


def page_arrows(text: str) -> dict[str, set[str]]:
    """Each room the page's table lists and the rooms it says that room imports."""
    arrows = {}
    for line in text[text.index("| room | imports |") :].splitlines()[2:]:
        if not line.startswith("| `"):
            break
        room, imports = line.strip("|").split("|")
        arrows[room.strip(" `")] = set(re.findall(r"`(\w+)`", imports))
    return arrows


def page_tree(text: str) -> dict[str, set[str]]:
    """Each folder of the package the tree draws (``""`` for the package itself), with the entries listed in it:
    modules (``name.py``) and folders (``name/``)."""
    folders: dict[str, set[str]] = {}
    stack: list[str] = []
    for line in _block_after(text, "### The tree"):
        match = re.match(r"^( *)(\S+?(?:/|\.py))(?:\s|$)", line)
        if match is None or len(match.group(1)) >= DESCRIPTION_COLUMN:
            continue
        depth, name = len(match.group(1)) // 2, match.group(2)
        if depth == 0:  # lightning_superpipe/ itself, or a folder beside it (recipes/, tests/)
            stack = [""] if name == "lightning_superpipe/" else ["<outside>"]
            folders.setdefault(stack[0], set())
            continue
        if stack[0] == "<outside>":
            continue
        stack = stack[:depth]
        parent = "/".join(part for part in stack if part)
        folders.setdefault(parent, set()).add(name)
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
            folders.setdefault("/".join(part for part in stack if part), set())
    folders.pop("<outside>", None)
    return folders


def layers() -> list[set[str]]:
    """pyproject.toml's layers contract, top to bottom, each layer a set of rooms."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    return [{room.strip().removeprefix("lightning_superpipe.") for room in layer.split("|")}
            for layer in contract["layers"]]


def room_imports() -> dict[str, set[str]]:
    """Each room of the package (a folder or a module at its top) and the other rooms its modules import."""
    rooms = {path.stem for path in PACKAGE.iterdir() if path.suffix == ".py" and path.stem != "__init__"}
    rooms |= {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    arrows: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        room = parts[0]
        if room == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                names = module.split(".")
                if names[0] == "lightning_superpipe" and len(names) > 1 and names[1] in rooms and names[1] != room:
                    arrows.setdefault(room, set()).add(names[1])
    return arrows


def package_tree() -> dict[str, set[str]]:
    """Each folder of the package with its modules and folders, as the tree lists them."""
    tree: dict[str, set[str]] = {}
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if (p / "__init__.py").is_file())]:
        key = folder.relative_to(PACKAGE).as_posix() if folder != PACKAGE else ""
        tree[key] = {p.name for p in folder.iterdir() if p.suffix == ".py" and p.name != "__init__.py"}
        tree[key] |= {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return tree


def tree_differences(drawn: dict[str, set[str]], actual: dict[str, set[str]]) -> list[str]:
    """What the drawn tree lacks or has too much, folder by folder. A folder drawn without entries (a room the page
    sums up in a line) is compared by existence only."""
    found = []
    for folder, entries in drawn.items():
        if folder not in actual:
            found.append(f"{folder or 'lightning_superpipe'}/ is drawn but does not exist")
        elif entries:
            found += [f"{folder}/{name} is missing from the page" for name in sorted(actual[folder] - entries)]
            found += [f"{folder}/{name} is drawn but does not exist" for name in sorted(entries - actual[folder])]
    summed_up = {f"{folder}/".lstrip("/") for folder, entries in drawn.items() if not entries}
    for folder in actual:
        top = folder.split("/")[0] + "/"
        if folder not in drawn and top not in summed_up:
            found.append(f"{folder}/ is missing from the page")
    return found


def test_the_floors_are_the_layers_contract() -> None:
    assert page_floors(PAGE.read_text()) == layers()


def test_the_arrows_are_the_imports_between_rooms_and_all_point_down() -> None:
    drawn, actual = page_arrows(PAGE.read_text()), room_imports()
    assert drawn == actual
    floor = {room: i for i, rooms in enumerate(layers()) for room in rooms}
    upward = [f"{room} -> {other}" for room, others in actual.items() for other in others
              if floor[other] <= floor[room]]
    assert not upward


def test_the_tree_lists_every_module_and_nothing_else() -> None:
    assert tree_differences(page_tree(PAGE.read_text()), package_tree()) == []


def test_the_checks_notice_a_page_that_falls_behind() -> None:
    """A module the page lacks, one it draws that is gone, and an arrow it lacks are each found."""
    text = PAGE.read_text()
    assert "    engine.py " in text and "| `stepping` | `host_memory`, `wrappers` |" in text
    lacking = text.replace("    engine.py ", "    gone.py ", 1)
    assert tree_differences(page_tree(lacking), package_tree()) == [
        "streaming/engine.py is missing from the page", "streaming/gone.py is drawn but does not exist"
    ]
    no_arrow = text.replace("| `stepping` | `host_memory`, `wrappers` |", "| `stepping` | `host_memory` |")
    assert page_arrows(no_arrow)["stepping"] != room_imports()["stepping"]
    assert page_floors(text.replace("memory\nstepping\n", "stepping\nmemory\n", 1)) != layers()
