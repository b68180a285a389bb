"""Retention of the offload volume in a run: which images rollout batches still need, and GC passes over them.

`rawmm.contract.gc` removes what is old and not kept; this package decides what is kept (the images of
batches not yet trained, plus the last `keep_steps` trained ones) and runs passes as a run trains.
"""
