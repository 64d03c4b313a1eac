"""Write docs/knobs.md, the reference of every knob, from the code and the yaml files.

    python scripts/knob_reference.py            # rewrite docs/knobs.md
    python scripts/knob_reference.py --check    # exit 1 when docs/knobs.md is stale

Each knob's default and its one-line description come from the yaml beside it (conf/: the
value and the comment next to the key, or the comment lines right above it); its type comes
from the config dataclass that reads it (utils.config's boundary: the section's class, or the
registered class of the option). Nothing is kept by hand, so the page cannot drift from the
code: tests/test_knob_reference.py fails when the checked-in page differs from what this
writes, and when a knob that the code reads has no description in its yaml.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import textwrap
import typing
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as `python scripts/knob_reference.py` from anywhere
    sys.path.insert(0, ROOT)

CONF = os.path.join(ROOT, "conf")
PAGE = os.path.join(ROOT, "docs", "knobs.md")

# Config groups (a folder of conf/: one option per yaml) and sections (one yaml), in the order
# the page lists them.
GROUPS = ("model", "dataset", "tokenizer", "optimizer", "optimizer/lr_config", "objective")
SECTIONS = ("train", "logging", "parallel", "checkpoint", "eval", "model_common")
# A section file whose knobs sit under another key: model_common.yaml adds the knobs every model
# family shares (model.init_from, model.lora.*, model.moe.*) to whichever model yaml is chosen.
SECTION_KEY = {"model_common": "model"}


@dataclass(frozen=True)
class Knob:
    path: str  # dotted, relative to its yaml's package (e.g. "max_steps", "groups.hidden")
    value: str  # as the yaml writes it
    doc: str  # the yaml's comment, "" when there is none


def split_comment(line: str) -> tuple[str, str | None]:
    """(code, comment or None): the first `#` outside quotes that starts a word (a yaml comment;
    the same rule holds for a shell line, which tests/test_docs_commands.py splits with it)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), None


_KEY = re.compile(r"^(\s*)([A-Za-z_][\w-]*):(?:\s+(.*))?$")


def parse_yaml(path: str) -> tuple[str, list[Knob]]:
    """(the file's leading comment, its knobs in file order). Understands the block-style yaml
    conf/ uses: `key: value  # doc`, a comment continued on the comment lines right below it that
    are indented deeper than the key,
    comment lines right above a key (a `# --- label ---` line is a heading, not a doc), nested
    mappings by indentation, flow values (`{...}`, `[...]`) as one knob. `defaults:` is Hydra's."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    header: list[str] = []
    i = 0
    while i < len(lines) and lines[i].lstrip().startswith("#"):
        header.append(lines[i].lstrip()[1:].rstrip())
        i += 1
    knobs: list[Knob] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the open mappings
    above: list[str] = []  # comment lines right above the next key
    last: Knob | None = None
    last_indent = -1  # the last knob's indent while its comment may continue on the next line
    skip_indent = None  # inside `defaults:` (Hydra's list, not knobs)
    for line in lines[i:]:
        stripped = line.strip()
        if not stripped:
            above, last_indent = [], -1
            continue
        if stripped.startswith("#"):
            col = line.index("#")
            text = stripped[1:].strip()
            if last is not None and col > last_indent >= 0:  # continues the comment of the line above
                last = dataclasses.replace(last, doc=f"{last.doc} {text}".strip())
                knobs[-1] = last
            elif not text.startswith("---"):
                above.append(text)
            continue
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if indent > skip_indent or stripped.startswith("-"):
                continue
            skip_indent = None
        code, comment = split_comment(line)
        match = _KEY.match(code)
        if match is None:
            continue  # a list item of a block list: part of the knob above
        key, value = match.group(2), (match.group(3) or "").strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if key == "defaults" and not stack:
            skip_indent = indent
            above = []
            continue
        path = ".".join([k for _, k in stack] + [key])
        doc = " ".join(above + ([comment] if comment else []))
        above = []
        if value:
            last = Knob(path, value, doc)
            knobs.append(last)
            last_indent = indent if comment else -1
        else:  # a mapping opens: its children are the knobs
            stack.append((indent, key))
            last, last_indent = None, -1
            if doc:
                knobs.append(Knob(path, "", doc))
    return _prose(header), knobs


def _prose(lines: list[str]) -> str:
    """A leading comment as Markdown: its lines joined into one paragraph, except lines indented
    deeper than the first (command examples), which become a code block."""
    out, code = [], []
    for line in lines:
        if line.startswith("   "):
            code.append(line[1:])
            continue
        if code:
            out.append("\n```\n" + textwrap.dedent("\n".join(code)) + "\n```\n")
            code = []
        out.append(line.strip())
    if code:
        out.append("\n```\n" + textwrap.dedent("\n".join(code)) + "\n```")
    return " ".join(out).replace(" \n", "\n").replace("\n ", "\n").strip()


# ----------------------------------------------------------------------------- the code's side


def _classes(where: str) -> list[type]:
    """The config dataclasses that read the knobs of `where` (a section or "group/option")."""
    from loaders.config import DatasetConfig
    from loaders.sources import SOURCES
    from loaders.tokenizers import TOKENIZERS
    from models import MODELS
    from optimizer import OPTIMIZERS
    from optimizer.schedules import SCHEDULES
    from trainer.aux_state import AuxConfig
    from trainer.tasks import EvalConfig
    from utils.checkpoint.storage import CheckpointConfig
    from utils.config import TrainConfig
    from utils.logging.sinks import SINKS, LoggingConfig
    from utils.parallel.mesh import ParallelConfig

    group, _, option = where.rpartition("/")
    fixed = {"train": [TrainConfig], "logging": [LoggingConfig, AuxConfig, *SINKS.values()],
             "parallel": [ParallelConfig], "checkpoint": [CheckpointConfig], "eval": [EvalConfig],
             "model_common": [m.Config for m in MODELS.values()]}
    if not group:
        from utils.config import RunConfig

        return fixed.get(where, [RunConfig])
    if group == "model":
        return [m.Config for m in MODELS.values()]
    if group == "dataset":
        return [SOURCES[option], DatasetConfig] if option in SOURCES else [DatasetConfig]
    if group == "tokenizer":
        return [TOKENIZERS[option]] if option in TOKENIZERS else []
    if group == "optimizer":
        from utils.config import OptimizerConfig  # the knobs every optimizer takes beside `name` (cautious)

        return [OPTIMIZERS[option], OptimizerConfig] if option in OPTIMIZERS else []
    if group == "optimizer/lr_config":
        return [SCHEDULES[option]] if option in SCHEDULES else []
    if group == "objective":
        from models.objectives import OBJECTIVES

        return [OBJECTIVES[option]] if option in OBJECTIVES else []
    return []


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | null" if type(None) in args else "")
    if origin is tuple:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict or tp is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def knob_type(classes: list[type], key: str) -> str:
    """`key`'s annotation in the first class that has it; a dotted key under a nested config
    dataclass (`loss_scale.init`) is looked up in that dataclass."""
    head, _, rest = key.partition(".")
    for cls in classes:
        hints = typing.get_type_hints(cls)
        if rest and head in hints and dataclasses.is_dataclass(hints[head]):
            return knob_type([hints[head]], rest)
        if key in hints:
            return _type_name(hints[key])
    return ""


# ----------------------------------------------------------------------------- the page


def _options(group: str) -> list[str]:
    folder = os.path.join(CONF, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(knobs: list[Knob], classes: list[type], prefix: str) -> list[str]:
    rows = ["| knob | type | default | what it does |", "| --- | --- | --- | --- |"]
    for k in knobs:
        if k.path == "name":
            continue  # the option's own name: the heading says it
        value = f"`{_cell(k.value)}`" if k.value else ""
        tp = knob_type(classes, k.path) or knob_type(classes, k.path.split(".")[0])
        tp += " | null" if k.value == "null" and tp and not tp.endswith("null") else ""
        rows.append(f"| `{prefix}{k.path}` | {_cell(tp)} | {value} | "
                    f"{_cell(k.doc)} |")
    return rows


def _section_knobs(name: str) -> list[Knob]:
    """A section's yaml nests its knobs under its own name (`train:` → `max_steps: ...`)."""
    _, knobs = parse_yaml(os.path.join(CONF, f"{name}.yaml"))
    out = []
    for k in knobs:
        head, _, rest = k.path.partition(".")
        key = SECTION_KEY.get(name, name)
        out.append(dataclasses.replace(k, path=rest) if head == key and rest else k)
    return [k for k in out if k.path != SECTION_KEY.get(name, name)]


def group_knobs(group: str) -> dict[str, tuple[str, list[Knob]]]:
    """{option: (its header, its knobs)}, a knob without a comment taking the description the
    same knob has in another option of the group (gpt2_124m's `dim` is gpt_tiny's `dim`)."""
    parsed = {o: parse_yaml(os.path.join(CONF, group, f"{o}.yaml")) for o in _options(group)}
    docs: dict[str, str] = {}
    for _, knobs in parsed.values():
        for k in knobs:
            docs.setdefault(k.path, k.doc) if k.doc else None
    return {o: (header, [k if k.doc else dataclasses.replace(k, doc=docs.get(k.path, "")) for k in knobs])
            for o, (header, knobs) in parsed.items()}


def _group_page(group: str) -> list[str]:
    """One table per option, or, when every option has the same knobs (the model shapes), one
    table with a column of defaults per option."""
    package, options = group.replace("/", "."), group_knobs(group)
    shapes = {tuple(k.path for k in knobs) for _, knobs in options.values()}
    if len(shapes) == 1 and len(options) > 1:
        names = list(options)
        rows = ["| knob | type | " + " | ".join(f"`{o}`" for o in names) + " | what it does |",
                "| --- | --- | " + " | ".join("---" for _ in names) + " | --- |"]
        first = options[names[0]][1]
        for i, k in enumerate(first):
            values = " | ".join(f"`{_cell(options[o][1][i].value)}`" for o in names)
            rows.append(f"| `{package}.{k.path}` | {_cell(knob_type(_classes(f'{group}/{names[0]}'), k.path))} | "
                        f"{values} | {_cell(k.doc)} |")
        headers = [f"- `{group}={o}`: {header}" for o, (header, _) in options.items() if header]
        return headers + ([""] if headers else []) + rows
    out: list[str] = []
    for option, (header, knobs) in options.items():
        out += [f"### `{group}={option}`", ""] + ([header, ""] if header else [])
        out += _table(knobs, _classes(f"{group}/{option}"), f"{package}.") + [""]
    return out[:-1]


def render() -> str:
    out = ["# Knob reference", "",
           "<!-- Written by `python scripts/knob_reference.py` from conf/*.yaml and the config dataclasses;",
           "     do not edit by hand: tests/test_knob_reference.py fails when it is stale. -->", "",
           "Every knob a run reads, by config section. Set one with `section.knob=value` on the command",
           "line; pick a group's option with `group=option` (e.g. `optimizer=muon`). Defaults are the",
           "yaml's; `null` means the default the description gives.", ""]
    header, root = parse_yaml(os.path.join(CONF, "config.yaml"))
    out += ["## Top level (`conf/config.yaml`)", "", header, ""]
    out += _table([k for k in root if not k.path.startswith("hydra")], _classes("config"), "")
    for section in SECTIONS:
        out += ["", f"## `{section}` (`conf/{section}.yaml`)", ""]
        header, _ = parse_yaml(os.path.join(CONF, f"{section}.yaml"))
        if header:
            out += [header, ""]
        out += _table(_section_knobs(section), _classes(section), f"{SECTION_KEY.get(section, section)}.")
    for group in GROUPS:
        out += ["", f"## `{group}=...` (`conf/{group}/`)", ""] + _group_page(group)
    return "\n".join(out) + "\n"


def undocumented() -> list[str]:
    """Knobs the code reads whose yaml gives no description (the test keeps this empty)."""
    missing = [k.path for k in parse_yaml(os.path.join(CONF, "config.yaml"))[1]
               if not k.doc and not k.path.startswith("hydra")]
    for section in SECTIONS:
        missing += [f"{SECTION_KEY.get(section, section)}.{k.path}" for k in _section_knobs(section) if not k.doc]
    for group in GROUPS:
        for option, (_, knobs) in group_knobs(group).items():
            missing += [f"conf/{group}/{option}.yaml: {k.path}" for k in knobs if not k.doc and k.path != "name"
                        and "." not in k.path]
    return missing


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    page = render()
    if "--check" in argv:
        with open(PAGE, encoding="utf-8") as f:
            if f.read() != page:
                print(f"{os.path.relpath(PAGE)} is stale: run python scripts/knob_reference.py", file=sys.stderr)
                return 1
        return 0
    os.makedirs(os.path.dirname(PAGE), exist_ok=True)
    from utils.files import atomic_write

    with atomic_write(PAGE) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
    print(f"wrote {os.path.relpath(PAGE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
