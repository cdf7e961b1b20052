"""What every `automap` command shares: the Typer app, the common options and the helpers
that turn a user's arguments into a step, a cluster or a plan file.

The conventions every long-running command keeps:

- progress (a Rich bar or spinner) goes to stderr by default, so stdout stays clean;
- `--quiet/-q` prints only what was asked for (errors still show, on stderr);
- `--json` prints machine-readable JSON on stdout and nothing else there, progress off;
- an error the user can cause is one line naming the fix, exit code 2, never a traceback;
- Ctrl-C exits with code 130 after keeping whatever was already found;
- the answer is printed before any file is written, and a write that fails (a full disk)
  keeps the file where Ctrl-C keeps one and says so in one line, exit code 1.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

from .._errors import AutomapError

app = typer.Typer(
    name="automap",
    help="Auto-MAP: find, check and apply distributed execution plans for JAX training steps."
    "\n\nExample: automap plan --model bert-large --cluster a100 --devices 16 -o plan.json",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()  # tables and answers: stdout
err_console = Console(stderr=True)  # progress, notes and errors: stderr

# The exit code of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130

ModelOpt = Annotated[
    str | None, typer.Option("--model", "-m", help="Zoo model name (see `automap models`).")
]
FnOpt = Annotated[
    str | None,
    typer.Option(
        "--fn", help="package.module:function returning (step_fn, args) for your own step."
    ),
]
OverrideOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Model override KEY=VALUE (layers, hidden, heads, batch, seq, image, dtype...); repeatable.",
    ),
]
ClusterOpt = Annotated[
    str,
    typer.Option(
        "--cluster", "-c", help="Preset name (a100, h100, ...) or a cluster YAML/JSON file."
    ),
]
DevicesOpt = Annotated[
    int | None,
    typer.Option(
        "--devices",
        "-n",
        help="Number of devices in the cluster (1 or more; default 8, or a TPU --topology's).",
    ),
]
TopologyOpt = Annotated[
    str | None,
    typer.Option(
        "--topology",
        help="TPU presets: the slice, chips per torus dimension (4x4x4) or its name "
        "(v5p-128); --devices follows from it.",
    ),
]
SlicesOpt = Annotated[
    int,
    typer.Option("--slices", help="TPU presets: slices joined by the data-centre network."),
]
JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print machine-readable JSON on stdout (and nothing else there)."),
]
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet", "-q", help="No progress, no tables: only the answer (errors still show)."
    ),
]
PlanFileArg = Annotated[Path, typer.Argument(help="A plan made by `automap plan -o plan.json`.")]


class LegacyCommand(TyperCommand):
    """A command with a hidden argument kept for an old spelling: Typer hides it from the
    help's table but not from the usage line, which would then advertise it."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if not getattr(param, "hidden", False):
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces


def friendly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Print an error the user can fix as one line (exit code 2), not a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except AutomapError as e:
            # soft_wrap: one line however long; the terminal wraps it, a log keeps it whole.
            err_console.print(
                f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True
            )
            raise typer.Exit(2) from None
        except OSError as e:
            # A file the user named could not be read or written (a full disk, no
            # permission): one line, not a traceback. The commands that write a result
            # handle it themselves (`write_or_keep`); this is the net under the rest.
            where = f": {e.filename}" if e.filename else ""
            note(f"error: {e.strerror or e}{where}")
            raise typer.Exit(1) from None

    return wrapper


@contextlib.contextmanager
def busy(message: str, enabled: bool) -> Iterator[Any]:
    """A spinner on stderr while a slow step runs (None when quiet or printing JSON, and
    off a terminal, where a log would only get a stray blank line from it)."""
    if not (enabled and err_console.is_terminal):
        yield None
        return
    with err_console.status(message, spinner="dots") as status:
        yield status


def note(text: str) -> None:
    """One plain line on stderr (no markup, no wrapping): shown even with --quiet or --json."""
    err_console.print(text, highlight=False, soft_wrap=True, markup=False)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def cpu_devices(n: int) -> None:
    """Give this process `n` virtual CPU devices; must run before JAX starts a backend."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", max(n, 1))


def run_devices(need: int) -> list[Any]:
    """The devices to run a plan of `need` devices on: the accelerators when JAX finds
    enough of them (a GPU or TPU host), else `max(8, need)` virtual CPU devices, as
    before. JAX_PLATFORMS, when set, is the user's choice and is kept."""
    import jax

    jax.config.update("jax_num_cpu_devices", max(8, need))  # before any backend starts
    devices, note_text = choose_devices(jax.devices(), lambda: jax.devices("cpu"), need)
    if note_text:
        note(note_text)
    return devices


def choose_devices(
    default: list[Any], cpu: Callable[[], list[Any]], need: int
) -> tuple[list[Any], str]:
    """(devices, a note or "") from JAX's default devices and the CPU's: the default ones
    (accelerators first, as JAX orders its backends) unless there are too few of them."""
    if default[0].platform == "cpu" or len(default) >= need:
        return default, ""
    return cpu(), (
        f"the plan needs {need} devices and this machine has {len(default)} "
        f"{default[0].platform.upper()}(s): running it on {need} virtual CPU devices instead."
    )


def check_devices(devices: int, option: str = "--devices") -> None:
    if devices < 1:
        raise AutomapError(f"{option} must be at least 1, got {devices} (e.g. {option} 8).")


def check_budget(budget: float | None, searchers: Sequence[str] | None = None) -> None:
    """`--budget` by the API's rule (`_search.check_budget`), before any capture or search."""
    if budget is not None:
        from .._search import check_budget as rule

        rule(budget, searchers, "--budget")


def check_seed(seed: int) -> None:
    """`--seed` by the API's rule (`_search.check_seed`), before any capture or search."""
    from .._search import check_seed as rule

    rule(seed, "--seed")


def check_output(path: Path | None, option: str) -> None:
    """Refuse, before any work, an output file that cannot be written: a long search must
    not end in a traceback that loses its result."""
    if path is None:
        return
    if path.is_dir():
        raise AutomapError(
            f"{option} {path} is a directory: give a file name, e.g. {option} "
            f"{path / ('out' + (path.suffix or '.json'))}."
        )
    parent = path.parent
    for above in (parent, *parent.parents):
        if above.exists():
            if not above.is_dir():
                raise AutomapError(
                    f"{option} {path}: {above} is a file, not a directory; choose another path."
                )
            break
    if not parent.exists():
        raise AutomapError(
            f"{option} {path}: the directory {parent} does not exist; create it first "
            f"(mkdir -p {parent})."
        )
    _try_open(path, option)


def _try_open(path: Path, option: str) -> None:
    """Open `path` for appending, as the write will, and remove it again if this made it.
    `os.access` is no test: for root it is true of /proc and of a read-only mount.
    Non-blocking, so that a FIFO without a reader is refused rather than waited on."""
    existed = path.exists()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise AutomapError(
            f"{option} {path} cannot be written ({e.strerror or e}); choose a writable place."
        ) from None
    os.close(fd)
    if not existed:
        path.unlink(missing_ok=True)


def unused_path(path: Path) -> Path:
    """`path`, or plan-1.json, plan-2.json...: never overwrite a file the user did not name."""
    n = 0
    candidate = path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def write_or_keep(
    write: Callable[[Path], Any], path: Path, what: str, keep_as: Path
) -> Path | None:
    """`write(path)`; when that fails (a full disk, /dev/full) the answer is not lost: it
    goes where Ctrl-C keeps one (`keep_as`, or keep_as-1... when that exists), and a line
    on stderr says so. Where it was written, or None when nowhere could take it (the
    answer printed above is then all there is; the line says that too)."""
    existed = path.exists()
    try:
        write(path)
        return path
    except OSError as e:
        failed = f"{what} could not be written to {path} ({e.strerror or e})"
        if not existed:
            _remove_partial(path)
    keep = unused_path(keep_as)
    try:
        write(keep)
    except OSError as e:
        _remove_partial(keep)  # unused_path: this call made it
        note(f"error: {failed}, nor to {keep} ({e.strerror or e}); it is printed above only.")
        return None
    note(f"error: {failed}; it is saved to {keep} instead.")
    return keep


def _remove_partial(path: Path) -> None:
    """Remove the file a failed write made: half a JSON file is no use, and must not be
    read later as a plan. A device (/dev/full) or FIFO is left alone."""
    with contextlib.suppress(OSError):
        if path.is_file() and not path.is_symlink():
            path.unlink()


#: The exit code of a command stopped by SIGTERM (128 + 15), as shells report it.
TERMINATED = 143


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[dict[str, bool]]:
    """SIGTERM (a scheduler's time limit, `kill`) stops a search as Ctrl-C does, so the
    best plan so far is kept; the yielded dict's "terminated" says which signal it was,
    and "interrupted" that Ctrl-C was pressed even where the raise it made was lost.
    The handler is the main thread's only (Python delivers signals there) and is undone
    on exit."""
    from .._search import STOP

    seen = {"terminated": False, "interrupted": False}
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def ctrl_c(signum: int, frame: Any) -> None:
        # Python's own Ctrl-C, plus STOP. A KeyboardInterrupt raised inside a garbage-
        # collection callback (JAX has one; Ctrl-C during a capture landed there) is
        # printed as ignored and dropped, and the run went on to plan and exit 0: there
        # the signal is sent again a moment later, to land outside it. The sampling
        # searchers poll STOP, and the caller reads "interrupted" after the search.
        seen["interrupted"] = True
        STOP.set()
        if _in_gc_callback(frame):
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        raise KeyboardInterrupt

    def handler(signum: int, frame: Any) -> None:
        seen["terminated"] = True
        STOP.set()  # polled by the searchers: the stop holds even if the raise is lost
        on_ctrl_c = signal.getsignal(signal.SIGINT)
        if callable(on_ctrl_c):  # what Ctrl-C does now: the DQN's own handler, say
            on_ctrl_c(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    previous_int = signal.signal(signal.SIGINT, ctrl_c)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous)
        STOP.clear()


def _in_gc_callback(frame: Any) -> bool:
    """Whether `frame` runs inside one of `gc.callbacks`, where Python drops exceptions."""
    codes = {getattr(callback, "__code__", None) for callback in gc.callbacks} - {None}
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def leave_now(code: int) -> NoReturn:
    """Exit with `code` without the interpreter's teardown (`main`): what was printed is
    flushed first, so the one-line message is never lost."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def held_save_warnings() -> Iterator[list[str]]:
    """Hold back what a search could not write on the side (`SaveWarning`: the DQN's
    search state or agent on a full disk), to be said after the answer is printed; the
    yielded list gets one line each when the block ends. Other warnings show as usual."""
    from .._errors import SaveWarning

    held: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SaveWarning)
        try:
            yield held
        finally:
            for w in caught:
                if issubclass(w.category, SaveWarning):
                    held.append(f"error: {w.message}")
                else:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def check_plan_file(path: Path) -> Path:
    """The plan argument of apply/verify/report, refused early when it cannot be a plan."""
    if path.is_dir():
        raise AutomapError(
            f"{path} is a directory, not a plan file: give the JSON file that "
            "`automap plan -o plan.json` wrote."
        )
    return path


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise AutomapError(f"--set takes KEY=VALUE, got {item!r} (e.g. --set layers=2).")
        key, raw = item.split("=", 1)
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare word such as float32
        out[key.strip()] = value
    return out


def load_step(model: str | None, fn: str | None, override: list[str] | None):
    """(step_fn, args, origin) from a zoo model or a user's `module:function`."""
    from .._capture import load_fn, load_zoo

    if (model is None) == (fn is None):
        raise AutomapError("give exactly one of --model NAME or --fn package.module:function.")
    if model is not None:
        return load_zoo(model, parse_overrides(override), abstract=True)
    if override:
        raise AutomapError(
            "--set overrides apply to zoo models; change your --fn function instead."
        )
    try:
        return load_fn(fn)
    except AutomapError:
        raise
    except Exception as e:
        # The user's module or function failed: say where, not a traceback from our code.
        raise AutomapError(
            f"--fn {fn} failed with {type(e).__name__}: {e}; the module must import and the "
            "function take no arguments and return (step_fn, args)."
        ) from None


def load_cluster(cluster: str, devices: int | None, topology: str | None = None, slices: int = 1):
    """The cluster of --cluster and --devices (default 8); for a TPU preset, its slice
    (--topology, from which the devices follow) and --slices."""
    from .._cluster import Cluster

    if devices is not None:
        check_devices(devices)
    path = Path(cluster)
    if path.is_dir():
        raise AutomapError(
            f"--cluster {cluster} is a directory: give a preset name or a YAML/JSON file."
        )
    tpu = topology is not None or slices != 1
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if tpu:
            raise AutomapError(
                f"--topology and --slices take a TPU preset; the file {cluster} gives its "
                "own: write topology: [4, 4, 4] and slices: 2 in it."
            )
        return Cluster.from_file(path).with_devices(8 if devices is None else devices)
    extra: dict[str, Any] = {"topology": topology} if topology is not None else {}
    if slices != 1:
        extra["slices"] = slices
    return Cluster.preset(cluster, devices=devices, **extra)


def json_flags(
    as_json: bool, legacy: Path | None, json_out: Path | None
) -> tuple[bool, Path | None]:
    """(print JSON on stdout, JSON file to write) from `--json`, `--json-out` and the old
    spelling `--json FILE`, which still writes FILE and prints tables as it used to.

    Typer cannot give `--json` an optional value, so FILE arrives as a hidden positional
    argument; anything there without `--json` before it is a mistake, not a file.
    """
    if legacy is None:
        return as_json, json_out
    if not as_json or json_out is not None:
        raise AutomapError(
            f"unexpected argument {str(legacy)!r}: this command takes options only; "
            "write JSON to a file with --json-out FILE."
        )
    note(f"note: `--json {legacy}` is now `--json-out {legacy}` (`--json` alone prints JSON).")
    return False, legacy
