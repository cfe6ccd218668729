"""The central router: the request and instance state machine (router.py, steps.py, instances.py), composed with its
scheduling (scheduling/: queue, admission, placement, dispatch, deadlines) and its parts (parts/: previews,
rebalance, recovery, and the throughput and placement models)."""
