"""Old optimizer knob names, still accepted: the one table of the renames that gave every optimizer
the shared vocabulary (issue 36; docs/optimizers.md, "Knob names").

Comparisons sweep knobs by name, so one concept has one name across optimizers (`b1`/`b2`/`b3`/`eps`
for an Adam-style method's own moments, `momentum` for a non-Adam method's one coefficient, `adam_*`
for an auxiliary AdamW, `precondition_*` for a preconditioner). Configs and command lines written
before the rename keep working: an old name becomes the new one with one warning line each,
wherever a config enters (the command line before Hydra parses it, utils.config.renamed_overrides;
a config dict, e.g. a checkpoint's, at `rename_config`); giving both names is refused.

`RENAMES[optimizer][old] = new` renames `optimizer.<old>` and `optimizer.groups.<group>.<old>`;
a key `groups.<group>.<old>` renames only that group's knob (MARS's scalar AdamW took `eps`).
`FILLS[optimizer][new] = old`: a knob split off a shared one: a config that predates it (lacks
`new`) gets `old`'s value, so it trains as before (MARS's `eps` also set its scalar group's AdamW).

This module imports nothing heavy: it is data and dict rewriting (the registry is read lazily).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from utils.errors import ConfigError

RENAMES: dict[str, dict[str, str]] = {
    "adafactor": {"momentum": "b1"},
    "kron": {"b1": "momentum", "preconditioner_lr": "precondition_lr",
             "preconditioner_init_scale": "precondition_init_scale"},
    "mars": {"groups.scalar.eps": "adam_eps"},
    "normuon": {"beta2": "b2"},
    "prodigy": {"beta3": "b3"},
    "shampoo": {"beta2": "precondition_b2", "epsilon": "precondition_eps",
                "max_preconditioner_dim": "max_precondition_dim", "graft_b2": "adam_b2", "graft_eps": "adam_eps"},
    "soap": {"precondition_frequency": "precondition_every", "shampoo_beta": "precondition_b2"},
}
FILLS: dict[str, dict[str, str]] = {"mars": {"adam_eps": "eps"}}


def new_name(optimizer: str, knob: str, group: str | None = None) -> str | None:
    """The knob's new name for `optimizer` (in `group`'s overrides when given), or None if it was not renamed."""
    table = RENAMES.get(optimizer, {})
    if group is not None and f"groups.{group}.{knob}" in table:
        return table[f"groups.{group}.{knob}"]
    return table.get(knob)


def renamed_pairs(optimizer: str) -> list[tuple[str | None, str, str]]:
    """(group or None for the top level, old, new) of every rename of `optimizer` (the tests' source)."""
    out = []
    for old, new in RENAMES.get(optimizer, {}).items():
        if old.startswith("groups."):
            _, group, knob = old.split(".")
            out.append((group, knob, new))
        else:
            out.append((None, old, new))
    return out


def message(optimizer: str, old: str, new: str, where: str = "") -> str:
    """The one warning line of a renamed knob (`old`, `new`: the full dotted keys)."""
    return f"optimizer={optimizer}{where}: `{old}` is now `{new}` (the old name still works; rename it)"


def _own_knobs(optimizer: str) -> set[str] | None:
    """The registered optimizer's knob names (its dataclass fields and `lr`), None when unknown."""
    import dataclasses

    from optimizer import OPTIMIZERS

    cls = OPTIMIZERS.get(optimizer)
    return None if cls is None else {f.name for f in dataclasses.fields(cls)} | {"lr"}


def resolve(optimizers: Iterable[str], knob: str, key: str, group: str | None = None) -> dict[str, str]:
    """{optimizer: new name} for the `optimizers` a command line's override of `knob` (`key`, as typed)
    reaches that rename it; a ConfigError when one override cannot say what it meant in all of them
    (a sweep over optimizers that rename it differently, or one that keeps `knob` as its own knob)."""
    optimizers = list(dict.fromkeys(optimizers))
    renamed = {o: n for o in optimizers if (n := new_name(o, knob, group)) is not None}
    if not renamed:
        return {}
    stem = key[: len(key) - len(knob)]  # `optimizer.` or `optimizer.groups.<group>.`
    if len(set(renamed.values())) > 1:
        names = ", ".join(f"`{stem}{n}` for {o}" for o, n in renamed.items())
        raise ConfigError(f"{key} is an old name, now {names}: sweep those optimizers in separate commands, "
                          "each with its new name")
    keeps = [o for o in optimizers if o not in renamed and knob in (_own_knobs(o) or ())]
    if keeps:
        raise ConfigError(f"{key} is `{stem}{next(iter(renamed.values()))}` for {', '.join(renamed)} (its old "
                          f"name) but stays `{key}` for {', '.join(keeps)}: sweep them in separate commands")
    return renamed


def rename_config(config: dict, warn: Callable[[str], None], where: str = "") -> dict:
    """A whole config dict (a checkpoint's, compare.json's run config) with its optimizer section's
    old knob names renamed (one `warn` line each, null group placeholders silently), copied, never
    changed in place; `rename_optimizer` does the section."""
    node = config.get("optimizer")
    if not isinstance(node, dict):
        return config
    new = rename_optimizer(node, warn, where)
    return config if new is node else {**config, "optimizer": new}


def rename_optimizer(node: dict, warn: Callable[[str], None], where: str = "") -> dict:
    """The optimizer section `node` (with `name`, maybe `groups`) under the new names, or `node`
    itself when nothing was renamed or filled. Both an old and its new name set: a ConfigError."""
    name = node.get("name")
    if name not in RENAMES and name not in FILLS:
        return node
    out, changed = dict(node), False
    for old, new in RENAMES.get(name, {}).items():
        if old.startswith("groups.") or old not in out:
            continue
        if new in out:
            raise ConfigError(f"optimizer{where} sets both optimizer.{old} (the old name) and optimizer.{new}: "
                              f"keep only optimizer.{new}")
        out[new] = out.pop(old)
        changed = True
        warn(message(name, f"optimizer.{old}", f"optimizer.{new}", where))
    groups = out.get("groups")
    if isinstance(groups, dict):
        new_groups = {}
        for group, knobs in groups.items():
            knobs = dict(knobs or {})
            for old in [k for k in knobs if new_name(name, k, group) is not None]:
                new = new_name(name, old, group)
                prefix = f"optimizer.groups.{group}"
                if new in knobs and knobs[new] is not None and knobs[old] is not None:
                    raise ConfigError(f"optimizer{where} sets both {prefix}.{old} (the old name) and {prefix}.{new}: "
                                      f"keep only {prefix}.{new}")
                value = knobs.pop(old)
                if value is not None:
                    warn(message(name, f"{prefix}.{old}", f"{prefix}.{new}", where))
                if value is not None or new not in knobs:
                    knobs[new] = value
                changed = True
            new_groups[group] = knobs
        out["groups"] = new_groups
    for new, old in FILLS.get(name, {}).items():
        if new not in out and old in out:  # a config from before the split: it trains as it did
            out[new] = out[old]
            changed = True
    return out if changed else node
