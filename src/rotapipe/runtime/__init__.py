"""The runtime: device backends, host state, and the executor that walks schedules.

Only this package touches threads, streams, events and device memory.
"""
