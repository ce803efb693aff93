"""YAML with the line of every key, so that an error about a value can say where it was written. Key paths
are spelled as profile errors name keys: `a.b`, and list entries by their `stage_id` (else their index),
`stages[1].max_num_seqs`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class YamlError(ValueError):
    def __init__(self, problem: str, where: str = ""):
        super().__init__(f"{problem}{where}")
        self.problem, self.where = problem, where  # where: ", line L, column C" when known


def read_yaml(path: Path) -> tuple[Any, dict[str, int]]:
    """The file's data, and key path -> 1-based line. Raises YamlError saying what is wrong, and where."""
    try:
        loader = yaml.SafeLoader(path.read_text())
    except OSError as exc:
        raise YamlError(f"cannot be read ({exc.strerror or exc})") from exc
    try:
        node = loader.get_single_node()
        return (loader.construct_document(node) if node else {}), _key_lines(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise YamlError(f"is not valid YAML: {exc.problem or exc.context}", where) from exc
    except yaml.YAMLError as exc:
        raise YamlError(f"is not valid YAML: {exc}") from exc
    finally:
        loader.dispose()


def _key_lines(node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    if isinstance(node, yaml.MappingNode):
        children = [(f"{prefix}.{k.value}" if prefix else str(k.value), k, v) for k, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        children = [(f"{prefix}[{_stage_id(item) or i}]", item, item) for i, item in enumerate(node.value)]
    else:
        return {}
    out = {}
    for name, at, child in children:
        out[name] = at.start_mark.line + 1
        out.update(_key_lines(child, name))
    return out


def _stage_id(node: yaml.Node) -> str | None:
    if isinstance(node, yaml.MappingNode):
        return next((v.value for k, v in node.value if k.value == "stage_id" and str(v.value).isdigit()), None)
    return None
