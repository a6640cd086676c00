"""`tokenmill tune`: from a latency target to the engine settings that meet it with the most goodput.

    slo.py     "ttft_p99=500ms,tpot_p99=50ms" -> thresholds, checked
    space.py   the settings searched (those the command line does not fix) and their flags
    trial.py   one trial: a real `tokenmill serve` process under the workload, measured as `bench serve` does
    search.py  optuna's TPE over the space, hopeless trials pruned at half their workload, a time budget,
               then the winner and the defaults re-measured side by side
    report.py  the winner as JSON and as a `tokenmill serve` command line; a Markdown report with plots
"""
