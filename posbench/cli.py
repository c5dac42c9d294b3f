"""The command line: thin commands that delegate, and the one place that prints."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from posbench import progress
from posbench.config import EvalConfig, ModelConfig, length_grid, load_config
from posbench.console import BarReporter, err, out
from posbench.errors import PosbenchError, first_line
from posbench.files import disk_full, file_in_the_way
from posbench.registry import unexpected
from posbench.tasks import TASKS

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # a docstring's paragraph reflows to the terminal's width
    help="Which positional encoding lets a transformer LM work beyond its training length?",
)


@contextlib.contextmanager
def user_errors(
    on_interrupt: str = "finished runs and checkpoints are kept; rerun the same command to resume",
    on_oom: str = "a smaller train.batch_size, shorter eval.lengths, a smaller eval.batch_size or a smaller model",
):
    """A domain error becomes one line and a non-zero exit, never a traceback. The command's
    process (not its workers) says before it imports a user's module that only a run folder's
    records name (registry.py)."""
    progress.notice = lambda line: err.print(f"note: {line}", highlight=False, markup=False, soft_wrap=True)
    try:
        yield
    except typer.Exit:
        raise
    except PosbenchError as e:
        _error(str(e), code=e.exit_code)
    except KeyboardInterrupt:
        err.print(f"interrupted: {on_interrupt}", soft_wrap=True)
        said.append("interrupted")
        raise typer.Exit(code=130) from None
    except OSError as e:  # a full disk, an unwritable out_dir, an unreadable file
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        if isinstance(e, (FileExistsError, NotADirectoryError)) and where:  # a folder's path met a file
            file = file_in_the_way(e.filename)
            if file is not None:
                _error(f"{file} is a file, not a folder; give another path")
        _error(f"{where}{e.strerror or e}{_FREE if disk_full(e) else ''}")
    except (torch_oom(), MemoryError) as e:
        _out_of_memory(e, on_oom)
    except Exception as e:  # a bug here or in a user's plugin: still one line, unless debugging
        if os.environ.get("POSBENCH_DEBUG", "0") not in ("", "0"):
            raise
        if "can't allocate memory" in str(e):  # torch's CPU allocator raises a RuntimeError
            _out_of_memory(e, on_oom)
        if disk_full(e):  # torch.save's own RuntimeError, where no writer named its folder
            _error(f"the disk is full ({os.strerror(errno.ENOSPC)}){_FREE}")
        # exit 1, not 2: scripts can tell a bug (here or in a plugin) from a bad input
        _error(f"{unexpected(e)} (POSBENCH_DEBUG=1 shows the traceback)", code=1)
    except SystemExit as e:  # posbench exits through typer.Exit: this is a plugin's (or a library's) sys.exit
        _error(f"{unexpected(e)}; nothing after it ran", code=1)


_FREE = "; free some space, then rerun the same command"
said: list[str] = []  # what a command's edge has said of its interrupt, if it has
_SCORED = "the records hold only what was scored in full; rerun the same command to score the rest"


def _error(message: str, code: int = 2):
    _print_error(message)
    raise typer.Exit(code=code)


def _print_error(message: str) -> None:
    """The one line: markup-escaped, so a path like x[b].yaml prints as it is."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _out_of_memory(e: BaseException, advice: str):
    _error(f"out of memory ({first_line(e, 100)}); try {advice}")


def torch_oom():
    """torch's out-of-memory error, where torch is imported (a command that never imported it,
    such as report, can meet none): the class an except clause names."""
    torch = sys.modules.get("torch")
    return getattr(torch, "OutOfMemoryError", MemoryError)


def _scheme_list(text: str) -> list[str]:
    """`--schemes alibi,rope`, or `all` for every registered scheme."""
    from posbench.schemes import SCHEMES

    return list(SCHEMES) if text.strip() == "all" else _csv_names(text, "--schemes")


def _csv_items(text: str) -> list[str]:
    """A comma-separated list's items, stripped; a trailing comma ends the list ("0,1,")."""
    items = [t.strip() for t in text.split(",")]
    if len(items) > 1 and not items[-1]:
        items.pop()
    return items


def _csv_ints(text: Optional[str], what: str, example: str = "100,150,200") -> Optional[list[int]]:
    if text is None:
        return None
    items = _csv_items(text)
    try:
        if not any(items):
            return []  # the setting's own "is empty" says it
        return [int(t) for t in items]  # "0,,1": an empty item is no integer
    except ValueError:
        raise PosbenchError(f"{what} '{text}': expected comma-separated integers, e.g. {example}") from None


def _whole(x: Optional[float]) -> Optional[float]:
    """A number typer read as a float, as an int where it is whole: --stride 256 is 256 tokens."""
    return int(x) if x is not None and math.isfinite(x) and x == int(x) else x  # nan and inf: the config refuses them


def _set_threads(threads: Optional[int]) -> None:
    import torch

    from posbench.config import check_threads

    if threads is not None:
        check_threads(threads, f"--threads {threads}")
        torch.set_num_threads(threads)


def _csv_names(text: Optional[str], flag: str) -> list[str]:
    """`a,b` (a trailing comma ends the list); `a,,b` is refused, as _csv_ints refuses it."""
    items = _csv_items(text or "")
    if len(items) > 1 and not all(items):
        raise PosbenchError(f"{flag} {text}: an empty name between commas")
    return [t for t in items if t]


def _protocols(text: Optional[str]) -> Optional[list[str]]:
    if text is None:
        return None
    names = _csv_names(text, "--protocol")
    if not names:
        raise PosbenchError(f"--protocol {text!r}: name a protocol, e.g. nonoverlapping,sliding")
    return names


def _measure_names(text: str) -> list[str]:
    names = _csv_names(text, "--measure")
    if not names:
        raise PosbenchError(f"--measure {text!r}: name a measure, e.g. context_gain")
    return names


def _measure_options(assignments: Optional[list[str]]) -> dict:
    """--measure-option key=value, each value read as YAML (k=64,128 is a list)."""
    import yaml

    from posbench.config import parse_yaml

    options = {}
    for a in assignments or []:
        key, eq, text = a.partition("=")
        if not eq or not key.strip():
            raise PosbenchError(f"--measure-option {a!r}: expected key=value, e.g. k=64,128")
        text = f"[{text}]" if "," in text and not text.strip().startswith("[") else text
        try:
            options[key.strip()] = parse_yaml(text)
        except yaml.YAMLError:
            raise PosbenchError(f"--measure-option {a!r}: {text!r} is not a value") from None
    return options


def _print_measures(who: str, scored: list, rdir: Path) -> None:
    """Each measure's new rows as tables, its options as scored, and where they were written."""
    from posbench.console import measure_tables

    for scorer, rows in scored:
        for table in measure_tables(who, scorer, rows):
            out.print(table)
        if scorer.options:
            said = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in scorer.options.items())
            out.print(f"{scorer.name} options: {said}", highlight=False, soft_wrap=True)
        out.print(f"wrote {rdir / 'measures' / (scorer.name + '.csv')}", highlight=False, soft_wrap=True)


def _print_summary(
    exps, metric=None, transpose: bool = False, out_dir=None, buckets=None, asked=None, tracker=None
) -> None:
    """Write and print the report; with a tracker, send the experiment's tables and plots too."""
    from posbench.console import print_report
    from posbench.report import write_summary
    from posbench.trackers import send_report

    print_report(*write_summary(exps, metric, transpose, out_dir, buckets, asked))
    if tracker is not None and out_dir is None:
        send_report(tracker, Path(exps[0] if isinstance(exps, list) else exps))


Sets = Annotated[Optional[list[str]], typer.Option("--set", help="override a config key: key=value")]
MeasureOpt = Annotated[
    Optional[str],
    typer.Option(
        help="score by other measures: context_gain, key_tokens, retrieval, retrieval_short or module:Class, "
        "comma-separated"
    ),
]
MeasureOptions = Annotated[
    Optional[list[str]],
    typer.Option("--measure-option", help="an option of a measure named: key=value, e.g. k=64,128 or alpha=0.5"),
]
TrackerOpt = Annotated[
    Optional[str], typer.Option(help="also send each run to tensorboard, wandb, mlflow or trackio (train.tracker)")
]
AttentionOpt = Annotated[
    Optional[str], typer.Option(help="attention backend: auto, eager, sdpa, native, flex or triton (model.attention)")
]
# a flag: `--compile` alone turns it on; metavar "" keeps the help from showing a value to type
Compile = Annotated[
    bool, typer.Option("--compile", metavar="", help="torch.compile for training; a flag, no value (no gain on CPU)")
]
Protocol = Annotated[
    Optional[str],
    typer.Option(help="nonoverlapping (the default) or sliding; a comma list scores each: nonoverlapping,sliding"),
]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="a YAML config (or give it as the argument)")]
Stride = Annotated[
    Optional[float],
    typer.Option(help="sliding windows' stride: tokens, or below 1 a fraction of each length (default: train_len / 4)"),
]
# extrapolate's help names the defaults its lengths come from, read from the config's own
_TRAIN_LEN, _LENGTHS = ModelConfig().train_len, ",".join(map(str, EvalConfig().lengths))
_GRID = f"--test-len {2 * _TRAIN_LEN} from {_TRAIN_LEN}: {','.join(map(str, length_grid(_TRAIN_LEN, 2 * _TRAIN_LEN)))}"
TaskOpt = Annotated[
    Optional[str],
    typer.Option(help=f"lm (perplexity, the default), {', '.join(TASKS)}, or module:Class"),
]


@app.command()
def extrapolate(
    train_len: Annotated[
        Optional[int], typer.Option(help=f"training length L (default: model.train_len, {_TRAIN_LEN})")
    ] = None,
    test_len: Annotated[
        Optional[int],
        typer.Option(help=f"longest test length N: scores L and 1/4, 1/2 and all of the way to N ({_GRID})"),
    ] = None,
    lengths: Annotated[
        Optional[str], typer.Option(help=f"the test lengths themselves (default: eval.lengths, {_LENGTHS})")
    ] = None,
    schemes: Annotated[Optional[str], typer.Option(help="e.g. alibi,rope, or all")] = None,
    seeds: Annotated[Optional[str], typer.Option(help="e.g. 0,1,2")] = None,
    config: Annotated[Optional[Path], typer.Option(help="a YAML config")] = None,
    set_: Sets = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda")] = None,
    attention: AttentionOpt = None,
    rope_scaling: Annotated[
        Optional[str],
        typer.Option(help="also score evaluation-time variants: rope's yarn,ntk,...; any scheme's rerope,logn,..."),
    ] = None,
    rope_factor: Annotated[
        Optional[float], typer.Option(help="fixed scale s (default L'/L), or a training-free variant's G, w, S, ...")
    ] = None,
    protocol: Protocol = None,
    stride: Stride = None,
    compile_: Compile = False,
    task: TaskOpt = None,
    tracker: TrackerOpt = None,
):
    """Train one model per scheme at the training length and compare them at longer lengths.

    --task copy (or another of --task's) trains on a synthetic task instead of the corpus and
    scores exact-match accuracy by length."""
    from posbench.experiment.execute import run_experiment
    from posbench.resolve import resolve

    stride = _whole(stride)
    with user_errors():
        if test_len is not None and lengths is not None:
            raise PosbenchError("--test-len and --lengths both set the evaluation lengths; give one")
        values = {
            "model.train_len": (f"--train-len {train_len}", train_len),
            "schemes": (f"--schemes {schemes}", _scheme_list(schemes) if schemes is not None else None),
            "seeds": (f"--seeds {seeds}", _csv_ints(seeds, "--seeds", "0,1,2")),
            "eval.lengths": (f"--lengths {lengths}", _csv_ints(lengths, "--lengths")),
            "train.threads": (f"--threads {threads}", threads),
            "train.device": (f"--device {device}", device),
            "model.attention": (f"--attention {attention}", attention),
            "eval.perplexity.rope_scaling": (
                f"--rope-scaling {rope_scaling}",
                _csv_names(rope_scaling, "--rope-scaling") if rope_scaling is not None else None,
            ),
            "eval.perplexity.rope_factor": (f"--rope-factor {rope_factor}", rope_factor),
            "eval.perplexity.protocol": (f"--protocol {protocol}", _protocols(protocol)),
            "eval.perplexity.stride": (f"--stride {stride}", stride),
            "train.compile": ("--compile", compile_ or None),
            "task": (f"--task {task}", task),
            "train.tracker": (f"--tracker {tracker}", tracker),
        }
        cfg = _lengths_once(load_config(config, set_ or [], values), test_len)
        exp = resolve(cfg, test_len)
        _kernel_notes(exp.cfg)
        _print_summary(run_experiment(exp, BarReporter(err)), asked=exp.cfg, tracker=exp.cfg.train.tracker)


@app.command()
def sweep(
    config: Annotated[Optional[Path], typer.Argument(help="a YAML config with a sweep: block of lists")] = None,
    config_opt: ConfigOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the grid and what would be skipped")] = False,
    set_: Sets = None,
    executor: Annotated[str, typer.Option(help="local (this machine), or ray (a Ray cluster)")] = "local",
    address: Annotated[Optional[str], typer.Option(help="the Ray cluster: auto, or ray://head:10001")] = None,
    storage: Annotated[
        Optional[str], typer.Option(help="where Ray tasks keep checkpoints (default: each node's cache)")
    ] = None,
    tracker: TrackerOpt = None,
):
    """Train and compare every run of a config's sweep: grid, in one experiment folder.

    The sweep: block maps config keys (schemes, seeds, model.train_len, any dotted key) to
    lists of values; every combination is a run. A rerun skips finished runs and resumes
    unfinished ones."""
    from posbench.config import load_sweep
    from posbench.console import grid_table
    from posbench.experiment.execute import run_sweep
    from posbench.experiment.plan import plan_sweep
    from posbench.resolve import resolve_sweep

    with user_errors():
        config = _one_config(config, config_opt)
        if config is None:
            raise PosbenchError("posbench sweep needs a config: posbench sweep CONFIG, or --config CONFIG")
        if executor not in ("local", "ray"):
            raise PosbenchError(f"--executor {executor}: expected local or ray")
        if executor == "local" and (address or storage):
            raise PosbenchError("--address and --storage are for --executor ray")
        values = {"train.tracker": (f"--tracker {tracker}", tracker)}
        grid = resolve_sweep(load_sweep(config, set_ or [], values), config)
        if dry_run:
            folder, plan = plan_sweep(grid)
            out.print(grid_table(folder, grid, plan))
            return
        _kernel_notes(*(exp.cfg for _, exp in grid))
        if executor == "ray":
            from posbench.cluster import run_sweep_on_ray

            folder = run_sweep_on_ray(grid, config.read_text(), BarReporter(err), address, storage)
        else:
            folder = run_sweep(grid, config.read_text(), BarReporter(err))
        _print_summary(folder, tracker=grid[0][1].cfg.train.tracker)


def _kernel_notes(*cfgs) -> None:
    """Build the C kernels the runs of `cfgs` take, once, here, before any worker starts; say
    where auto cannot use them."""
    from posbench import native

    native.build_for(cfgs, lambda line: err.print(f"note: {line}", highlight=False, markup=False, soft_wrap=True))


def _lengths_once(cfg, test_len: Optional[int]):
    """`cfg`, refused where --test-len and a --set of eval.lengths both set the lengths."""
    if test_len is not None and cfg.origins.get("eval.lengths", "").startswith("--set"):
        raise PosbenchError(f"--test-len and {cfg.origins['eval.lengths']} both set the evaluation lengths; give one")
    return cfg


def _one_config(argument: Optional[Path], option: Optional[Path]) -> Optional[Path]:
    """The config given as the argument or as --config (as extrapolate and bench take it), not both."""
    if argument is not None and option is not None:
        raise PosbenchError(f"a config given twice ({argument} and --config {option}); give one")
    return argument if argument is not None else option


def _named(value):
    """A folder or file given on the command line (or a list of them), as given, except that one
    ending in `.` or `..` is made absolute (without following links), so that its name is the
    folder's own: `report .` reports the folder it is in, `pretrained ..` names the model by its
    folder. A relative path stays relative, as the records it reaches hold it."""
    if value is None:
        return None
    if isinstance(value, list):
        return [_named(v) for v in value]
    path = Path(value)
    return Path(os.path.abspath(path)) if path.name in ("", "..") else path


def _not_a_flag_value(value: Optional[Path]) -> Optional[Path]:
    """`train --compile true` would read `true` as the config: say that a flag takes no value."""
    if value is not None and not value.exists() and value.name.lower() in ("true", "false", "yes", "no", "on", "off"):
        raise typer.BadParameter(f"'{value}' is not a config; flags such as --compile take no value")
    return value


@app.command()
def train(
    config: Annotated[
        Optional[Path], typer.Argument(help="a YAML config (default: the defaults)", callback=_not_a_flag_value)
    ] = None,
    config_opt: ConfigOpt = None,
    scheme: Annotated[Optional[str], typer.Option(help="one scheme (a name or module:Class)")] = None,
    seed: Annotated[Optional[int], typer.Option(help="one seed")] = None,
    seeds: Annotated[Optional[str], typer.Option(help="several seeds, e.g. 0,1,2")] = None,
    set_: Sets = None,
    attention: AttentionOpt = None,
    compile_: Compile = False,
    task: TaskOpt = None,
    tracker: TrackerOpt = None,
):
    """Train (and evaluate at the config's lengths) the runs of a config, or one of them."""
    from posbench.experiment.execute import run_experiment
    from posbench.experiment.records import run_name
    from posbench.resolve import resolve

    with user_errors():
        config = _one_config(config, config_opt)
        if seed is not None and seeds is not None:
            raise PosbenchError("--seed and --seeds both pick the seeds; give one")
        picked = (
            (f"--seed {seed}", [seed])
            if seed is not None
            else (f"--seeds {seeds}", _csv_ints(seeds, "--seeds", "0,1,2"))
        )
        values = {
            "schemes": (f"--scheme {scheme}", [scheme] if scheme is not None else None),
            "seeds": picked,
            "model.attention": (f"--attention {attention}", attention),
            "train.compile": ("--compile", compile_ or None),
            "task": (f"--task {task}", task),
            "train.tracker": (f"--tracker {tracker}", tracker),
        }
        exp = resolve(load_config(config, set_ or [], values))
        _kernel_notes(exp.cfg)
        folder = run_experiment(exp, BarReporter(err))
        for s in exp.cfg.schemes:
            for n in exp.cfg.seeds:
                out.print(f"run folder: {folder / run_name(s, n)}", highlight=False, soft_wrap=True)
        _print_summary(folder, asked=exp.cfg, tracker=exp.cfg.train.tracker)


@app.command()
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="a run folder holding model.pt", callback=_named)],
    lengths: Annotated[Optional[str], typer.Option(help="e.g. 100,200,400")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
    rope_scaling: Annotated[
        Optional[str],
        typer.Option(
            help="also score variants: rope's linear,ntk,dynamic,yarn,llama3; any's self_extend,rerope,string,..."
        ),
    ] = None,
    rope_factor: Annotated[
        Optional[float], typer.Option(help="fixed scale s (default L'/L per length), or a training-free variant's G, w")
    ] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda (default: the run's)")] = None,
    attention: AttentionOpt = None,
    protocol: Protocol = None,
    stride: Stride = None,
    tracker: TrackerOpt = None,
    measure: MeasureOpt = None,
    measure_option: MeasureOptions = None,
):
    """Evaluate an existing checkpoint; its rows are merged into the run's eval.csv.

    --rope-scaling yarn also scores the rope checkpoint rescaled at evaluation time (rows
    rope+yarn), beside plain rope, at these lengths and the training length; --rope-scaling
    rerope scores a rope, alibi, t5, ... checkpoint with ReRoPE's clipped distances (rows
    alibi+rerope), as the other training-free variants do theirs (docs/schemes.md). --protocol
    sliding (with --stride) scores it under sliding windows, as extrapolate does. --measure
    context_gain,key_tokens scores it by posbench's other measures instead (docs/measures.md), and
    --measure examples.my_measure:NextByteAccuracy by one of your own, at its config's lengths,
    into RUN/measures/; every report of its experiment then shows them."""
    from posbench.console import plain_table
    from posbench.experiment.execute import evaluate_run

    stride = _whole(stride)
    with user_errors(on_interrupt=_SCORED):
        _set_threads(threads)
        if measure is None and measure_option:
            raise PosbenchError("--measure-option sets an option of a measure named by --measure")
        if measure is not None:
            given = [f for f, v in (("--lengths", lengths), ("--rope-scaling", rope_scaling), ("--protocol", protocol),
                                    ("--stride", stride), ("--attention", attention)) if v is not None]  # fmt: skip
            if given:
                raise PosbenchError(f"{given[0]} applies to the run's own measure, not to --measure {measure}")
            from posbench.experiment.execute import measure_run

            names, options = _measure_names(measure), _measure_options(measure_option)
            rc, scored = measure_run(run_dir, names, options, device, tracker)
            _print_measures(f"{rc.model.scheme} seed {rc.seeds[0]}", scored, Path(run_dir))
            return
        kinds = _csv_names(rope_scaling, "--rope-scaling")
        if rope_factor is not None and not kinds:
            raise PosbenchError("--rope-factor needs --rope-scaling, e.g. --rope-scaling yarn")
        if stride is not None and stride <= 0:
            raise PosbenchError(f"--stride {stride} must be positive")
        asked = {
            "eval.perplexity.rope_scaling": (f"--rope-scaling {rope_scaling}", kinds),  # none unless given
            "eval.perplexity.rope_factor": (f"--rope-factor {rope_factor}", rope_factor),
        }
        for key, flag, value in (
            ("eval.lengths", f"--lengths {lengths}", _csv_ints(lengths, "--lengths")),
            ("eval.perplexity.protocol", f"--protocol {protocol}", _protocols(protocol)),
            ("eval.perplexity.stride", f"--stride {stride}", stride),
        ):
            if value is not None:  # else the run's own
                asked[key] = (flag, value)
        rc, measure, rows = evaluate_run(run_dir, asked, device, attention, tracker)
        out.print(plain_table(*measure.evaluation(rc, rows)))
        written = " and ".join(str(Path(run_dir) / name) for name in measure.records)
        out.print(f"wrote {written}", highlight=False, soft_wrap=True)
        _unsent(rc.train.tracker, tracker)


@app.command()
def pretrained(
    model_path: Annotated[
        Path,
        typer.Argument(help="a transformers folder (config.json, weights, tokenizer) or a .gguf", callback=_named),
    ],
    lengths: Annotated[
        Optional[str], typer.Option(help="e.g. 1024,2048,4096 (default: its context and twice it)")
    ] = None,
    test_len: Annotated[
        Optional[int], typer.Option(help="longest test length N: its context and 1/4, 1/2 and all of the way to N")
    ] = None,
    rope_scaling: Annotated[
        Optional[str], typer.Option(help="also score it scaled at evaluation: linear,dynamic,yarn,llama3,longrope")
    ] = None,
    rope_factor: Annotated[Optional[float], typer.Option(help="fixed scale s (default L'/context per length)")] = None,
    protocol: Protocol = None,
    stride: Annotated[
        Optional[float],
        typer.Option(
            help="sliding windows' stride: tokens, or below 1 a fraction of each length (default: its context / 4)"
        ),
    ] = None,
    name: Annotated[
        Optional[str], typer.Option(help="the experiment folder under results/ (default: pretrained)")
    ] = None,
    data: Annotated[Optional[str], typer.Option(help="text files or a glob (default: the Shakespeare corpus)")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
    config: ConfigOpt = None,
    set_: Sets = None,
    measure: MeasureOpt = None,
    measure_option: MeasureOptions = None,
):
    """Score a pretrained causal LM from disk, past its context, as posbench scores its own runs.

    Perplexity and bits per byte at each length, under each protocol and RoPE variant
    (transformers' own code), on posbench's corpus cut by the model's tokenizer; nothing is
    fetched from a hub. Rows go to results/NAME/MODEL/, a report of which joins other pretrained
    models of its context.
    --measure context_gain,key_tokens also scores it by those measures (docs/measures.md), at
    the same lengths, into results/NAME/MODEL/measures/."""
    from posbench.experiment.pretrained import plan_pretrained, run_pretrained
    from posbench.measures.plugin import load_measures

    stride = _whole(stride)
    with user_errors(on_interrupt=_SCORED):
        if test_len is not None and lengths is not None:
            raise PosbenchError("--test-len and --lengths both set the evaluation lengths; give one")
        values = {
            "name": (f"--name {name}", name),
            "train.threads": (f"--threads {threads}", threads),
            "eval.lengths": (f"--lengths {lengths}", _csv_ints(lengths, "--lengths")),
            "eval.perplexity.rope_scaling": (
                f"--rope-scaling {rope_scaling}",
                _csv_names(rope_scaling, "--rope-scaling") or None,
            ),
            "eval.perplexity.rope_factor": (f"--rope-factor {rope_factor}", rope_factor),
            "eval.perplexity.protocol": (f"--protocol {protocol}", _protocols(protocol)),
            "eval.perplexity.stride": (f"--stride {stride}", stride),
            "data.path": (f"--data {data}", data),
            "train.device": (f"--device {device}", device),
        }
        if measure is None and measure_option:
            raise PosbenchError("--measure-option sets an option of a measure named by --measure")
        measures = load_measures(_measure_names(measure), _measure_options(measure_option)) if measure else []
        cfg = _lengths_once(load_config(config, set_ or [], values), test_len)
        _set_threads(cfg.train.threads)
        if "name" not in cfg.origins:
            cfg.name = "pretrained"
        exp, model = plan_pretrained(cfg, model_path, test_len)
        folder, rdir, scored = run_pretrained(exp, model, BarReporter(err), measures)
        _print_measures(model.name, scored, rdir)
        _print_summary(folder, asked=exp.cfg)


@app.command()
def extend(
    source: Annotated[
        Path, typer.Argument(help="a finished run, or an experiment folder: each of its runs", callback=_named)
    ],
    to: Annotated[int, typer.Option("--to", help="the new length L2 to fine-tune at (longer than the trained one)")],
    methods: Annotated[
        str,
        typer.Option(
            help="a comma list of pi, ntk, yarn, abf, pose (rope), interpolate (learned), plain, continue (any); "
            "with parameters: pi@2, pi-keep2, yarn-fast8-slow1, abf-base20000 (docs/extend.md)"
        ),
    ] = "plain",
    steps: Annotated[
        int, typer.Option(help="fine-tuning steps K at L2 (methods at L: K steps on s times the batch)")
    ] = 100,
    lengths: Annotated[
        Optional[str], typer.Option(help="scored lengths (default: the parent's, L2, 2 L2, 4 L2)")
    ] = None,
    lr: Annotated[Optional[float], typer.Option(help="peak learning rate (default: the parent's train.min_lr)")] = None,
    abf_base: Annotated[float, typer.Option(help="abf's RoPE base")] = 500000.0,
    curve: Annotated[
        Optional[str], typer.Option(help="steps scored at L2 while fine-tuning (default 0, K/10, K/4, K/2, K)")
    ] = None,
    out_dir: Annotated[
        Optional[Path],
        typer.Option("--out", help="the folder to write (default: SOURCE-extendL2)", callback=_named),
    ] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
    set_: Sets = None,
    tracker: TrackerOpt = None,
):
    """Fine-tune finished runs at a longer length with each context-extension method, side by side.

    Every method that applies to a run's scheme makes a child run: the parent's weights, the
    method's change, K steps at L2. The parents are copied and scored as they are and with their
    evaluation-time scalings; the report puts all of them side by side (docs/extend.md)."""
    from posbench.experiment.execute import run_extension
    from posbench.extend.methods import parse_methods
    from posbench.extend.run import plan_extension
    from posbench.trackers import check_tracker, usable

    with user_errors():
        _set_threads(threads)
        check_tracker(tracker, "--tracker")
        plan = plan_extension(
            source,
            to,
            parse_methods(methods),
            steps,
            out_dir,
            _csv_ints(lengths, "--lengths"),
            lr,
            abf_base,
            _csv_ints(curve, "--curve"),
            set_ or [],
        )
        tracker = tracker or usable(plan.jobs[0].cfg.train.tracker)  # the parents' own, where it is installed
        run_extension(plan, BarReporter(err), tracker)
        _print_summary([plan.folder], tracker=tracker)


@app.command()
def prepare(
    source: Annotated[str, typer.Argument(help="text files or a glob, .jsonl or .parquet files, or a datasets folder")],
    out_dir: Annotated[
        Path, typer.Option("--out", help="the folder to write (train.bin, val.bin, tokens.json)", callback=_named)
    ],
    tokenizer: Annotated[str, typer.Option(help="bytes, bpe, or a tokenizer.json or sentencepiece .model")] = "bytes",
    vocab_size: Annotated[Optional[int], typer.Option(help="bpe's vocabulary (default 2048)")] = None,
    text_field: Annotated[str, typer.Option(help="the text's field in .jsonl, .parquet and datasets rows")] = "text",
    val_fraction: Annotated[float, typer.Option(help="the tail held out for validation")] = 0.05,
    val_path: Annotated[Optional[str], typer.Option(help="a validation set of its own instead")] = None,
):
    """Tokenize a corpus once into memory-mapped token files; train on it with --set data.path=OUT.

    Training and evaluation then read windows from the files and never load them whole, so a
    corpus of several GB trains in the memory Shakespeare does (docs/text.md)."""
    import time

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from posbench.config import DataConfig, blame
    from posbench.text import prepare as prepare_tokens
    from posbench.text import source_files

    with user_errors(on_interrupt=f"nothing was written to {out_dir}"):
        flags = {"data.tokenizer": f"--tokenizer {tokenizer}", "data.vocab_size": f"--vocab-size {vocab_size}"}
        flags.update({"data.val_fraction": f"--val-fraction {val_fraction}", "data.val_path": f"--val-path {val_path}"})
        try:
            data = DataConfig(
                path=source,
                tokenizer=tokenizer,
                vocab_size=vocab_size,
                text_field=text_field,
                val_fraction=val_fraction,
                val_path=val_path,
            )
        except PosbenchError as e:  # named by its flag, as the user gave it
            raise blame(flags, e) from None
        total = sum(f.stat().st_size for f in source_files(source, "SOURCE") if f.is_file()) or None
        start = time.perf_counter()
        columns = TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn()
        # a bar only where a terminal shows it: into a log it would leave an empty line
        with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("tokenizing", total=total)
            meta = prepare_tokens(data, out_dir, err.print, lambda n: bar.advance(task, n))
        seconds = time.perf_counter() - start
        n = meta["train_bytes"] + meta["val_bytes"]
        size = f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n:,} bytes"
        out.print(
            f"wrote {out_dir}: {meta['train_tokens']:,} training and {meta['val_tokens']:,} validation tokens "
            f"({meta['tokenizer']}, {meta['dtype']}) from {size} in {seconds:.1f} s; "
            f"train on it with --set data.path={out_dir}",
            highlight=False,
        )


@app.command()
def report(
    experiment_dirs: Annotated[
        list[Path], typer.Argument(help="e.g. results/default; several join into one table", callback=_named)
    ],
    metric: Annotated[
        Optional[str],
        typer.Option(help="ppl, loss, ratio (to train_len), bpb (bits per byte); a task: exact_match, token_accuracy"),
    ] = None,
    transpose: Annotated[bool, typer.Option(help="lengths as rows, schemes as columns")] = False,
    out_dir: Annotated[
        Optional[Path], typer.Option("--out", help="where a joined report goes", callback=_named)
    ] = None,
    buckets: Annotated[
        Optional[str], typer.Option(help="a task's length buckets by their last length, e.g. 10,20,30,40")
    ] = None,
):
    """Rebuild the summary tables (Markdown, CSV, LaTeX) and plots from run folders, without training."""
    with user_errors(on_interrupt="nothing was written; the tables and plots from before are kept"):
        from posbench.config import unique

        edges = _csv_ints(buckets, "--buckets")
        if any(e <= 0 for e in edges or []):
            raise PosbenchError(f"--buckets {buckets}: a bucket ends at a positive length")
        unique(edges or [], f"--buckets {buckets}")
        _print_summary(experiment_dirs, metric, transpose, out_dir, edges)


@app.command()
def status(
    experiment_dir: Annotated[
        Path, typer.Argument(help="an experiment folder, e.g. results/sweep-example", callback=_named)
    ],
):
    """Each run of an experiment: pending, done, records (scored, no weights), partial (at which
    step), damaged (a record report would refuse), failed, diverged or running."""
    from posbench.console import status_table
    from posbench.experiment.status import run_status

    with user_errors(on_interrupt="nothing was written"):
        rows = run_status(experiment_dir)
    out.print(status_table(experiment_dir, rows))


@app.command()
def schemes():
    """List the registered positional schemes and their evaluation-time variants."""
    from posbench.console import plain_table
    from posbench.schemes import catalogue

    out.print(plain_table("positional schemes", [["name", "description"], *map(list, catalogue())], left=True))


@app.command()
def bench(
    quick: Annotated[bool, typer.Option(help="a seconds-long run (tiny batch; memory at 1x, 16x, 32x)")] = False,
    peer: Annotated[Optional[str], typer.Option(help="also time a peer library: x-transformers")] = None,
    schemes: Annotated[Optional[str], typer.Option(help="e.g. alibi,rope, or all (default: the config's)")] = None,
    config: Annotated[Optional[Path], typer.Option(help="a YAML config for the model size")] = None,
    set_: Sets = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
    device: Annotated[
        Optional[str], typer.Option(help="auto, cpu or cuda (default: the config's train.device)")
    ] = None,
    attention: Annotated[
        Optional[str],
        typer.Option(
            help="attention backend: auto, eager, sdpa, native, flex or triton; several (sdpa,flex) side by side"
        ),
    ] = None,
    rounds: Annotated[
        Optional[int],
        typer.Option(help="timing rounds (default 30; 5 with --quick, 10 with --task); the model bench needs 2"),
    ] = None,
    out_file: Annotated[Path, typer.Option("--out", help="the CSV to write, or a folder for bench.csv")] = Path(
        "results/bench/bench.csv"
    ),
    data: Annotated[
        bool, typer.Option("--data", help="instead: tokenization MB/s and a memory-mapped batch's share of a step")
    ] = False,
    task: Annotated[
        Optional[str], typer.Option(help="instead: a task's training step, its batch padded whole vs cut by length")
    ] = None,
):
    """Training tokens/s (vs NoPE and a peer), FLOP utilisation, and eval memory up to 64x."""
    with user_errors(
        on_interrupt="nothing was written; an earlier bench.csv is kept",
        on_oom="a smaller model or train.batch_size (--set)",
    ):
        backends = _csv_names(attention, "--attention")  # the model bench times several side by side
        if attention is not None and not backends:
            raise PosbenchError(f"--attention {attention!r}: name a backend, or several: e.g. sdpa,flex")
        values = {
            "schemes": (f"--schemes {schemes}", _scheme_list(schemes) if schemes is not None else None),
            "train.device": (f"--device {device}", device),  # checked with the config's own
            "model.attention": (f"--attention {attention}", backends[0] if backends else None),
            "task": (f"--task {task}", task),
        }
        cfg = load_config(config, set_ or [], values)
        if len(backends) > 1 and (task is not None or data):
            raise PosbenchError(f"--attention {attention}: one backend with --task or --data; several time the model")
        if rounds is not None and rounds < 1:
            raise PosbenchError(f"--rounds {rounds} must be positive")
        if task is not None and data:
            raise PosbenchError("--data and --task are two benchmarks: give one")
        _set_threads(threads)
        if task is not None:  # on the CPU, where training cuts a task's batch by length
            _bench_task(cfg, cfg.schemes if schemes is not None else ["nope"], rounds or 10)
        elif data:  # the corpus's side of a step: nothing is written
            _bench_data(cfg, rounds or 30)
        else:
            _bench_model(cfg, quick, peer, rounds, out_file, backends)


def _bench_task(cfg, timed: list[str], rounds: int) -> None:
    """A task's training step, its batch padded whole against cut by length."""
    from posbench.bench_data import task_benchmarks
    from posbench.console import plain_table

    say = lambda m: err.print(m, highlight=False)  # noqa: E731
    for title, table in task_benchmarks(cfg, timed, rounds, say):
        out.print(plain_table(title, table, left=True))


def _bench_data(cfg, rounds: int) -> None:
    """Tokenization MB/s and a memory-mapped batch's share of a step."""
    from posbench.bench_data import data_benchmark
    from posbench.console import plain_table

    table = data_benchmark(cfg, rounds, err.print)
    out.print(plain_table("the data pipeline (posbench prepare, memory-mapped batches)", table, left=True))


def _bench_model(
    cfg, quick: bool, peer: Optional[str], rounds: Optional[int], out_file: Path, backends: list[str]
) -> None:
    """Training tokens/s against NoPE (and a peer), FLOP utilisation and eval memory, into out_file,
    under each of `backends` side by side (none given: the config's)."""
    from posbench.bench import BenchSettings, check_backends, run_bench, writable_csv, write_bench
    from posbench.console import bench_table
    from posbench.device import pick_device
    from posbench.resolve import resolve_training

    # the bench evaluates at its own multiples of train_len and never reads eval.*, so the
    # config's test lengths must not stop a longer train_len (--set model.train_len=1024)
    cfg = resolve_training(cfg).cfg
    dev = pick_device(cfg.train.device, "bench takes --device cpu")
    check_backends(backends, dev, cfg.model.head_dim)
    out_file = writable_csv(out_file)  # before the minutes of timing, not after
    settings = BenchSettings.quick() if quick else BenchSettings(batch_size=cfg.train.batch_size)
    if rounds is not None:
        if rounds < 2:
            raise PosbenchError(f"--rounds {rounds}: at least two rounds are needed (a time stands when two agree)")
        settings.rounds = rounds
    rows, peak = run_bench(
        cfg.model,
        cfg.schemes,
        settings,
        peer,
        progress=lambda m: err.print(m, highlight=False, soft_wrap=True),
        options=cfg.scheme_options,
        device=dev,
        backends=backends or None,
    )
    write_bench(rows, out_file)
    out.print(bench_table(rows, peak, cfg.model, dev, peer, settings.rounds))
    if quick:  # five rounds skip fewer bursts of load than the fastest of thirty does
        done = f"{settings.rounds} round{'s' * (settings.rounds > 1)}"
        err.print(
            f"note: --quick timed {done} at batch {settings.batch_size}: its tokens/s and ratios are rough; "
            f"run without --quick ({BenchSettings().rounds} rounds) to compare schemes",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    _kernel_notes(cfg)
    out.print(f"wrote {out_file}", highlight=False, soft_wrap=True)


@app.command("check-scheme")
def check_scheme(
    scheme: Annotated[str, typer.Argument(help="a registered name or module:Class")],
    set_: Annotated[
        Optional[list[str]],
        typer.Option("--set", help="one of the scheme's options: key=value, e.g. window=8 (scheme_options.SCHEME)"),
    ] = None,
):
    """Check a scheme at a tiny size: causality, forward, backward, beyond the training length."""
    from posbench.check import run_checks
    from posbench.config import blame, scheme_sets
    from posbench.console import checks_table

    with user_errors(on_interrupt="nothing was written"):
        options, origins = scheme_sets(scheme, set_ or [])
        try:
            results = run_checks(scheme, options or {})
        except PosbenchError as e:
            raise blame(origins, e) from None
    out.print(checks_table(scheme, results))
    failed = [r.name for r in results if not r.ok]
    if failed:
        err.print(f"[bold red]failed:[/] {', '.join(failed)}", highlight=False)
        raise typer.Exit(code=1)


@app.command()
def inspect(
    target: Annotated[str, typer.Argument(help="a scheme (name or module:Class) or a run folder")],
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="default: results/inspect/NAME")] = None,
    length: Annotated[Optional[int], typer.Option(help="positions to draw; default 2x train_len")] = None,
    set_: Annotated[
        Optional[list[str]],
        typer.Option(
            "--set", help="one of the scheme's options: key=value, e.g. fraction=0.25 (scheme_options.SCHEME)"
        ),
    ] = None,
    variant: Annotated[
        Optional[str], typer.Option(help="draw it under an evaluation-time variant: yarn, rerope, lm_infinite, ...")
    ] = None,
):
    """Plot what a scheme does to attention (and, for a trained run, what it learned)."""
    from posbench.config import blame, scheme_sets
    from posbench.plots import inspect_target

    with user_errors(on_oom="a shorter --length", on_interrupt="each plot written is whole; rerun to draw the rest"):
        holder = target if ":" in target or "." not in target else "run"  # a folder's dots are no sections
        options, origins = scheme_sets(holder, set_ or [])
        try:
            paths, layers = inspect_target(target, out_dir, length, options, variant)
        except PosbenchError as e:
            raise blame(origins, e) from None
    for line in layers:  # a pattern over layers: what each layer is
        out.print(line, highlight=False)
    if not paths:
        out.print(f"{target}: its hooks change nothing (NoPE), so there is nothing to draw")
    for p in paths:
        out.print(f"wrote {p}", highlight=False, soft_wrap=True)  # unbroken, to copy and open


def _usage_errors() -> tuple:
    """click's usage errors, from click itself or from the copy newer typers vendor."""
    kinds = []
    with contextlib.suppress(ImportError):
        import click

        kinds.append(click.ClickException)
    with contextlib.suppress(ImportError):
        from typer._click.exceptions import ClickException

        kinds.append(ClickException)
    return tuple(kinds)


def _unsent(own: Optional[str], given: Optional[str]) -> None:
    """A line where a run's own tracker (train.tracker) was not sent the new rows: its library is
    not installed here, and no --tracker was given instead."""
    from posbench.trackers import INSTALL, tracker_installed

    if own is not None and given is None and not tracker_installed(own):
        err.print(
            f"not sent to {own} (the run's train.tracker): its library is not installed here; {INSTALL} "
            f"(or pip install {own}), then evaluate again",
            highlight=False,
        )


def empty_argument(args: list[str]) -> Optional[str]:
    """What names an empty value on the command line, or None. No option or argument of
    posbench's takes "": a path would become the working directory, a choice its default."""
    for i, arg in enumerate(args):
        if arg.startswith("--") and arg.endswith("=") and len(arg) > 3:  # --out=
            return f"{arg[:-1]} is given an empty value"
        if not arg.strip():
            before = args[i - 1] if i > 0 and args[i - 1].startswith("-") else None
            return f"{before} is given an empty value" if before else "an empty argument ('')"
    return None


def main():
    # a console script does not put the working directory on sys.path, so a user's
    # `mymodule:MyScheme` beside their config would not import; add it last, after the installed
    # packages, so that a tokenizers.py or wandb.py where the user stands never runs in their place
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    empty = empty_argument(sys.argv[1:])
    if empty is not None:
        _print_error(f"{empty}; give one, or leave it out for its default")
        return 2
    try:
        code = app(prog_name="posbench", standalone_mode=False)
    except _usage_errors() as e:  # one line, not typer's boxed panel
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `posbench`: typer printed the help
            return 0
        cmd = e.ctx.command_path if getattr(e, "ctx", None) else "posbench"
        _print_error(f"{e.format_message()} (see '{cmd} --help')")
        code = e.exit_code
    except typer.Abort:  # end of input at a prompt
        code = 1
    if code == 130 and not said:  # typer's own exit for a KeyboardInterrupt outside a command's edge: unsaid
        err.print("interrupted: rerun the same command", soft_wrap=True)
    return code if isinstance(code, int) else 0


if __name__ == "__main__":  # python -m posbench.cli is python -m posbench, signals taken first
    import runpy

    runpy.run_module("posbench", run_name="__main__")
