"""Options as nanoGPT states them, for every script of the project (train.py, benchmark.py, sample.py): typed
module-level constants with their defaults, which a user edits, sets in --config=FILE.yaml files or overrides
as --name=value flags (bare --flag means True; flags win over files). Each value is checked against its
constant's type; bad input is a ConfigError, one line. --help prints the script's docstring and its block of
constants, with their comments."""

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


def constants_of(script):
    """A script's options: name -> (default, type), from its annotated module-level constants (upper-case
    names are the script's own tables, not options)."""
    hints = vars(script).get("__annotations__", {})
    names = {name: hint for name, hint in hints.items() if not name.isupper()}
    return {name: (getattr(script, name), hint) for name, hint in names.items()}


def print_help(script):
    """The script's docstring, then its constants as written, from the first to the last, with the comments
    just above, among and just below them (a comment may go on below its constant's line)."""
    lines = open(script.__file__).read().splitlines()
    declared = [node for node in ast.parse("\n".join(lines)).body if isinstance(node, ast.AnnAssign)]
    declared = [node for node in declared if not node.target.id.isupper()]
    first, last = declared[0].lineno - 1, declared[-1].end_lineno

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
    """constants: name -> (default, type), the options as train.py declares them. Each value type-checked
    against its constant's type."""
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
