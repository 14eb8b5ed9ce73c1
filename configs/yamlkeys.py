"""Keys a YAML file gives twice in one mapping. yaml.safe_load keeps the last of them without a word, so a second
``train:`` section silently replaces the first; the composed node tree still holds both, with their line numbers."""

from __future__ import annotations

from dataclasses import dataclass

import yaml

# '<<: *base' merges another mapping in, and a key of the mapping itself wins over a merged one, as YAML means it to.
# A key that merges bring in twice (two '<<' of one mapping, or two mappings of one '<<: [*a, *b]') keeps one value
# without a word, and which one changed with PyYAML's version (6.0.3: the last '<<', the first of a list; 6.0.4: the
# first '<<', the last of a list): refused as a key given twice is.
_MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass(frozen=True)
class Duplicate:
    """A key given twice: its dotted path (train.max_iters, items of lists as [i]) and the lines of both."""

    key: str
    first_line: int
    second_line: int
    merged: bool = False  # both brought in by '<<' merges


def first_duplicate(root: yaml.Node | None) -> Duplicate | None:
    """The first key given twice in any mapping of a document composed with yaml.compose, in document order.

    The walk visits each node once: an alias is the very node it names, so a few hundred bytes of nested aliases
    (which safe_load would expand to billions of values) cost no more to check than they did to read.
    """
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [] if root is None else [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            duplicate = _duplicate_in(node, path)
            if duplicate is not None:
                return duplicate
            children = [(value, _join(path, key)) for key, value in node.value]
        elif isinstance(node, yaml.SequenceNode):
            children = [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        else:
            continue
        stack.extend(reversed(children))  # the stack pops the last first: reversed keeps document order
    return None


def _duplicate_in(node: yaml.MappingNode, path: str) -> Duplicate | None:
    # Keys are compared as safe_load would build them for text keys, the only kind a config can use: by resolved
    # tag and text, so 'seed' and "seed" are one key while 1 and "1" are two. Keys that are lists or mappings cannot
    # be built at all, and safe_load refuses them later.
    lines: dict[tuple[str, str], int] = {}
    merged: dict[tuple[str, str], int] = {}  # a key that merges bring in, and the line it is written on
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag == _MERGE_TAG:
            for brought in _merged_keys(value, set()):
                line, name = brought.start_mark.line + 1, (brought.tag, brought.value)
                if name in merged:
                    return Duplicate(_join(path, brought), merged[name], line, merged=True)
                merged[name] = line
            continue
        if not isinstance(key, yaml.ScalarNode):
            continue
        line = key.start_mark.line + 1
        first = lines.get((key.tag, key.value))
        if first is not None:
            return Duplicate(_join(path, key), first, line)
        lines[key.tag, key.value] = line
    return None


def _merged_keys(node: yaml.Node, seen: set[int]) -> list[yaml.ScalarNode]:
    """The text keys that a '<<' of this value brings in: a mapping's own, and those of its own '<<'; of each
    mapping of a list of them."""
    if id(node) in seen:  # a mapping that merges itself, through an alias: safe_load says what is wrong with it
        return []
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        return [k for item in node.value for k in _merged_keys(item, seen)]
    if not isinstance(node, yaml.MappingNode):
        return []
    keys = []
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag == _MERGE_TAG:
            keys += _merged_keys(value, seen)
        elif isinstance(key, yaml.ScalarNode):
            keys.append(key)
    return keys


def _join(path: str, key: yaml.Node) -> str:
    text = key.value if isinstance(key, yaml.ScalarNode) else f"<{type(key).__name__}>"
    return f"{path}.{text}" if path else text
