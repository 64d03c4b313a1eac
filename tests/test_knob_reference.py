"""docs/knobs.md is generated (scripts/knob_reference.py): it must match the code and yaml of this
commit, every knob the code reads must be described in its yaml, and the parser must read the
yaml the way conf/ writes it."""

import dataclasses
import os
import typing

from helpers import load_script

import models

ref = load_script("knob_reference")


def test_checked_in_page_is_current():
    with open(ref.PAGE, encoding="utf-8") as f:
        assert f.read() == ref.render(), "docs/knobs.md is stale: run python scripts/knob_reference.py"
    assert ref.main(["--check"]) == 0


def test_every_knob_has_a_description():
    assert ref.undocumented() == [], "describe these knobs in their yaml (a comment next to the key)"


def test_every_field_the_code_reads_is_on_the_page():
    """Each section's dataclass fields appear as knobs (a field no yaml shows is a knob no user finds)."""
    page = ref.render()
    for section in ref.SECTIONS:
        for cls in ref._classes(section):
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if dataclasses.is_dataclass(hints[f.name]) or f.name in ("sinks",):
                    continue  # a nested section (logging's aux flags are its own knobs)
                if section == "model_common" and f.name not in models.SHARED_KNOBS:
                    continue  # the family's own knobs are its yaml's (conf/model/)
                key = ref.SECTION_KEY.get(section, section)
                assert f"`{key}.{f.name}`" in page, f"{cls.__name__}.{f.name} is not in conf/{section}.yaml"


def test_parser_reads_comments_continuations_nesting_and_quotes(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(
        "# The header,\n# two lines.\n"
        "defaults:\n  - lr_config: cosine\n\n"
        "# above the key\n"
        "a: 1          # inline\n"
        "               # continued\n"
        "b: \"x # not a comment\"\n"
        "# --- a heading ---\n"
        "c:\n  d: {k: null}   # nested\n"
        "e: 2\n")
    header, knobs = ref.parse_yaml(str(path))
    assert header == "The header, two lines."
    got = {k.path: (k.value, k.doc) for k in knobs}
    assert got == {"a": ("1", "above the key inline continued"), "b": ('"x # not a comment"', ""),
                   "c.d": ("{k: null}", "nested"), "e": ("2", "")}


def test_script_runs_from_another_directory(tmp_path, monkeypatch):
    """As a user types it from anywhere: the page's path does not depend on the working directory."""
    monkeypatch.chdir(tmp_path)
    assert ref.main(["--check"]) == 0
    assert os.path.isabs(ref.PAGE)


def test_a_union_knob_is_documented_with_its_members():
    """A union annotation prints every member (not the first, nor Any): checkpoint.export_max_shard_size
    takes a size string or a number of bytes (tests/test_sections.py checks both are accepted)."""
    assert ref._type_name(str | int | None) == "str | int | null"
    row = next(line for line in ref.render().splitlines() if line.startswith("| `checkpoint.export_max_shard_size`"))
    assert row.split(" | ")[1] == "str \\| int \\| null"
