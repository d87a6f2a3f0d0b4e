"""The load generator and the colocated-vs-disaggregated comparison (``pdserve loadtest``).

Modules:
- ``workload``: what each request asks for (fixed, uniform, mixed, chat, trace replay).
- ``arrivals``: when requests are sent (Poisson, bursty gamma, all at once), seeded.
- ``driver``: the asyncio client that sends them on time and times every token.
- ``stats``: percentiles, throughput and goodput under SLOs.
- ``sweep``: the same requests at each request rate against one server.
- ``launcher``: starts and stops the servers that ``compare`` measures, at equal resources.
- ``report``: the Markdown table, the JSON with every request, the PNG plots.
- ``cli``: ``pdserve loadtest run`` and ``pdserve loadtest compare``.

See docs/loadtest.md.
"""
