"""The optimizer's state in torch instead of trainstreamd: where the daemon is not needed
(offload="auto" finds the state fits the GPU) or has been left.

stock.py         StockOptimizer: torch's AdamW / Adam over the wrapped optimizer's param groups
offload_auto.py  offload="auto": whether the state needs the daemon, and the switch to stock
"""
