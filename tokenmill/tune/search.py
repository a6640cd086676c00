"""The search: optuna's TPE sampler over the settings, each trial a real server (trial.py). A trial whose
first half already misses a target by more than `prune_ratio`, or whose goodput falls below the median of
earlier trials at that point, stops there (optuna's MedianPruner). The objective is the goodput of a
trial that meets every SLO; a trial that misses one scores below every trial that meets them all."""
from __future__ import annotations

import json
import time

from tqdm.auto import tqdm

from tokenmill.tune.slo import SLO, violation
from tokenmill.tune.space import normalize
from tokenmill.tune.trial import Workload, run_trial


def objective_value(result: dict, slos: list[SLO]) -> float:
    if result.get("failed"):
        return -1e9
    miss = violation(result, slos)
    return (result.get("request_goodput") or 0.0) if miss <= 0 else -miss


def search(space: dict[str, list], base_flags: list[str], load: Workload, slos: list[SLO], max_trials: int,
           budget_minutes: float | None, seed: int = 0, prune_ratio: float = 1.0, show_progress: bool = True,
           max_ranks: int | None = None) -> list[dict]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # TPE samples at random for its first trials; on a budget of a few trials, model the results sooner
    startup = max(2, min(10, max_trials // 3))
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    deadline = time.time() + budget_minutes * 60 if budget_minutes else None
    trials: list[dict] = []
    measured: dict[str, tuple[float, bool]] = {}  # settings -> (value, pruned): a repeat is told, not re-run
    bar = tqdm(total=max_trials, desc="Tuning", unit="trial", disable=not show_progress)
    # TPE proposes combinations it has already seen (a small categorical space runs out); those cost no
    # trial, and the asks are bounded so an exhausted space ends the search
    for _ in range(20 * max_trials):
        if len(trials) >= max_trials or (deadline is not None and time.time() > deadline):
            break
        t = study.ask()
        settings = normalize({name: t.suggest_categorical(name, choices) for name, choices in space.items()},
                             max_ranks)
        key = json.dumps(settings, sort_keys=True)
        if key in measured:
            value, pruned = measured[key]
            study.tell(t, state=optuna.trial.TrialState.PRUNED) if pruned else study.tell(t, value)
            continue

        def keep_going(first: dict) -> bool:
            t.report(objective_value(first, slos), step=0)
            miss = violation(first, slos)
            # a trial on track to meet every SLO always finishes: half a workload's goodput is too noisy
            # to rank it; one that misses is stopped when hopeless or below the median so far
            return miss <= 0 or (miss <= prune_ratio and not t.should_prune())

        t0 = time.time()
        result = run_trial(settings, base_flags, load, keep_going)
        value = objective_value(result, slos)
        if result.get("pruned"):
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(t, value)
        measured[key] = (value, bool(result.get("pruned")))
        trials.append({"number": len(trials), "settings": settings, "value": value, "seconds": time.time() - t0,
                       "meets_slo": not result.get("failed") and violation(result, slos) <= 0,
                       "pruned": bool(result.get("pruned")), "failed": result.get("failed"),
                       "result": _summary(result, slos)})
        bar.update(1)
        bar.set_postfix(best=f"{max((x['value'] for x in trials), default=0):.3f}")
    bar.close()
    return trials


def best_trial(trials: list[dict]) -> dict | None:
    ok = [t for t in trials if t["meets_slo"] and not t["pruned"]]
    return max(ok, key=lambda t: t["value"]) if ok else None


def closest_trial(trials: list[dict]) -> dict | None:
    """When no trial meets every SLO: the finished one that misses its worst target by the least."""
    done = [t for t in trials if not t["pruned"] and not t.get("failed")]
    return max(done, key=lambda t: t["value"]) if done else None


def _summary(result: dict, slos: list[SLO]) -> dict:
    keys = {"request_goodput", "request_throughput", "output_throughput", "completed", "duration",
            "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "median_ttft_ms", *[s.key for s in slos]}
    return {k: result.get(k) for k in keys if k in result}
