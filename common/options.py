"""Options as nanoGPT states them, for train.py and sample.py: typed module-level constants with their
defaults, which a user edits, sets in --config=FILE.yaml files or overrides as --name=value flags (bare --flag
means True; flags win over files). They are read from the script's source (declared), so that another script
can take them without importing it. Each value is checked against its constant's type; bad input is a
ConfigError, one line. --help prints the script's docstring and its block of constants, with their
comments."""

import ast
import contextlib
import difflib
import io
import math
import os
import sys
import types
import typing

import yaml

from common.errors import ConfigError
from common.files import UnsafeFile, read_regular


def option_nodes(path):
    """A script's options as written: its annotated module-level constants, in order (upper-case names are
    the script's own tables, not options)."""
    with open(path) as file:
        tree = ast.parse(file.read(), path)
    return [node for node in tree.body if isinstance(node, ast.AnnAssign) and not node.target.id.isupper()]


def declared(path):
    """A script's options, name -> (default, type), read from its source rather than imported, so that one
    script can take another's options without running it: a default is written as a value, a type as bool,
    int, float, str, None, Literal[...] and their unions (|)."""
    options = {}
    for node in option_nodes(path):
        try:
            options[node.target.id] = (ast.literal_eval(node.value), annotation(node.annotation))
        except (ValueError, TypeError):
            raise ConfigError(
                f"{path}, line {node.lineno}: write {node.target.id}'s type with bool, int, float, str, "
                f"None, Literal[...] and |, and its default as a value (a number, a string, True, False or "
                f"None)"
            ) from None
    return options


TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def annotation(node):
    """The type an option's annotation names; ValueError for any other expression."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return annotation(node.left) | annotation(node.right)
    if isinstance(node, ast.Constant) and node.value is None:
        return None
    if isinstance(node, ast.Name) and node.id in TYPES:
        return TYPES[node.id]
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
        return typing.Literal[ast.literal_eval(node.slice)]
    raise ValueError("not an option's type")


def print_help(script):
    """The script's docstring, then its constants as written, from the first to the last, with the comments
    just above, among and just below them (a comment may go on below its constant's line)."""
    lines = open(script.__file__).read().splitlines()
    declared_here = option_nodes(script.__file__)
    first, last = declared_here[0].lineno - 1, declared_here[-1].end_lineno

    def comment(line):
        return line.lstrip().startswith("#") and "fmt: " not in line

    while first > 0 and comment(lines[first - 1]):
        first -= 1
    while last < len(lines) and comment(lines[last]):
        last += 1
    block = "\n".join(line for line in lines[first:last] if "fmt: " not in line)
    try:
        print(f"{script.__doc__}\nOptions (--name=value):\n{block}", flush=True)
    except BrokenPipeError:  # `--help | head` has what it wanted; the flush at exit must not fail either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def parse_args(argv, constants):
    """constants: name -> (default, type), the options as the script declares them (declared). Each value
    type-checked against its constant's type."""
    hints = {name: hint for name, (_, hint) in constants.items()}
    args = {name: default for name, (default, _) in constants.items()}
    for path in [arg.removeprefix("--config=") for arg in argv if arg.startswith("--config=")]:
        args.update(read_config_file(path, hints))
    flags = [arg for arg in argv if not arg.startswith("--config=")]
    for index, arg in enumerate(flags):
        name, has_value, text = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not name:
            raise ConfigError(f"unexpected argument {arg!r}: options are written --name=value")
        following = flags[index + 1] if index + 1 < len(flags) else "--"
        if not has_value and not following.startswith("--") and following.lower() not in BOOLEANS:
            raise ConfigError(
                f"{arg} {following}: write --{name}={following} (options are written --name=value)"
            )
        if name not in args:
            raise ConfigError(f"unknown option --{name}{suggestion(name, args, '--')}")
        if not has_value and bool not in getattr(hints[name], "__args__", (hints[name],)):
            raise ConfigError(f"--{name} needs a value: write --{name}=VALUE")  # else a name "true" (--wandb)
        args[name] = convert(name, text if has_value else "true", hints[name], "--")
    return types.SimpleNamespace(**args)


def suggestion(name, valid, prefix):
    close = difflib.get_close_matches(name, valid, n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else f"; valid options: {', '.join(valid)}"


class ConfigLoader(yaml.SafeLoader):
    """YAML of name: value lines, read strictly: a key given twice is an error, not the last one silently, and
    an alias (*name) is refused, so that no file can expand into gigabytes (a 'billion laughs')."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise yaml.MarkedYAMLError(problem=f"an alias (*{event.anchor}); write the value out",
                                       problem_mark=event.start_mark)  # fmt: skip
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)) and key is not None:  # a list or mapping as a key
                problem = f"a {type(key).__name__} as a name; write name: value lines"
                raise yaml.MarkedYAMLError(problem=problem, problem_mark=key_node.start_mark)
            if key in seen:
                raise yaml.MarkedYAMLError(problem=f"{key!r} is given twice (first on line {seen[key] + 1})",
                                           problem_mark=key_node.start_mark)  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_config_file(path, hints):
    try:
        stream = io.BytesIO(read_regular(path))
        stream.name = path  # what an error names
        values = yaml.load(stream, Loader=ConfigLoader) or {}
    except UnsafeFile as error:
        raise ConfigError(f"--config: {error}; give a YAML file of name: value lines") from None
    except (OSError, yaml.YAMLError, ValueError, RecursionError) as error:
        raise ConfigError(f"--config={path}: {quoted(' '.join(str(error).split()), 300)}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of name: value, got {type(values).__name__}")
    for name in values:
        if name not in hints:
            raise ConfigError(f"{path}: unknown key {name!r}{suggestion(str(name), hints, '')}")
    return {name: convert(name, value, hints[name], f"{path}: ") for name, value in values.items()}


BOOLEANS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def convert(name, value, hint, where):
    """value: a flag's text, or a YAML value, typed already or text read the way a flag is. A union takes the
    first of its types that reads the value (int | Literal["auto"]: 500 is a number, auto the word)."""
    kinds = [t for t in getattr(hint, "__args__", (hint,)) if t is not type(None)]
    allows_none = type(None) in getattr(hint, "__args__", ())
    if allows_none and (value is None or isinstance(value, str) and value.lower() == "none"):
        return None
    for kind in kinds:
        if typing.get_origin(kind) is typing.Literal:
            if value in typing.get_args(kind):
                return value
            continue
        converted = value
        if isinstance(value, str) and kind is bool:
            converted = BOOLEANS.get(value.lower(), value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                converted = kind(value)
        if type(converted) is kind or kind is float and type(converted) is int:
            if kind is not float or math.isfinite(converted):
                return kind(converted)
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
    words = [names.get(kind) or " or ".join(map(repr, typing.get_args(kind))) for kind in kinds]
    expected = " or ".join(words)
    raise ConfigError(
        f"{where}{name} expects {expected}{' or none' if allows_none else ''}, got {quoted(repr(value))}"
    )


def quoted(text, limit=80):
    """What an error line quotes of a value: its start, and its length when it is longer."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
