"""``trainmon anomalies RUN_DIR``: every anomaly of a run, earliest first in training-flow order."""

from __future__ import annotations

import argparse
from collections import Counter

from trainmon.analysis.rules import PARAM_CHANGED, Anomaly, ByDesign, Findings, Rules, SpikeRule, Unjudged
from trainmon.cli import CommandError
from trainmon.cli._engine import add_engine_argument, engine_errors, engine_required
from trainmon.cli._options import add_cluster_option, check_recorded, cluster_address, non_negative, rank_list
from trainmon.cli._progress import Progress
from trainmon.diagnosis import engine
from trainmon.diagnosis.engine_buckets import bucket_scan_all
from trainmon.diagnosis.reader import DuplicateKeys, RunDirError, RunTable
from trainmon.diagnosis.report import dump_json, escape, parse_name_list, table
from trainmon.diagnosis.scan import merge_runtime
from trainmon.output.runs import escalations

HELP = "list NaN/Inf and spikes of a run, earliest first in training-flow order"
_RULES = ("nonfinite", "spike", "threshold", PARAM_CHANGED)
_TEXT_LIMIT = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = SpikeRule()
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or its output dir, or one rank dir)")
    parser.add_argument("--json", action="store_true", help="machine-readable output (fields: docs/diagnosis.md)")
    parser.add_argument(
        "--rules",
        default=f"nonfinite,spike,{PARAM_CHANGED}",
        help=f"comma list of {', '.join(_RULES)} (default: nonfinite,spike,{PARAM_CHANGED}; "
        "--threshold adds threshold)",
    )
    parser.add_argument("--ops", default="norm", help="stats the spike/threshold rules watch (default: norm)")
    parser.add_argument(
        "--factor",
        type=float,
        default=default.factor,
        help=f"spike when a value is this many times above/below its baseline (default {default.factor:g})",
    )
    parser.add_argument(
        "--floor",
        type=float,
        default=default.floor,
        help=f"absolute floor added to value and baseline (default {default.floor:g})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=default.warmup,
        help=f"values a series needs before it is judged (default {default.warmup})",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=default.window,
        help=f"values in the running median baseline (default {default.window})",
    )
    parser.add_argument("--threshold", type=float, default=None, help="also flag |value| above this")
    parser.add_argument("--kinds", default=None, help="comma list of families to scan (default: all)")
    parser.add_argument("--ranks", default=None, help="comma list of ranks (default: all)")
    parser.add_argument(
        "--no-runtime", action="store_true", help="ignore the anomalies.jsonl files alerts wrote during the run"
    )
    add_engine_argument(parser)
    add_cluster_option(parser)
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"show at most N entries (text default {_TEXT_LIMIT}, JSON default all; 0 = all)",
    )


def _rules(args: argparse.Namespace) -> Rules:
    chosen = parse_name_list(args.rules) or []
    unknown = [r for r in chosen if r not in _RULES]
    if unknown:
        raise CommandError(f"unknown rule '{unknown[0]}' (allowed: {', '.join(_RULES)})")
    try:
        spike = SpikeRule(args.factor, args.floor, args.warmup, args.window) if "spike" in chosen else None
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    threshold = args.threshold if (args.threshold is not None or "threshold" in chosen) else None
    if "threshold" in chosen and threshold is None:
        raise CommandError("rule 'threshold' needs --threshold VALUE")
    return Rules(
        nonfinite="nonfinite" in chosen,
        spike=spike,
        threshold=threshold,
        ops=tuple(parse_name_list(args.ops) or ("norm",)),
        param_changed=PARAM_CHANGED in chosen,
    )


def _check_names(wanted, have, what: str, path) -> None:
    check_recorded(wanted, have, what, path)


def find(
    args: argparse.Namespace, repeated: DuplicateKeys | None = None
) -> tuple[engine.RunFiles | RunTable, list[Anomaly]]:
    """The run and its anomalies; ``repeated`` (if given) gets the run's repeated keys."""
    run, findings = find_all(args, repeated)
    return run, findings.anomalies


def find_all(
    args: argparse.Namespace, repeated: DuplicateKeys | None = None
) -> tuple[engine.RunFiles | RunTable, Findings]:
    """``find``, with the by-design notes and the spike rule's warm-up (``rules.Findings``)."""
    rules = _rules(args)
    non_negative(args.limit, "--limit")
    kinds, ranks = parse_name_list(args.kinds), rank_list(args.ranks)
    engine_required(getattr(args, "engine", None))
    cluster = cluster_address(args)
    try:
        run = engine.run_files(args.run_dir, families=kinds, ranks=ranks)
    except RunDirError as exc:
        raise CommandError(str(exc)) from None
    _check_names(kinds, run.families_on_disk, "family", run.path)
    _check_names(ranks, run.ranks_on_disk, "rank", run.path)
    if (rules.spike is not None or rules.threshold is not None) and run.stats:
        _check_names(rules.ops, run.stats, "stat", run.path)
    found = _engine_scan(run, rules, quiet=args.json, repeated=repeated, cluster=cluster)
    if not args.no_runtime:
        found.anomalies = merge_runtime(found.anomalies, run.path, kinds=kinds, ranks=ranks, by_design=found.by_design)
    return run, found


def _engine_scan(
    files: engine.RunFiles, rules: Rules, *, quiet: bool, repeated=None, cluster: str | None = None
) -> Findings:
    progress = Progress("anomalies", sum(len(v) for v in files.files.values()), quiet=quiet)
    try:
        with engine_errors(files.path):
            # DuckDB stages and partitions the rows; the one pandas rule set runs per bucket of names.
            return bucket_scan_all(files, rules, progress=progress, duplicates=repeated, cluster=cluster)
    finally:
        progress.done()


def run(args: argparse.Namespace) -> int:
    repeated = DuplicateKeys()  # keys written twice (two runs in one folder): a finding of their own
    run_table, findings = find_all(args, repeated)
    found, notes, unjudged = findings.anomalies, findings.by_design, findings.unjudged
    limit = args.limit if args.limit is not None else (0 if args.json else _TEXT_LIMIT)
    shown = found if limit == 0 else found[:limit]
    by_rule = dict(Counter(a.rule for a in found))
    windows = escalations(run_table.path)
    if args.json:
        dump_json(
            {
                "run_dir": str(run_table.path),
                "ranks": list(run_table.ranks),
                "families": list(run_table.families),
                "count": len(found),
                "by_rule": by_rule,
                "anomalies": [a.to_json() for a in shown],
                "by_design": [n.to_json() for n in notes],
                "spike_unjudged": None if unjudged is None else unjudged.to_json(),
                "escalations": windows,
                "duplicate_keys": repeated.to_json(),
            }
        )
        return 0
    rules_text = ", ".join(f"{k} {v}" for k, v in by_rule.items())
    print(
        f"run: {run_table.path}  ranks: {','.join(map(str, run_table.ranks)) or '-'}  "
        f"anomalies: {len(found)}" + (f" ({rules_text})" if found else "")
    )
    _print_escalations(windows)
    if repeated.count:
        print(repeated.describe())
    if not found:
        print("no anomalies")
        _print_notes(notes, unjudged)
        return 0
    a = found[0]
    print(f"first: step {a.step}, {a.phase}, {a.kind} {escape(a.name)}, rank {a.rank}: {a.op}={a.value:.6g} ({a.rule})")
    table(
        ["step", "phase", "kind", "name", "rank", "micro", "op", "value", "rule", "baseline"],
        [(x.step, x.phase, x.kind, x.name, x.rank, x.micro_step, x.op, x.value, x.rule, x.baseline) for x in shown],
    )
    if len(shown) < len(found):
        print(f"... {len(found) - len(shown)} more (--limit 0 shows all; --json for machines)")
    _print_notes(notes, unjudged)
    return 0


def _print_notes(notes: list[ByDesign], unjudged: Unjudged | None) -> None:
    """What the findings leave out: series non-finite by design, steps the spike rule left unjudged."""
    for n in notes:
        print(n.text(escape(n.name)))
    if unjudged is not None and unjudged.values:
        print(unjudged.text())


def _print_escalations(windows: list[dict]) -> None:
    """The escalation windows of run.json: what fired, where, and which steps were recorded more."""
    if not windows:
        return
    print(f"escalations: {len(windows)}")
    rows = []
    for e in windows:
        t = e.get("trigger") or {}
        held = e.get("history")
        rows.append(
            (
                e.get("times"),
                f"{e.get('first_step')}..{e.get('last_step')}",
                f"{held[0]}..{held[1]}" if isinstance(held, list) and len(held) == 2 else "-",
                t.get("step"),
                t.get("rank"),
                t.get("rule"),
                t.get("kind"),
                t.get("name"),
            )
        )
    table(["#", "window", "history", "alert step", "rank", "rule", "kind", "name"], rows)
