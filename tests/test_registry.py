"""The one registry mechanism (impl/registry.py) and the registries built on it."""

import pytest

from impl.registry import Registry, RegistryError, resolve


def test_register_lookup_aliases_and_errors():
    r = Registry("widget", base=int)
    r.register("one", int, aliases=("uno",))

    @r.register("two", aliases=("dos",))
    class Two(int):
        pass

    assert r["uno"] is int and r.get_entry("dos") is Two and Two.registered_name == "two"
    assert list(r) == ["one", "two"] and "uno" in r and "tres" not in r and len(r) == 2
    assert r.canonical("dos") == "two" and r.aliases() == {"uno": "one", "dos": "two"}
    assert r.build("two", 3) == 3
    with pytest.raises(RegistryError, match="unknown widget 'tres'; registered: one, two"):
        r.get_entry("tres")
    with pytest.raises(KeyError):
        r["tres"]
    with pytest.raises(RegistryError, match="already registered"):
        r.register("uno", float)  # an alias is taken
    with pytest.raises(RegistryError, match="already registered"):
        r.register("one", float)
    r.register("one", int)  # the same object again: a no-op
    with pytest.raises(RegistryError, match="is not a int"):
        r.register("bad", str)


def test_lazy_entries_import_on_first_use_and_are_checked():
    r = Registry("thing", base="collections:OrderedDict")
    r.register("od", "collections:OrderedDict")
    r.register("bad", "collections:Counter")
    assert "od" in r and r.names() == ["od", "bad"]  # listing imports nothing
    import collections

    assert r["od"] is collections.OrderedDict
    with pytest.raises(RegistryError, match="not a OrderedDict"):
        r.get_entry("bad")
    assert resolve("os.path:join") is __import__("os").path.join
    assert resolve("json") is __import__("json")
    with pytest.raises(RegistryError):
        resolve(":x")


def test_project_registries():
    from impl.cli import COMMANDS
    from impl.config import CONFIG_SECTIONS
    from impl.methods import METHODS
    from impl.report.markdown import REPORT_SECTIONS
    from impl.tev.verify import VERIFIERS
    from impl.vskipper.skipper import SKIPPERS, Skipper

    assert list(METHODS) == ["ar", "dex", "self_spec", "adadecode", "dynamic_exit", "hf_early_exit",
                             "hf_prompt_lookup", "hf_assisted", "lookahead", "dflash_chain", "pearl"]
    assert list(VERIFIERS) == ["predraw_follow", "sequential_residual", "tev"]
    assert {"random", "static-depth", "flexidepth"} <= set(SKIPPERS)
    assert SKIPPERS.canonical("randomskip") == "random" and SKIPPERS.canonical("static") == "static-depth"
    assert issubclass(SKIPPERS["random"], Skipper)
    assert list(CONFIG_SECTIONS) == ["dex", "tev", "vskipper"] and all(hasattr(CONFIG_SECTIONS[n], "SECTION")
                                                              for n in CONFIG_SECTIONS)
    assert set(REPORT_SECTIONS) == {"dex", "tev", "vskipper-serving", "vskipper-bench", "vskipper-http", "vskipper-sglang"}
    assert all(callable(REPORT_SECTIONS[n]) for n in REPORT_SECTIONS)
    assert all(callable(COMMANDS[n]) for n in COMMANDS)
