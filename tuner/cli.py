"""``recompute-tune``: argument parsing and terminal output; every decision lives in `tuner.session` and
`tuner._commands`, the exit codes in `tuner.exits`."""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from lightning_recompute.errors import RecomputeError
from lightning_recompute.units import format_bytes
from tuner.exits import (
    EXIT_BAD_INPUT,
    EXIT_INFEASIBLE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STORE_FAILED,
    exit_code_of,
)

if TYPE_CHECKING:
    from tuner.recipe import Recipe
    from tuner.summary import SessionSummary, TrialEvent

__all__ = ["build_parser", "main"]

_COMMANDS = {
    "tune": "tune RECIPE (the default: `recompute-tune RECIPE`)",
    "plan": "show the planner's predicted front and its policy for a budget",
    "rollback": "restore the previous good policy (file and MLflow record)",
    "history": "list every promotion, rejection and rollback",
    "schema": "print the recipe's JSON Schema",
}
_SEQ = "with --max-seq-len: "
_HELP = {
    "--n-trials": "trials the study should have measured when this run stops (overrides search.n_trials)",
    "--search-only": "search and report the best policy without the evidence gate or a promotion",
    "--no-plan": "do not profile and plan when setting the study up: seed it with the baselines only",
    "--format": "json: a machine-readable summary on stdout (progress goes to stderr)",
    "--verbose": "after the report, the trials table, the race table, the gate's evidence and the session's notes",
    "--budget": "memory budget, e.g. 20GiB (default: the recipe's, less its margin)",
    "--write": "write the chosen policy to PATH",
    "--meta": "plan on the meta device (nothing allocated) with time estimated for HARDWARE: A100, H100, H200 or L4",
    "--world-size": "predict one rank of N data-parallel ranks (default: the recipe's trainer devices x num_nodes)",
    "--strategy": "the strategy the ranks run (default: the recipe's trainer.strategy; auto is ddp)",
    "--max-seq-len": "instead: per policy family (each mode on every layer, and the best mix), the longest "
    "sequence length that fits the budget, and the predicted step time there",
    "--seq-arg": _SEQ + "the model's and data's constructor argument that sets the sequence length "
    "(set on each that takes it; default seq_len)",
    "--seq-step": _SEQ + "lengths are multiples of N",
    "--seq-cap": _SEQ + "the longest length searched",
    "--allow-over-budget": "restore the earlier policy even when its measured peak is over the recipe's budget now",
}
_FLAG: dict[str, Any] = {"action": "store_true"}
_OPTIONS: list[tuple[str, str, dict[str, Any]]] = [  # (the subcommands, the option, add_argument's arguments)
    ("tune", "--n-trials", {"type": int, "metavar": "N"}),
    ("tune", "--search-only", _FLAG),
    ("tune", "--no-plan", _FLAG),
    ("tune plan history", "--format", {"choices": ("text", "json"), "default": "text"}),
    ("tune", "--verbose", _FLAG),
    ("plan", "--budget", {}),
    ("plan", "--write", {"metavar": "PATH"}),
    ("plan", "--meta", {"metavar": "HARDWARE"}),
    ("plan", "--world-size", {"type": int, "metavar": "N"}),
    ("plan", "--strategy", {"choices": ("ddp", "fsdp", "model_parallel")}),
    ("plan", "--max-seq-len", _FLAG),
    ("plan", "--seq-arg", {"default": "seq_len", "metavar": "NAME"}),
    ("plan", "--seq-step", {"type": int, "default": 64, "metavar": "N"}),
    ("plan", "--seq-cap", {"type": int, "default": 2**20, "metavar": "N"}),
    ("rollback", "--allow-over-budget", _FLAG),
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``tune`` is the default subcommand: ``recompute-tune RECIPE``)."""
    parser = argparse.ArgumentParser(
        prog="recompute-tune",
        description="Find, by measurement, the fastest per-layer activation-recomputation policy"
        " that fits a memory budget.",
        epilog="Exit codes: 0 policy promoted (or already current), 1 nothing promoted, 2 bad recipe, "
        "3 a store failed, 130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_COMMANDS) + "}")
    commands = {name: sub.add_parser(name, help=text) for name, text in _COMMANDS.items()}
    for name in ("tune", "plan", "rollback", "history"):
        commands[name].add_argument("recipe", help="the recipe YAML file")
    for names, flag, kwargs in _OPTIONS:
        for name in names.split():
            commands[name].add_argument(flag, help=_HELP[flag], **kwargs)
    return parser


def command() -> int:
    """The ``recompute-tune`` program: `main`, then `gc.freeze` so that exiting skips the collector's
    slow last walk over every object torch, Lightning and MLflow made (`main` leaves a caller's alone)."""
    import importlib.util

    # Installed without the ``tune`` extra: say what is missing rather than fail on an import.
    absent = [name for name in ("optuna", "mlflow", "pydantic") if importlib.util.find_spec(name) is None]
    if absent:
        print(
            f"recompute-tune: needs {', '.join(absent)}, the tuning service's dependencies: "
            "pip install 'lightning-recompute[tune]'",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    code = main()
    gc.freeze()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] not in _COMMANDS and not args_list[0].startswith("-"):
        args_list.insert(0, "tune")
    parser = build_parser()
    args = parser.parse_args(args_list)
    _quiet_libraries()
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    if getattr(args, "format", "text") != "json":
        return _run(args, sys.stdout)
    # `--format json` puts nothing but the JSON on stdout: anything else printed meanwhile (a user's
    # module, a library, native code) goes to stderr, and the JSON is written once the command is done.
    out = io.StringIO()
    args.error = None
    code = 1  # what the interpreter exits with when an exception escapes
    try:
        with _stdout_to_stderr():
            code = _run(args, out)
            return code
    except BaseException as err:
        args.error = args.error or f"{type(err).__name__}: {err} (the traceback is on stderr)"
        raise
    finally:
        text = out.getvalue()
        if not text:  # ended before its summary: still JSON, saying how it ended
            text = json.dumps({"status": _STATUS.get(code, "failed"), "exit_code": code, "error": args.error}) + "\n"
        sys.stdout.write(text)
        sys.stdout.flush()


_STATUS = {
    EXIT_OK: "ok",
    EXIT_BAD_INPUT: "bad input",
    EXIT_STORE_FAILED: "store failed",
    EXIT_INFEASIBLE: "declined",
    EXIT_INTERRUPTED: "interrupted",
}


def _run(args: argparse.Namespace, out: TextIO) -> int:
    """Run the parsed command; its JSON (``--format json``) goes to ``out``."""
    recipe: Recipe | None = None
    try:
        if args.command == "schema":
            from tuner.recipe import json_schema

            print(json.dumps(json_schema(), indent=2))
            return EXIT_OK
        from tuner.recipe import load

        recipe = load(args.recipe)  # a RecipeError lists every problem of the file
        run = {"tune": _tune, "plan": _plan, "rollback": _rollback, "history": _history}[args.command]
        summary, code = run(recipe, args)
        if summary is not None:
            print(json.dumps(summary.to_dict(), indent=2, default=str), file=out)
        return code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        args.error = "interrupted"
        return EXIT_INTERRUPTED
    except Exception as err:
        # The one handler of every subcommand: a store failing is exit 3 whatever raised it; an error
        # raised on purpose is its message and exit code (`tuner.exits`); anything else is a bug.
        from tuner._stores import store_failure

        failure = None if recipe is None else store_failure(recipe, err)
        known = failure if failure is not None else err if isinstance(err, RecomputeError) else None
        if known is None:
            raise
        print(f"error: {known}", file=sys.stderr)
        args.error = str(known)
        return exit_code_of(known)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send stdout to stderr: ``sys.stdout``, and file descriptor 1 (native code and child processes)."""
    sys.stdout.flush()
    try:
        os.fstat(2)
        saved: int | None = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # a descriptor closed (a daemon's): Python's level only
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _quiet_libraries() -> None:
    """Keep the terminal to the tuner's own lines: no per-trial INFO logs or download progress bars."""
    import logging

    import optuna

    from tuner._stores import bound_tracking_requests

    bound_tracking_requests()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow configures its loggers
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)


# Each command prints its text and returns (None, exit code), or with --format json (its summary, exit code).
Result = tuple[Any, int]


def _tune(recipe: Recipe, args: argparse.Namespace) -> Result:
    from tuner import session

    if args.n_trials is not None and args.n_trials < 1:
        print(f"--n-trials: must be a positive integer, got {args.n_trials}", file=sys.stderr)
        return None, EXIT_BAD_INPUT
    live = sys.stderr if args.format == "json" else sys.stdout
    summary = session.tune(
        recipe,
        n_trials=args.n_trials,
        search_only=args.search_only,
        use_planner=not args.no_plan,
        on_trial=lambda event: print(_trial_line(event), file=live, flush=True),
        on_note=lambda note: print(note, file=sys.stderr, flush=True),
    )
    if args.format == "json":
        return summary, int(summary.exit_code)
    print(_report(summary))
    if args.verbose:
        print(_details(summary))
    return None, int(summary.exit_code)


def _trial_line(event: TrialEvent) -> str:
    r, best = event.record, event.best
    mb = f" mb {r.micro_batch}" if r.micro_batch is not None else ""
    if r.throughput is not None:
        body = f"{_num(r.throughput)} {r.throughput_unit}  peak {_bytes(r.peak_bytes)}  {r.outcome}"
    else:
        body = f"{r.outcome}: {r.reason or ''}".rstrip(": ")
    source = f"  ({r.label})" if r.label else ""
    lead = "best: none feasible yet" if best is None else f"best #{best.number} {best.short} {_num(best.throughput)}"
    return f"[{event.ran}/{event.n_trials}] trial {r.number:>3}  {r.short}{mb}  {body}{source}  | {lead}"


def _report(s: SessionSummary) -> str:
    """What the session decided, in at most 15 lines."""
    from lightning_recompute.modes import MODES

    best, race, path = s.best, s.race, s.policy_path
    raced = race if race is not None and race.ok else None
    where = _micro_batch(best.micro_batch, s.data_batch_size) if best is not None else ""
    # The race's winner may be no trial of this study (the good policy of an earlier one): its figures.
    won = raced.winner if raced is not None and not s.chosen else None
    entrant = raced.entrants.get(won) if raced is not None and won is not None else None
    short = entrant.short if entrant is not None else best.short if best is not None else ""
    head = {
        "promoted": f"promoted {short} at {where}: written to {path}",
        "current": f"unchanged: {short} at {where} is already the good policy ({path})",
        "rejected": f"rejected {short}: the good policy " + (f"in {path} stands" if path else "stays none"),
        "searched": f"best single trial {short} at {where} (--search-only: not gated, nothing written)",
    }.get(s.status, f"{s.status}: nothing promoted")
    lines = ["", head]
    if best is None:
        lines += [f"  {reason}" for reason in s.reasons[:3]]
    else:
        shown = "".join(r.short for r in (best, *s.baselines.values()))
        glyphs = ", ".join(f"{m.glyph} {m.name}" for m in MODES if m.glyph in shown)
        names = s.layer_names
        layers = f"{names[0]} .. {names[-1]}" if len(names) > 2 else ", ".join(names)
        lines.append(f"  one glyph per layer ({layers}): {glyphs}")
        key = won if won is not None and entrant is not None else best.fingerprint
        speed = raced.throughput(key) if raced is not None else None
        source = "in the race" if speed is not None else "its single trial"
        peak = entrant.peak_bytes if entrant is not None else best.peak_bytes
        lines.append(
            f"  {_num(best.throughput if speed is None else speed)} {best.throughput_unit or ''} ({source}), "
            f"peak {_bytes(peak)} of the {_bytes(s.budget_bytes)} limit"
        )
        lines += _vs_lines(s, verbose=False)
        if s.reasons and s.status != "searched":
            checks = ", ".join(r.partition(": ")[0] for r in s.reasons)
            lines.append(f"  gate: {_clip(f'passed {checks}' if s.status == 'promoted' else s.reasons[0])}")
    if s.training_change is not None and s.status in ("promoted", "current"):
        lines.append(f"  in the training job: {s.training_change}")
    ran_text = f"{sum(r.ran for r in s.records)} trials"
    if raced is not None:
        rounds = raced.select_rounds + raced.estimate_rounds
        ran_text += f" and a race of {len(raced.entrants)} policies over {rounds} rounds"
    noted = f", {len(s.notes)} notes" if s.notes else ""
    lines.append(f"  {ran_text}{noted}: --verbose shows them")
    lines.append(f"  browse: {s.mlflow_command}")
    return "\n".join(lines)


def _vs_lines(s: SessionSummary, verbose: bool) -> list[str]:
    """Each baseline once against the best: the race's figure (the report's at the recipe's confidence),
    or why there is none."""
    assert s.best is not None
    figures, ranked, out = s.vs_figures(), s.ranked, []
    for name, rec in s.baselines.items():
        f = figures.get(name)
        if rec.ran and (rec.fingerprint, rec.micro_batch) == (s.best.fingerprint, s.best.micro_batch):
            itself = "the chosen policy" if s.chosen else "the best single trial"
            why = f"this is {itself}, no figure against itself" if verbose else "this policy"
        elif f is not None and verbose:
            why = f["text"]
        elif f is not None:
            spans_zero = ", not significant" if f["low"] < 0.0 < f["high"] else ""
            interval = f"{f['confidence']:.0%} CI {f['low'] * 100:+.1f}..{f['high'] * 100:+.1f}%"
            why = f"{f['gain'] * 100:+.1f}% throughput ({interval}){spans_zero}"
        elif not rec.ran:
            reason = rec.reason if verbose else rec.reason and rec.reason.split(" (")[0]
            why = f"not measured ({rec.outcome}: {reason})" if reason else f"not measured ({rec.outcome})"
        elif not rec.feasible:
            why = "over the budget, not raced" if verbose else "over the limit"
        elif not verbose:
            why = "not raced (one trial only: no figure)"
        elif s.race is not None and rec.fingerprint in s.race.entrants:
            # Raced in the selection only: its figure there is biased by the choice of the winner.
            why = "raced in the selection only ('vs leader' above); no estimation rounds, no 'vs' figure"
        else:
            place = f"ranked {ranked.index(rec) + 1} of {len(ranked)}" if rec in ranked else "measured"
            why = f"not raced (its single trial {place}; no 'vs' figure from one run)"
        line = f"vs {name:<15} {rec.short}: {why}"
        out.append(f"  {line if verbose or rec.ran else _clip(line)}")
    return out


def _clip(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _details(s: SessionSummary) -> str:
    """``--verbose``: every table and note behind the report."""
    lines = [
        "",
        f"study {s.study} on {s.device}: budget limit {_bytes(s.budget_bytes)}; search space {s.search_space}",
        f"{len([r for r in s.records if r.ran])} trials run ({s.trials_this_session} this session)",
        "",
    ]
    ranked, width = s.ranked, max(6, len(s.layer_names))
    if ranked:
        unit = next((r.throughput_unit for r in ranked if r.throughput_unit), "")
        lines.append(f"trials, one run each ({unit}; noise: step-time MAD over median):")
        lines += _table(
            f"{'rank':>4}  {'trial':>5}  {'policy':<{width}}  {'mb':>4}  {'throughput':>12}  {'noise':>6}  "
            f"{'peak':>11}  {'fits':>4}  source"
        )
        baselines = {r.number for r in s.baselines.values()}
        shown = ranked[:10] + [r for r in ranked[10:] if r.number in baselines]
        for r in shown:
            noise = "-" if r.noise_rel is None else f"{r.noise_rel * 100:.1f}%"
            lines.append(
                f"{ranked.index(r) + 1:>4}  {r.number:>5}  {r.short:<{width}}  "
                f"{'-' if r.micro_batch is None else r.micro_batch:>4}  {_num(r.throughput):>12}  {noise:>6}  "
                f"{_bytes(r.peak_bytes):>11}  {'yes' if r.feasible else 'no':>4}  {r.label or ''}"
            )
        if len(shown) < len(ranked):
            lines.append(
                f"  ... {len(ranked) - len(shown)} more (every trial: `--format json`, or trials.csv in MLflow)"
            )
        lines.append("")
    race = s.race
    if race is not None and not race.ok:
        lines += [f"race: {race.outcome}: {race.reason}", ""]
    elif race is not None:
        lines.append(
            f"race: {len(race.entrants)} candidates interleaved in one process, {race.select_rounds} rounds "
            f"({race.stop}), then {race.estimate_rounds} fresh rounds for the figures ({race.unit}):"
        )
        lines += _table(f"  {'policy':<{width}}  {'throughput':>12}  {'vs leader':>26}  {'peak':>11}  entered as", 2)
        for key, e in race.entrants.items():
            iv = race.behind.get(key)
            vs = "leader" if key == race.leader else "-"
            if key != race.leader and iv is not None:
                vs = (
                    f"{(1 / iv.ratio - 1) * 100:+.1f}% ({(1 / iv.high - 1) * 100:+.1f}..{(1 / iv.low - 1) * 100:+.1f}%)"
                )
            status = f"  out: {e.out}" if e.out else f"  (dropped: {e.dropped})" if e.dropped else ""
            lines.append(
                f"{'*' if key == race.winner else ' '} {e.short:<{width}}  {_num(race.throughput(key)):>12}  "
                f"{vs:>26}  {_bytes(e.peak_bytes):>11}  {e.label}{status}"
            )
        lines += [f"  {line}" for line in race.decision_lines() if line] + [""]
    if s.best is not None:
        chosen = "chosen" if s.chosen else "best single trial"
        where = _micro_batch(s.best.micro_batch, s.data_batch_size)
        lines.append(f"{chosen}: trial {s.best.number} {s.best.short} at {where}  peak {_bytes(s.best.peak_bytes)}")
        lines += _vs_lines(s, verbose=True)
    tuned = s.tuned_for
    good_mb = f" (good policy tuned for micro-batch {tuned.micro_batch})" if tuned and tuned.micro_batch else ""
    lines += ["", f"decision: {s.status}{good_mb}"]
    lines += [f"  - {reason}" for reason in s.reasons] + [f"  note: {note}" for note in s.notes]
    if s.policy_path is not None:
        lines.append(f"{'policy written to' if s.status == 'promoted' else 'current good policy in'}: {s.policy_path}")
        if s.training_change is not None:
            lines.append(f"in the training job: {s.training_change}")
    lines.append(f"browse in MLflow: {s.mlflow_command}")
    return "\n".join(lines)


def _table(header: str, indent: int = 0) -> list[str]:
    """A table's header and its rule."""
    return [header, " " * indent + "-" * (len(header) - indent)]


def _plan(recipe: Recipe, args: argparse.Namespace) -> Result:
    from lightning_recompute.planner import format_front
    from lightning_recompute.units import format_seconds
    from tuner import _commands as commands

    if args.max_seq_len and args.write is not None:
        print("error: --write: --max-seq-len chooses no single policy to write", file=sys.stderr)
        return None, EXIT_BAD_INPUT
    if args.max_seq_len:
        s = commands.max_seq_len(
            recipe, budget=args.budget, meta=args.meta, seq_arg=args.seq_arg, step=args.seq_step, cap=args.seq_cap
        )
        if args.format == "json":
            return s, s.exit_code
        print(
            f"longest {s.seq_arg} within {_bytes(s.budget_bytes)} on {s.device}, micro-batch {s.micro_batch} "
            f"(multiples of {s.step}, set on {' and '.join(s.set_on)}; {s.profiles} lengths profiled):"
        )
        print(f"{'family':<12}{s.seq_arg:>10}{'pred peak':>13}{'pred step':>12}{'tokens/s':>12}  policy")
        for f in s.fits:
            if f.plan is None or f.seq_len is None:
                print(f"{f.family:<12}{'-':>10}  not even {s.seq_arg}={s.step} fits")
                continue
            length, tps = f"{'>=' if f.capped else ''}{f.seq_len}", f.tokens_per_s
            print(
                f"{f.family:<12}{length:>10}{_bytes(f.plan.peak_bytes):>13}{format_seconds(f.plan.step_time_s):>12}"
                f"{'-' if tps is None else f'{tps:,.0f}':>12}  {f.plan.short()}"
            )
        return None, s.exit_code
    summary = commands.plan(
        recipe, budget=args.budget, write=args.write, meta=args.meta, world_size=args.world_size, strategy=args.strategy
    )
    if args.format == "json":
        return summary, summary.exit_code
    names = summary.layer_names
    span = ", ".join(names) if len(names) <= 8 else f"{names[0]} .. {names[-1]} ({len(names)})"
    scope = f", {summary.sharding}" if summary.sharding is not None else ""
    print(summary.profile.describe() + "\n")
    print(f"predicted Pareto front{scope} ({len(summary.front)} policies; layers {span}):")
    print(format_front(summary.front, budgets={"budget": summary.budget_bytes}) + "\n")
    chosen = summary.chosen
    if chosen is None:
        print(f"no policy fits {_bytes(summary.budget_bytes)}: {summary.reason}")
        return None, summary.exit_code
    print(f"chosen for {_bytes(summary.budget_bytes)}: {chosen.short()}")
    print(chosen.prediction.describe() + "\n")
    print(chosen.policy.to_yaml().rstrip())
    if summary.written is not None:
        print(f"\npolicy written to {summary.written}")
    return None, summary.exit_code


def _rollback(recipe: Recipe, args: argparse.Namespace) -> Result:
    from tuner import _commands as commands
    from tuner.summary import training_change

    done = commands.rollback(recipe, allow_over_budget=args.allow_over_budget)
    good = done.good
    lines = [f"cleaned up: {line}" for line in done.cleaned]
    if done.file_note is not None:
        lines.append(f"policy file: {done.file_note}")
    if done.rolled_back:
        lines.append(
            f"rolled back: the good policy is now run {good.run_id} ({good.fingerprint}); written to {recipe.output}"
        )
        if done.budget_note is not None:
            lines.append(f"budget: {done.budget_note}")
    else:
        lines.append(f"nothing earlier to roll back to: the good policy stays run {good.run_id} ({good.fingerprint})")
    tuned = good.policy.tuned_for
    change = training_change(tuned)
    lines += [] if tuned is None else [tuned.describe()]
    lines += [] if change is None else [f"in the training job: {change}"]
    print("\n".join([*lines, good.policy.to_yaml().rstrip()]))
    return None, EXIT_OK


def _history(recipe: Recipe, args: argparse.Namespace) -> Result:
    from tuner import _commands as commands

    summary = commands.history(recipe)
    if args.format == "json":
        return summary, EXIT_OK
    if summary.missing is not None:
        print(f"experiment {summary.experiment}: nothing recorded yet (no tracking database at {summary.missing})")
    elif not summary.decisions:
        print(f"experiment {summary.experiment}: no decisions yet")
    for d in summary.decisions:
        print(
            f"{d.seq:>3}  {d.at:%Y-%m-%d %H:%M:%S}  {d.kind.value:<8}  {d.fingerprint or '-':<16}  "
            f"mb {'-' if d.micro_batch is None else d.micro_batch:<4}  "
            f"good {d.previous_good_run_id or '-'} -> {d.new_good_run_id or '-'}  {d.reason}"
        )
    if summary.current_problem is not None:
        print(f"current good policy: unreadable: {summary.current_problem}")
    c = summary.current
    if c is not None:
        print(
            f"current good policy: run {c.run_id} ({c.fingerprint}), throughput {_num(c.throughput)}, "
            f"peak {_bytes(c.peak_bytes)}"
        )
        if c.policy.tuned_for is not None:
            print(f"  {c.policy.tuned_for.describe()}")
    return None, EXIT_OK


def _micro_batch(micro_batch: int | None, data_batch_size: int | None) -> str:
    if micro_batch is not None:
        return f"micro-batch {micro_batch}"
    return f"micro-batch {data_batch_size} (the data's own)" if data_batch_size is not None else "the data's batch size"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _bytes(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)
