"""A config's text: a YAML file, a preset shipped in graph_opt/presets/ by name, or JSON text where a path is accepted (FastDeploy's
--graph-optimization-config '{...}'), read into a mapping of graph_opt_config keys with errors that name
the file or the variable it came from. config.py validates what they hold."""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Tuple

from .errors import GraphOptConfigError

NESTED_KEY = "graph_opt_config"
PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")


def preset_names() -> list:
    """The presets shipped in graph_opt/presets/ (configs/ links to the same files)."""
    return sorted(name[:-len(".yaml")] for name in os.listdir(PRESET_DIR) if name.endswith(".yaml"))


def _preset_or_path(path: str) -> str:
    """A preset's bare name ("decode_full_graph") stands for its file, unless a file of that name exists
    (a folder of that name, as `default/`, does not hide the preset)."""
    if os.path.isfile(path) or os.path.dirname(path) or path.endswith((".yaml", ".yml", ".json")):
        return path
    preset = os.path.join(PRESET_DIR, path + ".yaml")
    return preset if os.path.isfile(preset) else path


def read_yaml(path: str, via: str = "") -> Mapping[str, Any]:
    """The mapping in a YAML file. `via` names where the path came from (" (GRAPH_OPT_CONFIG)") in errors."""
    import yaml

    if not isinstance(path, (str, os.PathLike)):
        raise GraphOptConfigError(
            f"config file{via}: expected the path of a YAML file (a str or os.PathLike), got {type(path).__name__}"
        )
    path = _preset_or_path(os.fspath(path))
    if not os.path.exists(path):
        raise GraphOptConfigError(f"config file {path!r} does not exist{via}: expected the path of a YAML file "
                                  f"or a preset's name ({', '.join(preset_names())})")
    if not os.path.isfile(path):
        raise GraphOptConfigError(f"config file {path!r} is not a file{via}: expected the path of a YAML file")
    with open(path, encoding="utf-8") as fh:
        try:
            text = fh.read()
            data = _json_or_yaml(text)
        except UnicodeDecodeError as exc:
            raise GraphOptConfigError(f"config file {path!r}{via} is not UTF-8 text ({exc.reason} at byte "
                                      f"{exc.start}): expected a YAML mapping of graph_opt_config keys") from None
        except yaml.YAMLError as exc:
            bare = _colon_missing(exc, text)
            if bare is None:
                raise GraphOptConfigError(
                    f"config file {path!r}{via} is not valid YAML (expected a mapping of graph_opt_config keys): {exc}"
                ) from None
        else:
            bare = _bare_line(text, data)
    if bare is not None:
        line, shown = bare
        raise GraphOptConfigError(
            f"config file {path!r}{via}, line {line}: {shown!r} is not a `key: value` pair; expected graph_opt_config "
            f"keys (bare or nested under {NESTED_KEY}:), each as `key: value` with a colon and a space, as "
            "'graph_opt_level: 1'"
        )
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise GraphOptConfigError(
            f"config file {path!r}{via} must hold a mapping, got {type(data).__name__}; expected "
            f"graph_opt_config keys (bare or nested under {NESTED_KEY}:)"
        )
    return data


def _bare_line(text: str, data):
    """(line number, its text) of a plain value standing where a mapping was expected (the whole file, or
    graph_opt_config's value): a `key value` or `key:value` line, which YAML reads as a string. Else None."""
    import yaml

    nested = isinstance(data, Mapping)
    if not isinstance(data.get(NESTED_KEY) if nested else data, str):
        return None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if nested and isinstance(node, yaml.MappingNode):
        node = next((value for key, value in node.value if key.value == NESTED_KEY), None)
    if not isinstance(node, yaml.ScalarNode):
        return None
    line = node.start_mark.line
    return line + 1, text.splitlines()[line].strip()


def _colon_missing(exc, text: str):
    """(line number, its text) of a line without its colon among `key: value` lines, from YAML's error; else None."""
    mark = getattr(exc, "context_mark", None)
    if getattr(exc, "problem", None) != "could not find expected ':'" or mark is None:
        return None
    return mark.line + 1, text.splitlines()[mark.line].strip()


def is_json_text(value) -> bool:
    """A config given as JSON text where a path is accepted (FastDeploy's --graph-optimization-config '{...}')."""
    return isinstance(value, str) and value.lstrip().startswith("{")


def read_json_text(text: str, via: str = "") -> Mapping[str, Any]:
    import yaml

    try:
        data = _json_or_yaml(text)
    except yaml.YAMLError as exc:
        raise GraphOptConfigError(
            f"config JSON text{via} is not valid (expected an object of graph_opt_config keys, as "
            f"'{{\"graph_opt_level\": 1, \"use_cudagraph\": true}}'): {exc}") from None
    if not isinstance(data, Mapping):
        raise GraphOptConfigError(f"config JSON text{via} must hold an object, got {type(data).__name__}")
    return data


def _json_or_yaml(text: str):
    """The value of JSON text (as json.loads reads it: tabs are whitespace there, not in YAML), else of YAML
    text; a key given twice in one mapping is an error in both. Raises yaml.YAMLError."""
    import json

    if is_json_text(text):
        def pairs(items):
            seen = set()
            for key, _ in items:
                if key in seen:
                    raise _DuplicateKey(key)
                seen.add(key)
            return dict(items)

        try:
            return json.loads(text, object_pairs_hook=pairs)
        except _DuplicateKey as exc:
            import yaml

            raise yaml.YAMLError(f"key {exc.args[0]!r} appears twice in one mapping") from None
        except ValueError:
            pass  # not JSON: a YAML flow mapping ({graph_opt_level: 1}) or an error YAML's parser names
    import yaml

    return yaml.load(text, Loader=_loader())


class _DuplicateKey(Exception):
    pass


@functools.lru_cache(maxsize=None)
def _loader():
    """yaml's SafeLoader, except that a key given twice in one mapping is an error, not the last one winning."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: merged keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, str) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return Loader


def read_text_or_file(value: str, via: str = "") -> Tuple[Mapping[str, Any], str]:
    """(the mapping, a label naming where it came from) of a config given where a path is accepted: JSON
    text, or the path of a YAML (or JSON) file."""
    if is_json_text(value):
        return read_json_text(value, via), "json" + via
    return read_yaml(value, via), f"yaml:{value}{via}"
