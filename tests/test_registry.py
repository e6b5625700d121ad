import subprocess
import sys
from pathlib import Path

import pytest

from ragen_pl import registry
from ragen_pl.advantages import GRPO, Advantage
from ragen_pl.envs.sokoban import Sokoban

ROOT = Path(__file__).resolve().parents[1]


class FakeDist:
    def __init__(self, name: str, version: str = "0.0.1") -> None:
        self.name, self.version, self.metadata = name, version, {"Name": name}


class FakeEntryPoint:
    def __init__(self, name: str, value: str, group: str, dist: str = "ragen-pl-badplug") -> None:
        self.name, self.value, self.group, self.dist = name, value, group, FakeDist(dist)

    def load(self):
        return registry.import_target(self.value)


class NotAnAdvantage:
    pass


@pytest.fixture
def fake_eps(monkeypatch):
    """Replace entry-point discovery with a list of fakes per group (built-ins stay)."""
    real = registry.entry_points
    extra: dict[str, list[FakeEntryPoint]] = {}

    def fake(group: str):
        return list(real(group=group)) + extra.get(group, [])

    monkeypatch.setattr(registry, "entry_points", fake)
    monkeypatch.setattr(registry, "_cache", None)
    yield extra
    registry._cache = None


def test_builtins_discovered_through_entry_points():
    plugins = registry.load_plugins(reload=True)
    assert set(plugins) == set(registry.GROUPS)
    assert registry.available("envs") == ["bandit", "countdown", "frozen_lake", "gymnasium", "openenv", "sokoban"]
    assert {"gae", "bilevel_gae", "grpo", "rloo", "reinforce_pp", "gigpo"} <= set(registry.available("advantages"))
    assert {"none", "variance_top_p", "drop_zero_variance", "adaptive_variance"} <= set(registry.available("filters"))
    assert plugins["ragen_pl.advantages"]["grpo"].dist == "ragen-pl"
    assert registry.get("advantages", "grpo") is GRPO
    env = registry.resolve("envs", "sokoban", dim_room=(8, 8), num_boxes=2)
    assert isinstance(env, Sokoban) and env.rows == 8


def test_good_third_party_plugin(fake_eps):
    fake_eps["ragen_pl.advantages"] = [FakeEntryPoint("grpo_copy", "ragen_pl.advantages:GRPO", "ragen_pl.advantages")]
    assert registry.get("advantages", "grpo_copy") is GRPO
    info = registry.load_plugins()["ragen_pl.advantages"]["grpo_copy"]
    assert (info.dist, info.version) == ("ragen-pl-badplug", "0.0.1")


def test_broken_import_names_everything(fake_eps):
    fake_eps["ragen_pl.advantages"] = [FakeEntryPoint("broken", "ragen_pl.advantages:Missing", "ragen_pl.advantages")]
    with pytest.raises(registry.PluginLoadError) as info:
        registry.load_plugins()
    msg = str(info.value)
    assert (
        "Plugin 'broken' in group 'ragen_pl.advantages' (ragen_pl.advantages:Missing, from ragen-pl-badplug 0.0.1) "
        "failed to import: AttributeError:" in msg
    )
    assert "RAGEN_PL_DISABLE_PLUGIN_AUTOLOAD=1" in msg
    assert isinstance(info.value.__cause__, AttributeError)


def test_missing_module(fake_eps):
    fake_eps["ragen_pl.envs"] = [FakeEntryPoint("ghost", "no_such_module_xyz:Env", "ragen_pl.envs")]
    with pytest.raises(registry.PluginLoadError, match=r"'ghost'.*failed to import: ModuleNotFoundError"):
        registry.load_plugins()


def test_not_a_subclass(fake_eps):
    fake_eps["ragen_pl.advantages"] = [
        FakeEntryPoint("odd", "tests.test_registry:NotAnAdvantage", "ragen_pl.advantages")
    ]
    with pytest.raises(registry.PluginLoadError, match=r"'odd'.*is not a subclass of ragen_pl\.advantages\.Advantage"):
        registry.load_plugins()


def test_duplicate_name(fake_eps):
    fake_eps["ragen_pl.advantages"] = [FakeEntryPoint("grpo", "ragen_pl.advantages:RLOO", "ragen_pl.advantages")]
    with pytest.raises(registry.PluginLoadError, match=r"'grpo'.*repeats a name already taken by"):
        registry.load_plugins()


def test_disable_env_skips_third_party(fake_eps, monkeypatch):
    fake_eps["ragen_pl.advantages"] = [FakeEntryPoint("broken", "ragen_pl.advantages:Missing", "ragen_pl.advantages")]
    monkeypatch.setenv(registry.DISABLE_ENV, "1")
    plugins = registry.load_plugins()
    assert "broken" not in plugins["ragen_pl.advantages"] and "grpo" in plugins["ragen_pl.advantages"]


def test_unknown_name_lists_choices():
    with pytest.raises(registry.PluginLoadError, match=r"'grpoo' not found in 'ragen_pl.advantages'. Available: .*grpo"):
        registry.get("advantages", "grpoo")
    with pytest.raises(registry.PluginLoadError, match=r"Unknown plugin group 'advantage'"):
        registry.available("advantage")


def test_import_scans_nothing():
    code = (
        "import importlib.metadata as m, importlib_metadata as b\n"
        "real = m.entry_points\n"
        "def guard(*a, group='', **k):\n"
        "    if group.startswith('ragen_pl'): raise SystemExit('ragen_pl entry points scanned')\n"
        "    return real(*a, group=group, **k) if group else real(*a, **k)\n"
        "m.entry_points = b.entry_points = guard\n"
        "import ragen_pl, ragen_pl.registry, ragen_pl.advantages, ragen_pl.filters\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_cli_plugins_lists_builtins():
    out = subprocess.run(
        [sys.executable, "-m", "ragen_pl.cli", "plugins"], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[0].split() == ["GROUP", "NAME", "CLASS", "DISTRIBUTION"]
    assert any(line.split()[:3] == ["ragen_pl.envs", "sokoban", "ragen_pl.envs.sokoban:Sokoban"] for line in out.splitlines())


@pytest.mark.slow
def test_example_plugin_installs_and_is_usable(tmp_path, monkeypatch):
    """The real third-party path: pip-install plugins/ragen-pl-example, then discover and use it by name."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(ROOT / "plugins" / "ragen-pl-example")],
        check=True, capture_output=True,
    )
    monkeypatch.syspath_prepend(str(target))
    plugins = registry.load_plugins(reload=True)
    try:
        info = plugins["ragen_pl.envs"]["line_world"]
        assert (info.dist, info.value) == ("ragen-pl-example", "ragen_pl_example.line_world:LineWorld")
        env = registry.resolve("envs", "line_world", length=5)
        obs = env.reset(3)
        assert len(obs) == 5 and "P" in obs and "G" in obs
        while True:
            obs, reward, done, info_ = env.step(env.expert_action())
            if done:
                break
        assert info_["success"] and reward == 1.0
        assert issubclass(registry.get("advantages", "reinforce"), Advantage)
        # And the CLI lists it, with its distribution.
        env_vars = {**__import__("os").environ, "PYTHONPATH": str(target)}
        out = subprocess.run([sys.executable, "-m", "ragen_pl.cli", "plugins"], capture_output=True, text=True,
                             check=True, env=env_vars).stdout
        assert any(line.split()[:2] == ["ragen_pl.envs", "line_world"] and "ragen-pl-example" in line
                   for line in out.splitlines())
    finally:
        registry._cache = None


class ExitingEntryPoint(FakeEntryPoint):
    def load(self):
        raise SystemExit(0)


def test_plugin_calling_sys_exit_is_a_load_error(fake_eps):
    """A plugin that calls sys.exit(0) at import must not end `ragen-pl plugins` or `fit` silently with 0."""
    fake_eps["ragen_pl.envs"] = [ExitingEntryPoint("quitter", "quitter.mod:Env", "ragen_pl.envs", dist="quitter")]
    with pytest.raises(registry.PluginLoadError, match=r"'quitter'.*from quitter 0\.0\.1\) failed to import: SystemExit"):
        registry.load_plugins()
    from ragen_pl.cli import main

    assert main(["plugins"]) == 2


def test_duplicate_blames_the_third_party_even_when_it_sorts_first(fake_eps):
    # Its value sorts before ragen-pl's own ("...:BiLevelGAE" < "...:GAE"), so it used to be loaded first.
    fake_eps["ragen_pl.advantages"] = [FakeEntryPoint("gae", "ragen_pl.advantages:BiLevelGAE", "ragen_pl.advantages",
                                                      dist="aaa-plugin")]
    with pytest.raises(registry.PluginLoadError,
                       match=r"'gae' in group 'ragen_pl.advantages' \(ragen_pl.advantages:BiLevelGAE, from aaa-plugin "
                             r"0\.0\.1\) repeats a name already taken by ragen_pl.advantages:GAE from ragen-pl"):
        registry.load_plugins()


def test_the_jsonargparse_seam_that_resolves_entry_names_is_still_there():
    """``ragen_pl.cli`` wraps jsonargparse's private ``_typehints.resolve_class_path_by_name`` so configs can name
    components by entry name (``grpo``); jsonargparse offers no supported hook for it. This pins what is patched:
    the function exists with the signature the wrapper calls, jsonargparse looks it up by its module-global name
    (so the wrapper is what runs), and an entry name then parses to its class. A jsonargparse release that moves it
    fails here, not silently in users' configs."""
    import inspect

    from jsonargparse import ArgumentParser, _typehints

    from ragen_pl.advantages import Advantage
    from ragen_pl.cli import install_entry_name_resolver

    original = _typehints.resolve_class_path_by_name
    assert list(inspect.signature(getattr(original, "__wrapped__", original)).parameters)[:2] == ["cls", "name"]
    assert "resolve_class_path_by_name(" in inspect.getsource(_typehints.adapt_typehints)
    install_entry_name_resolver()
    assert getattr(_typehints.resolve_class_path_by_name, "_ragen_pl", False)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--advantage", type=Advantage)
    assert parser.parse_args(["--advantage=grpo"]).advantage.class_path == "ragen_pl.advantages.GRPO"
