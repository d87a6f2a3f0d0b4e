"""The load generator and the colocated-vs-disaggregated comparison (``pdserve loadtest``).

- ``workload.py``: what each request asks for (fixed, uniform, mixed, chat, trace replay);
- ``arrivals.py``: when requests are sent (Poisson, bursty gamma, all at once), seeded;
- ``driver.py``: the asyncio client that sends them on time and times every token;
- ``stats.py``: percentiles, throughput and goodput under SLOs;
- ``sweep.py``: the same requests at each request rate against one server;
- ``launcher.py``: starts and stops the servers that ``compare`` measures, at equal resources;
- ``report.py``: the Markdown table, the JSON with every request, the PNG plots;
- ``cli.py``: ``pdserve loadtest run`` and ``pdserve loadtest compare``.

See docs/loadtest.md.
"""
