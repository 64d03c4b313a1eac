"""utils/sections.py's type checks at the config boundary: a union knob (`str | int | None`) takes a
value of each member's kind, as the member alone would, and refuses the rest in one line."""

import dataclasses

import pytest
from helpers import compose_config

from utils.config import validate
from utils.errors import ConfigError
from utils.sections import build_section


@dataclasses.dataclass(frozen=True)
class Unions:
    str_or_int: str | int | None = None
    int_or_str: int | str = 0
    int_or_float: int | float = 0
    bool_or_str: bool | str = "auto"
    list_or_str: tuple[int, ...] | str = ()


@pytest.mark.parametrize("knob,value,want", [
    ("str_or_int", "5GB", "5GB"), ("str_or_int", 50000, 50000), ("str_or_int", None, None),
    ("int_or_str", "x", "x"), ("int_or_str", 3, 3),  # a later member: the first alone refused "x"
    ("int_or_float", 2.5, 2.5), ("int_or_float", 2, 2),  # a float stays a float, an int an int
    ("bool_or_str", True, True), ("bool_or_str", "auto", "auto"),
    ("list_or_str", [1, 2], (1, 2)), ("list_or_str", "all", "all"),
])
def test_a_union_takes_each_members_kind(knob, value, want):
    got = getattr(build_section(Unions, {knob: value}, "s"), knob)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("knob,value,says", [
    ("str_or_int", [1], "s.str_or_int=[1] must be null or a str or int"),
    ("int_or_str", None, "s.int_or_str=None must be a int or str"),
    ("bool_or_str", 1.5, "s.bool_or_str=1.5 must be a bool or str"),
    ("list_or_str", [1, "x"], "s.list_or_str[1]='x' must be a int"),  # the list member's own error: it is a list
])
def test_a_union_refuses_what_no_member_takes(knob, value, says):
    with pytest.raises(ConfigError) as e:
        build_section(Unions, {knob: value}, "s")
    assert str(e.value) == says


@pytest.mark.parametrize("override,want", [("5GB", "5GB"), ("50000", 50000), ("null", None)])
def test_export_max_shard_size_takes_a_size_or_bytes(override, want):
    """checkpoint.export_max_shard_size: str | int | None, through Hydra's parsing of the command line."""
    run = validate(compose_config("checkpoint.export=hf", "checkpoint.export_path=o",
                                  f"checkpoint.export_max_shard_size={override}"))
    got = run.checkpoint.export_max_shard_size
    assert got == want and type(got) is type(want)
