"""The Router's parts (base.py: the event interface they share): live previews, pools that size themselves
(rebalance, with its throughput model, planner.py), and restart recovery."""
