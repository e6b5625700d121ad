"""Entry-point plugin registry.

Every configurable component kind (envs, advantage estimators, filters, rollout engines, policy losses) has a small abstract base
class and an entry-point group. Built-ins are registered in ragen-pl's own ``pyproject.toml`` through the same
groups a third-party distribution uses, so there is exactly one discovery path.

Importing :mod:`ragen_pl` scans nothing: discovery happens when :func:`load_plugins` is called (the CLI calls it
before it parses a config, so configs can name components by their short entry name).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

if sys.version_info >= (3, 12):
    from importlib.metadata import EntryPoint, entry_points
else:  # the stdlib's selectable entry points only stabilised in 3.12
    from importlib_metadata import EntryPoint, entry_points

__all__ = [
    "DISABLE_ENV",
    "GROUPS",
    "PluginInfo",
    "PluginLoadError",
    "available",
    "class_path",
    "get",
    "import_class_path",
    "import_target",
    "load_plugins",
    "resolve",
]

#: Setting this environment variable to 1 skips every plugin not shipped by ragen-pl itself.
DISABLE_ENV = "RAGEN_PL_DISABLE_PLUGIN_AUTOLOAD"
_OWN_DIST = "ragen-pl"

#: group name -> "module:attr" of the base class every plugin in the group must subclass.
GROUPS: dict[str, str] = {
    "ragen_pl.envs": "ragen_pl.envs.base:Env",
    "ragen_pl.advantages": "ragen_pl.advantages:Advantage",
    "ragen_pl.filters": "ragen_pl.filters:Filter",
    "ragen_pl.rollout_engines": "ragen_pl.rollout.engine:RolloutEngine",
    "ragen_pl.policy_losses": "ragen_pl.losses:PolicyLoss",
    "ragen_pl.model_hooks": "ragen_pl.hooks:ModelHook",
    "ragen_pl.updates": "ragen_pl.update:StarPOUpdate",
    "ragen_pl.models": "ragen_pl.models:NamedModel",
}


class PluginLoadError(RuntimeError):
    """A plugin could not be loaded, or a name could not be resolved."""


@dataclass(frozen=True)
class PluginInfo:
    group: str
    name: str
    value: str
    """``module:attr`` as declared by the distribution."""
    dist: str
    version: str
    cls: type


_cache: dict[str, dict[str, PluginInfo]] | None = None


def import_target(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def class_path(cls: type) -> str:
    """``module.Class``: how configs and checkpoints name a class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def import_class_path(path: str) -> Any:
    """The class a ``module.Class`` path names (a checkpoint's saved component)."""
    module, _, attr = path.rpartition(".")
    return import_target(f"{module}:{attr}")


def _dist_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>", "?"
    return dist.metadata["Name"] or dist.name, dist.version


def _normalise(dist_name: str) -> str:
    return dist_name.lower().replace("_", "-").replace(".", "-")


def _load_one(ep: EntryPoint, base: type) -> PluginInfo:
    dist, version = _dist_of(ep)
    where = f"Plugin '{ep.name}' in group '{ep.group}' ({ep.value}, from {dist} {version})"
    way_out = f"Fix or uninstall that package, or set {DISABLE_ENV}=1 to skip third-party plugins."
    try:
        obj = ep.load()
    except (Exception, SystemExit) as err:  # a plugin calling sys.exit() at import must not end ragen-pl silently
        raise PluginLoadError(f"{where} failed to import: {type(err).__name__}: {err}.\n{way_out}") from err
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise PluginLoadError(
            f"{where} is not a subclass of {base.__module__}.{base.__qualname__}: got {obj!r}.\n{way_out}"
        )
    return PluginInfo(ep.group, ep.name, ep.value, dist, version, obj)


def load_plugins(*, reload: bool = False) -> dict[str, dict[str, PluginInfo]]:
    """Discover and import every plugin of every group.

    Returns ``{group: {name: PluginInfo}}``. The result is cached; ``reload=True`` scans again.

    Raises:
        PluginLoadError: a plugin failed to import, is not a subclass of its group's base class, or repeats a
            name already taken in its group.
    """
    global _cache
    if _cache is not None and not reload:
        return _cache
    skip_third_party = os.environ.get(DISABLE_ENV, "").strip().lower() in {"1", "true", "yes"}
    found: dict[str, dict[str, PluginInfo]] = {}
    for group, base_target in GROUPS.items():
        base = import_target(base_target)
        found[group] = {}
        # Sorted so that duplicate detection and `ragen-pl plugins` are deterministic; ragen-pl's own entries come
        # first, so a third-party duplicate is the one blamed, whatever its name sorts as.
        eps = sorted(entry_points(group=group),
                     key=lambda e: (e.name, _normalise(_dist_of(e)[0]) != _OWN_DIST, e.value, _dist_of(e)[0]))
        seen_values: set[tuple[str, str]] = set()
        for ep in eps:
            dist, version = _dist_of(ep)
            if skip_third_party and _normalise(dist) != _OWN_DIST:
                continue
            # The same distribution visible twice on sys.path (e.g. an editable install) is not a conflict.
            if (ep.name, ep.value) in seen_values:
                continue
            seen_values.add((ep.name, ep.value))
            if ep.name in found[group]:
                other = found[group][ep.name]
                raise PluginLoadError(
                    f"Plugin '{ep.name}' in group '{group}' ({ep.value}, from {dist} {version}) repeats a name "
                    f"already taken by {other.value} from {other.dist} {other.version}.\n"
                    f"Uninstall one of the two packages, or set {DISABLE_ENV}=1 to skip third-party plugins."
                )
            found[group][ep.name] = _load_one(ep, base)
    _cache = found
    return found


def _group_of(kind: str) -> str:
    group = kind if kind.startswith("ragen_pl.") else f"ragen_pl.{kind}"
    if group not in GROUPS:
        raise PluginLoadError(f"Unknown plugin group '{kind}'. Available: {', '.join(sorted(GROUPS))}")
    return group


def available(kind: str) -> list[str]:
    """Sorted entry names of one group (``"envs"`` or ``"ragen_pl.envs"``)."""
    return sorted(load_plugins()[_group_of(kind)])


def get(kind: str, name: str) -> type:
    """The class registered as ``name`` in ``kind``; the error lists every valid name."""
    group = _group_of(kind)
    plugins = load_plugins()[group]
    if name not in plugins:
        raise PluginLoadError(f"'{name}' not found in '{group}'. Available: {', '.join(sorted(plugins))}")
    return plugins[name].cls


def resolve(kind: str, spec: str | type, **kwargs: Any) -> Any:
    """Instantiate a component given by entry name, ``module:Class`` / ``module.Class`` path, or class."""
    if isinstance(spec, type):
        cls = spec
    elif ":" in spec or "." in spec:
        target = spec if ":" in spec else ":".join(spec.rsplit(".", 1))
        try:
            cls = import_target(target)
        except (ImportError, AttributeError) as err:
            raise PluginLoadError(f"Cannot import '{spec}' for '{_group_of(kind)}': {err}") from err
    else:
        cls = get(kind, spec)
    return cls(**kwargs)
