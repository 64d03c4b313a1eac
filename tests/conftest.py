"""Shared fixtures: an offline, sandboxed environment and tiny validated run configs."""

import os
import threading
import time

# NumPy references in tests call BLAS; on a 2-core machine its threads fight XLA's for cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The tests' tiny models spend their time compiling, not running. LLVM's optimisation of the CPU
# kernels XLA emits does not change what the programs compute (the HLO, its SPMD partitioning and
# its fusions are the same; golden losses agree well inside their tolerance), and at level 0 the
# suite's CPU time falls by about a third. Benchmarks (bench/) and real runs keep the default.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from utils.config import RunConfig, validate  # noqa: E402

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")

# A model small enough to compile and step in well under a second on a CPU core.
TINY_OVERRIDES = (
    "model.dim=32",
    "model.num_heads=2",
    "model.num_blocks=2",
    "model.context_length=16",
    "model.vocab_size=64",
    "dataset.batch_size=8",
    "train.max_steps=20",
    "train.sample_tokens=0",
    "logging.sample_prompts=[]",
    "logging.log_callback_data=false",  # diagnostics double the compile time; their tests switch them on
    "logging.progress_bar=false",
)

# The model of end-to-end runs through `python train_jax.py` (byte tokens: vocab 257 -> 320).
CLI_TINY = (
    "model.dim=32",
    "model.num_heads=2",
    "model.num_blocks=2",
    "model.context_length=32",
    "dataset.batch_size=8",
    "train.max_val_steps=2",
    "logging.log_callback_data=false",  # compiled once, not twice; train_lm.sh's smoke run keeps them on
)


@pytest.fixture(scope="session")
def _cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("eqtrain_cache")


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """One XLA compilation cache for the session, in-process and for every subprocess run of
    train_jax.py: the tiny test runs compile the same programs again and again, and a cache hit
    halves the suite's time. It starts empty, so no test depends on an earlier session."""
    import jax

    path = str(tmp_path_factory.mktemp("xla_cache"))
    settings = {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in settings.items():
            mp.setenv(name.upper(), str(value))
            jax.config.update(name, value)
        yield


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch, _cache_dir):
    """No network, no W&B, and a throwaway cache (shared by the session so tokenized corpora are
    reused; a test that needs an empty cache can set EQTRAIN_CACHE to its own tmp_path)."""
    monkeypatch.setenv("EQTRAIN_CACHE", str(_cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")


class BackgroundContext:
    """What a module's `start_background(ctx)` gets: the session's selected tests of that module,
    the session's tmp_path_factory and tokenized-corpus cache, and (in os.environ) the session's
    compilation cache."""

    def __init__(self, module, items, tmp_path_factory, cache_dir):
        self.module, self.items = module, items
        self.tmp_path_factory, self.cache_dir = tmp_path_factory, cache_dir

    def wanted(self, *test_names: str) -> bool:
        """Whether the session runs any of these tests of the module."""
        return any(item.originalname in test_names for item in self.items)

    def params(self, test_name: str, param: str) -> list:
        """The values of `param` among the session's parametrized cases of `test_name`."""
        return [item.callspec.params[param] for item in self.items
                if item.originalname == test_name and hasattr(item, "callspec") and param in item.callspec.params]


BACKGROUND_NICE = 10


class Background:
    """Tests that mostly wait on subprocesses (test_cli, test_multiprocess, test_preemption) leave a
    core idle, and so do the in-process tests (XLA compiles on one). So a module that defines
    `start_background(ctx) -> handle` (handle: `wait()` until its processes are done, `close()`
    kills them and starts nothing more) has its runs started by one thread from the beginning of the
    session, one module after another in test order, while the tests before it run in this process;
    its tests then only inspect what the runs left (`handle(module)`). One module at a time: the
    suite is CPU-bound, and two modules' runs side by side slow each other more than they gain."""

    def __init__(self, items, tmp_path_factory, cache_dir):
        self.modules: list = []
        by_module: dict = {}
        for item in items:
            if hasattr(item.module, "start_background"):
                if item.module not in by_module:
                    self.modules.append(item.module)
                by_module.setdefault(item.module, []).append(item)
        self._contexts = {m: BackgroundContext(m, by_module[m], tmp_path_factory, cache_dir) for m in self.modules}
        self._ready = {m: threading.Event() for m in self.modules}
        self._handles: dict = {}
        self.spans: dict = {}  # module -> (start, end) in seconds since the session began: the summary shows them
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="background runs", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # The background is off the suite's critical path (the pytest process's own tests are on
        # it; a module's runs mostly finish before its tests are reached), so on a busy machine it
        # yields: this thread, the threads it starts and their processes run at nice 10 (Linux
        # nice is per thread and inherited; the local SLURM cluster's jobs take their submitter's,
        # see scripts/slurm/local_cluster.sh). When the pytest process waits, they get every core.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except (AttributeError, OSError):  # not Linux: the same runs, at the default priority
            pass
        for module in self.modules:
            with self._lock:
                if self._closed:
                    break
                try:
                    self._handles[module] = module.start_background(self._contexts[module])
                except BaseException as e:  # noqa: BLE001 - handle() reports it to the module's tests
                    self._handles[module] = f"start_background failed: {type(e).__name__}: {e}"
            self._ready[module].set()
            found = self._handles[module]
            if found is not None and not isinstance(found, str):
                started = time.monotonic() - self._t0
                found.wait()
                self.spans[module] = (started, time.monotonic() - self._t0)
        for event in self._ready.values():
            event.set()

    def handle(self, module, timeout_s: float = 3600):
        """The module's handle, once its runs have started (after the modules before it are done)."""
        if not self._ready[module].wait(timeout_s):
            pytest.fail(f"{module.__name__}'s background runs did not start within {timeout_s} s")
        found = self._handles.get(module)
        if found is None or isinstance(found, str):
            pytest.fail(f"{module.__name__}: {found or 'background runs not started (session closing)'}")
        return found

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for found in list(self._handles.values()):
            if found is not None and not isinstance(found, str):
                found.close()


_BACKGROUND: list[Background] = []


@pytest.fixture(scope="session", autouse=True)
def background(request, tmp_path_factory, _cache_dir, _compilation_cache):
    """The session's Background (see the class); at the end, every run it started is killed."""
    runner = Background(request.session.items, tmp_path_factory, _cache_dir)
    _BACKGROUND.append(runner)
    yield runner
    runner.close()


def pytest_terminal_summary(terminalreporter):
    """When each module's background runs went, to see what the suite's wall time waits on."""
    for runner in _BACKGROUND:
        if runner.spans:
            spans = ", ".join(f"{m.__name__} {a:.0f}-{b:.0f} s" for m, (a, b) in runner.spans.items())
            terminalreporter.write_line(f"background runs: {spans}")


def offline_env(cache_dir) -> dict[str, str]:
    """os.environ for a subprocess run of train_jax.py: offline, W&B off, the session's caches
    (what _offline_env gives a test; a background run starts outside any test)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "HYDRA_FULL_ERROR", "SMOKE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", EQTRAIN_CACHE=str(cache_dir),
               XLA_FLAGS=FAST_COMPILE)  # no forced device count: each run says how many devices it wants
    return env


def compose_config(*overrides: str):
    """conf/config.yaml composed with TINY_OVERRIDES then `overrides` (later ones win)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[*TINY_OVERRIDES, *overrides])


@pytest.fixture
def tiny_run():
    """Factory: `tiny_run("optimizer=sgdm", "train.gradient_clip_val=null")` -> validated RunConfig
    of a tiny GPT (dim 32, 2 blocks, context 16, vocab 64, batch 8) plus the given overrides."""

    def make(*overrides: str) -> RunConfig:
        return validate(compose_config(*overrides))

    return make


def load_script(name: str):
    """scripts/<name>.py imported as a module, to call its functions and main(argv) in-process.
    Registered in sys.modules before it runs: its dataclasses look their module up while built."""
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(CONF_DIR), "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
