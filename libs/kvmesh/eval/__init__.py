"""`kvmesh eval`: replay a workload against a running mesh (or any OpenAI-compatible endpoint), measure latency,
throughput, cache hits, cost and quality, and gate a change on a baseline. Definitions: docs/evaluation.md.

    workloads.py  workload files -> sessions (one request, or a conversation's turns) with arrival times
    prompts.py    text synthesised for traces: equal hash ids are equal blocks of words
    client.py     one streamed request over aiohttp -> a RequestOutcome (TTFT, every gap, usage, output)
    quality.py    golden exact match and the checks (tool call, response_format schema, contains, regex)
    runner.py     the sessions at their arrival times, --repeats times; what the endpoint says about itself
    metrics.py    one repeat's records -> its metrics; repeats -> means with confidence intervals
    stats.py      Student's t: intervals over repeats and Welch's interval of a difference
    compare.py    the gate: baseline vs result, metric by metric, against --max-regression
    report.py     the HTML report with its plots
    cli.py        `kvmesh eval run|compare`
"""
