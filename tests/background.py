"""A pytest plugin (pyproject: `addopts = "-p background"`): set-ups that start subprocess runs
in the background from the beginning of the session, for the tests that will inspect what the
runs left.

Why: tests that mostly wait on subprocesses (test_cli, test_multiprocess, test_preemption,
test_slurm) leave a core idle, and so do the in-process tests (XLA compiles on one). Started early,
a module's runs go while the tests before it run in the pytest process, and are mostly done when
its tests are reached.

Interface, in a test module:

    import background

    @background.setup
    def sweep_run(ctx) -> Started:            # a fixture named `sweep_run`, module-scoped
        return Started(ctx.tmp_path_factory.mktemp("sweep"), ...)

    @background.setup(params=["SIGTERM", "SIGINT"])
    def signal_run(ctx, sig) -> Chain:        # one set-up per parameter value, as fixture params
        reference = ctx.setup("reference")    # another set-up of this module, started now if not yet
        return Chain(...)

    def test_sweep(sweep_run): ...            # requests the set-up by its fixture, directly or
                                              # through another fixture; gets the handle
    def test_signal(signal_run): ...          # one case per parameter
    @pytest.mark.parametrize("signal_run", ["SIGTERM"], indirect=True)
    def test_storm(signal_run): ...           # one chosen case

- A set-up is keyed by its fixture's name and, where it has one, its parameter (params must be
  hashable; fixture `ids` may name them). At the start of the session the runner looks at the
  selected tests (after -k, -m, node ids): a set-up starts only if a selected test requests its
  fixture (pytest's fixture closure: directly or through other fixtures), once per parameter that
  a selected case uses. `ctx.setup(name, param)` starts a dependency of a set-up on demand.
- A set-up returns a handle with `wait()` (until its processes are done; returns nothing) and
  `close()` (kill what still runs and start nothing more; called at the end of the session, maybe
  more than once, maybe while the set-up's own threads are still starting runs), or None when it
  has nothing to start. The fixture's value is the handle; a set-up that raised, or returned None,
  fails the tests that request it with its message.
- `ctx`: `tmp_path_factory`, plus the entries of the session fixture `background_session` (a dict;
  tests/conftest.py provides `cache_dir`, and by requesting the compilation cache it makes the
  runner start after that cache is in os.environ, which the runs inherit).
- One module at a time, in the order of the selected tests: a module's set-ups all start (in the
  order they are declared; parameters in the order of `params`), then the runner waits for all of
  them before starting the next module's. The suite is CPU-bound: two modules' runs side by side
  slow each other more than they gain.
- The runner's thread, the threads it starts and their processes run at nice 10: the background
  is off the suite's critical path (the pytest process's own tests are on it), so on a busy machine
  it yields; when the pytest process waits, they get every core. (Linux nice is per thread and
  inherited; the local SLURM cluster's jobs take their submitter's: scripts/slurm/local_cluster.sh.)
- At the end of the session every handle is closed (its runs killed), and the terminal summary
  says when each module's runs went, to see what the suite's wall time waits on.
- Under pytest-xdist (`-n 2 --dist loadfile`, the README's test command) every worker collects the
  whole suite but runs only the modules it is sent, which it learns one at a time. A worker's runner
  therefore starts a module's set-ups when the worker reaches the module (its first test), not from the
  session's start: the other worker keeps the second core busy instead, and no set-up runs twice.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import pytest

NICE = 10
READY_TIMEOUT_S = 3600
NO_PARAM = object()  # the parameter of a set-up that has none


class Handle(Protocol):
    def wait(self) -> None: ...

    def close(self) -> None: ...


@dataclass(eq=False)  # hashed by identity: a key of the plan
class Setup:
    name: str
    module: str  # the __name__ of the test module that declares it
    fn: Callable[..., Handle | None]
    params: list | None
    order: int  # declaration order in its module


_SETUPS: dict[str, dict[str, Setup]] = {}  # module name -> set-up name -> Setup


def setup(fn=None, *, params=None, ids=None, scope: str = "module"):
    """Declare a background set-up (see the module's docstring). Used bare (`@background.setup`) or
    with fixture options: `params` (one set-up per value), `ids` (their names in test ids), `scope`."""

    def declare(fn):
        found = _SETUPS.setdefault(fn.__module__, {})
        spec = Setup(fn.__name__, fn.__module__, fn, None if params is None else list(params), len(found))
        found[spec.name] = spec

        def fixture(request, background_runner):
            return background_runner.handle(spec, getattr(request, "param", NO_PARAM))

        fixture.__doc__ = fn.__doc__
        fixture.__name__ = spec.name
        return pytest.fixture(fixture, scope=scope, params=spec.params, ids=ids, name=spec.name)

    return declare if fn is None else declare(fn)


class Context:
    """What a set-up gets: the session's tmp_path_factory and the `background_session` entries as
    attributes, and `setup(name, param)` for another set-up of its module."""

    def __init__(self, runner: "Runner", module: str, tmp_path_factory, session: dict[str, Any]):
        self._runner, self._module = runner, module
        self.tmp_path_factory = tmp_path_factory
        for key, value in session.items():
            setattr(self, key, value)

    def setup(self, name: str, param=NO_PARAM) -> Handle | None:
        """The handle of set-up `name` (with `param`) of this module, started now if it is not yet."""
        found = self._runner.start(_SETUPS[self._module][name], param, self)
        if isinstance(found, Failed):
            raise RuntimeError(f"{_key_name(name, param)}: {found.why}")
        return found


@dataclass
class Failed:
    why: str


def _key_name(name: str, param) -> str:
    return name if param is NO_PARAM else f"{name}[{param}]"


@dataclass
class Module:
    name: str
    keys: list[tuple[Setup, Any]]  # the requested set-ups, in start order
    ready: threading.Event = field(default_factory=threading.Event)
    started: dict = field(default_factory=dict)  # (set-up name, param) -> handle, None or Failed


def plan(items) -> list[Module]:
    """The set-ups the selected tests request, by module in test order."""
    wanted: dict[str, set] = {}
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", None)
        declared = _SETUPS.get(module)
        if not declared:
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        keys = wanted.setdefault(module, set())
        for name in getattr(item, "fixturenames", ()):
            if name in declared:
                keys.add((declared[name], params.get(name, NO_PARAM)))

    def order(key: tuple[Setup, Any]):
        spec, param = key
        return spec.order, spec.params.index(param) if spec.params and param in spec.params else 0

    return [Module(module, sorted(keys, key=order)) for module, keys in wanted.items() if keys]


class Runner:
    """Starts the planned set-ups from one thread, one module after another (see the docstring)."""

    def __init__(self, items, tmp_path_factory, session: dict[str, Any], on_reach: bool = False):
        """`on_reach` (an xdist worker): a module's set-ups start when `reach(module)` is first called,
        instead of all modules in test order from now."""
        self.modules = {m.name: m for m in plan(items)}
        self._tmp_path_factory, self._session = tmp_path_factory, session
        self.spans: dict[str, tuple[float, float]] = {}  # module -> (start, end), s since the session began
        self._t0 = time.monotonic()
        self._lock = threading.RLock()
        self._closed = False
        self._queued: set[str] = set()
        self._todo: queue.Queue[str | None] = queue.Queue()  # module names to start, in order; None: stop
        if not on_reach:
            for name in self.modules:
                self.reach(name)
            self._todo.put(None)
        self._thread = threading.Thread(target=self._run, name="background runs", daemon=True)
        self._thread.start()

    def reach(self, module: str) -> None:
        """Queue `module`'s set-ups (once; nothing if it has none)."""
        with self._lock:
            if module in self.modules and module not in self._queued and not self._closed:
                self._queued.add(module)
                self._todo.put(module)

    def start(self, spec: Setup, param, ctx: Context):
        """The set-up's handle, started now if it is not yet (in the runner's thread, under the lock)."""
        module = self.modules[spec.module]
        key = (spec.name, param)
        if key not in module.started:
            module.started[key] = Failed("depends on itself")  # a cycle finds this
            try:
                module.started[key] = spec.fn(ctx) if param is NO_PARAM else spec.fn(ctx, param)
            except BaseException as e:  # noqa: BLE001 - the set-up's tests report it
                module.started[key] = Failed(f"{type(e).__name__}: {e}")
        return module.started[key]

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):  # not Linux: the same runs, at the default priority
            pass
        while (name := self._todo.get()) is not None:
            module = self.modules[name]
            with self._lock:
                if self._closed:
                    break
                ctx = Context(self, module.name, self._tmp_path_factory, self._session)
                for spec, param in module.keys:
                    self.start(spec, param, ctx)
            module.ready.set()
            handles = [h for h in module.started.values() if h is not None and not isinstance(h, Failed)]
            if handles:
                started = time.monotonic() - self._t0
                for handle in handles:
                    try:
                        handle.wait()
                    except Exception:  # noqa: BLE001 - what went wrong is the tests' to report
                        pass
                self.spans[module.name] = (started, time.monotonic() - self._t0)
        for module in self.modules.values():
            module.ready.set()

    def handle(self, spec: Setup, param) -> Handle:
        """The set-up's handle, once its module's runs have started (after the modules before it are done)."""
        what = f"{spec.module}: {_key_name(spec.name, param)}"
        module = self.modules.get(spec.module)
        if module is None:
            pytest.fail(f"{what}: no selected test requests it (requested at run time: getfixturevalue?)")
        self.reach(spec.module)
        if not module.ready.wait(READY_TIMEOUT_S):
            pytest.fail(f"{what}: the background runs did not start within {READY_TIMEOUT_S} s")
        found = module.started.get((spec.name, param))
        if found is None or isinstance(found, Failed):
            why = found.why if found else ("started nothing" if (spec.name, param) in module.started
                                           else "not started (the session is closing)")
            pytest.fail(f"{what}: {why}")
        return found

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._todo.put(None)
        for module in self.modules.values():
            for found in list(module.started.values()):
                if found is not None and not isinstance(found, Failed):
                    found.close()


_RUNNERS = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def background_session() -> dict[str, Any]:
    """What every set-up's ctx carries besides tmp_path_factory; a conftest overrides it."""
    return {}


@pytest.fixture(scope="session", autouse=True)
def background_runner(request, tmp_path_factory, background_session):
    """The session's Runner, started with the first test; at the end, every run it started is killed."""
    on_reach = hasattr(request.config, "workerinput")  # an xdist worker: see the module docstring
    runner = Runner(request.session.items, tmp_path_factory, background_session, on_reach=on_reach)
    request.config.stash.setdefault(_RUNNERS, []).append(runner)
    yield runner
    runner.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A worker reaching a module's first test starts the module's set-ups (before its fixtures, so
    tests that do not request them run while they go)."""
    for runner in item.config.stash.get(_RUNNERS, []):
        runner.reach(getattr(getattr(item, "module", None), "__name__", None))


def pytest_terminal_summary(terminalreporter, config):
    """When each module's background runs went; with -v, which set-ups each module started."""
    for runner in config.stash.get(_RUNNERS, []):
        if runner.spans:
            spans = ", ".join(f"{m} {a:.0f}-{b:.0f} s" for m, (a, b) in runner.spans.items())
            terminalreporter.write_line(f"background runs: {spans}")
        if config.option.verbose > 0:
            for module in runner.modules.values():
                names = ", ".join(_key_name(name, param) for name, param in module.started)
                terminalreporter.write_line(f"background set-ups of {module.name}: {names or 'none started'}")

